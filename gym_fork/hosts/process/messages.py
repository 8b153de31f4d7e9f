"""The process host's control messages: one type per message, and who sends it.

Each travels as a dict ``{"op": OP, field: value, ...}`` in a control-socket frame
(gym_fork/transport/control.py), fds attached with SCM_RIGHTS. The conversations:

1. controller -> zygote (``zygote.py`` / ``zygote_program.py``): the zygote says
   :class:`ZygoteReady` once; :class:`ForkWarmParent` (+ socket, stdout, stderr) is
   answered :class:`WarmParentForked` (+ its pidfd) or :class:`Refused`;
   :class:`Retire` has no answer.
2. controller -> warm parent (``host.py`` / ``parent.py``): :class:`Init` is answered
   :class:`Ready` (+ its pidfd) or :class:`PrepareFailed`; :class:`Spawn` (+
   ``FDS_PER_SANDBOX`` per sandbox) :class:`Spawned` (+ pidfds) or :class:`Refused`;
   :class:`WorkerStatus` :class:`WorkerExit`; :class:`Exit` has no answer.
3. warm parent -> idle sandbox (``idle.py``): :class:`Assign` (+ its fds); or, the
   sandbox leased (:class:`Leased` on the lease channel, from the warm parent to the
   controller), controller -> idle sandbox: the same :class:`Assign`.
4. controller -> worker, on its side socket (``forking.py`` / ``sandbox.py``):
   :class:`CloneFds` (+ ``FDS_PER_SANDBOX`` and its cgroups' fds per clone) goes with the
   ring's FORK request, answered :class:`ClonesForked` (+ pidfds) before the FORK reply
   (none if the FORK is refused: its reply says why). Where the source's /tmp is frozen,
   :class:`FrozenLayer` (+ its new layer) follows the FORK request (the source wakes
   while the layer helper works), and where that layer is not sealed yet the worker says
   :class:`LayerAdopted` and waits for :class:`LayerSealed`.

A warm parent and a worker run env code: what they send is untrusted. Each message is
received with the types expected at that point and checked by the typed-message layer
(gym_fork/transport/typed_messages.py, which says what a receiver is guaranteed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gym_fork.errors import SandboxStartError
from gym_fork.transport.control import MAX_MESSAGE_BYTES

# The typed-message layer, called through this module by the process host's code
# (``M.send(sock, M.Spawn(...))``).
from gym_fork.transport.typed_messages import Message
from gym_fork.transport.typed_messages import close_fds as close_fds
from gym_fork.transport.typed_messages import prepare_decoding as prepare_decoding
from gym_fork.transport.typed_messages import receive as receive
from gym_fork.transport.typed_messages import receive_reply as receive_reply
from gym_fork.transport.typed_messages import send as send
from gym_fork.transport.typed_messages import send_with_pidfds as send_with_pidfds

_M = TypeVar("_M", bound=Message)

# Fds handed to a new sandbox: its slab, channel, side socket, stdout, stderr.
FDS_PER_SANDBOX = 5


@dataclass(frozen=True)
class SandboxSpec:
    """What one new sandbox hosts (in a Spawn or an Assign)."""

    name: str
    indices: list[int]
    origins: list[int]
    ring_capacity: int


# -- controller <-> zygote --------------------------------------------------------------


@dataclass(frozen=True)
class ZygoteReady(Message):
    """Zygote: started and pre-imported, ready to fork."""

    OP = "zygote-ready"
    pid: int


@dataclass(frozen=True)
class ForkWarmParent(Message):
    """Controller: fork a warm parent with this environment and process state; fds: its
    end of the controller's socket, its stdout, its stderr."""

    FDS = 3
    OP = "fork-warm-parent"
    MAX_BYTES = 16 << 20
    environ: dict[str, str]
    state: dict[str, Any]


@dataclass(frozen=True)
class WarmParentForked(Message):
    """Zygote: the warm parent ``pid`` (in the zygote's pid namespace); fd: its pidfd."""

    OP = "warm-parent-forked"
    pid: int
    pidfds: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class ForkLayerHelper(Message):
    """Controller: fork a layer helper (gym_fork/system/layer_helper.py) serving the
    socket end that comes as the fd; ``size_bytes``: its new upper layers' size."""

    FDS = 1
    OP = "fork-layer-helper"
    size_bytes: int


@dataclass(frozen=True)
class LayerHelperForked(Message):
    """Zygote: the layer helper ``pid`` (in the zygote's pid namespace); fd: its pidfd."""

    OP = "layer-helper-forked"
    pid: int
    pidfds: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class Retire(Message):
    """Controller: fork nothing more; exit once the last warm parent has exited."""

    OP = "retire"


# -- controller <-> warm parent ---------------------------------------------------------


@dataclass(frozen=True)
class Init(Message):
    """Controller, first: what to prepare (``setup``: gym_fork.hosts.preparing.init_message)
    and how to live (the pre-import's known names, the controller, the isolation); fds:
    the warm parent's stdout and stderr (pipes the controller drains)."""

    OP = "init"
    FDS = 2
    MAX_BYTES = MAX_MESSAGE_BYTES  # cloudpickled env_fns
    setup: dict[str, Any]
    preimport: dict[str, Any]
    controller_pid: int
    die_with_controller: bool
    isolation: bytes  # cloudpickled IsolationConfig


@dataclass(frozen=True)
class Ready(Message):
    """Warm parent: prepared; fds: its own pidfd."""

    OP = "ready"
    pid: int
    isolation: dict[str, Any]
    preimported: dict[str, Any] | None
    pidfds: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class PrepareFailed(Message):
    """Warm parent: preparing the env_fns raised (gym_fork.hosts.preparing.prepare_failure)."""

    OP = "prepare-failed"
    MAX_BYTES = 64 << 20  # a pickled exception
    error: str
    exception: bytes | None
    traceback: str


@dataclass(frozen=True)
class Spawn(Message):
    """Controller: fork (or take from the idle pool) one sandbox per spec; fds:
    ``FDS_PER_SANDBOX`` per sandbox. ``attach``: the pickled attach argument."""

    OP = "spawn"
    MAX_BYTES = MAX_MESSAGE_BYTES
    workers: list[SandboxSpec]
    attach: bytes | None

    def fd_count(self) -> int:
        return FDS_PER_SANDBOX * len(self.workers)


@dataclass(frozen=True)
class Spawned(Message):
    """Warm parent: the sandboxes' pids (in the tree's pid namespace), a pidfd of each
    that lives; ``idle_discarded``: [pid, state] of stopped idle sandboxes it killed;
    ``lease_channel``: one more fd, after the pidfds, the controller's end of the lease
    channel (once, from the second Spawn on: idle.py)."""

    OP = "spawned"
    pids: list[int]
    idle_discarded: list[list[Any]]
    pidfds: list[bool] = field(default_factory=list)
    lease_channel: bool = False

    def fd_count(self) -> int:
        return super().fd_count() + int(self.lease_channel)


@dataclass(frozen=True)
class Leased(Message):
    """Warm parent, on the lease channel: idle sandbox ``pid`` (the tree's pid) is the
    controller's to assign; fds: a pidfd of it, then its assignment socket."""

    FDS = 1
    OP = "leased"
    MAX_BYTES = 4096
    pid: int
    pidfds: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerStatus(Message):
    """Controller: the exit code of the sandbox ``pid`` (the tree's pid)?"""

    OP = "worker-status"
    pid: int


@dataclass(frozen=True)
class WorkerExit(Message):
    """Warm parent: that sandbox's exit code (negative: a signal), None if unknown."""

    OP = "worker-exit"
    code: int | None


@dataclass(frozen=True)
class Exit(Message):
    """Controller: kill every sandbox and exit."""

    OP = "exit"


@dataclass(frozen=True)
class Refused(Message):
    """Zygote or warm parent: a request failed, and why."""

    OP = "refused"
    error: str


# -- warm parent -> idle sandbox --------------------------------------------------------


@dataclass(frozen=True)
class Assign(Message):
    """Warm parent: become this sandbox; fds: its ``FDS_PER_SANDBOX``."""

    FDS = FDS_PER_SANDBOX
    OP = "assign"
    MAX_BYTES = MAX_MESSAGE_BYTES
    spec: SandboxSpec
    attach: bytes | None


# -- controller <-> worker (its side socket) --------------------------------------------


@dataclass(frozen=True)
class CloneFds(Message):
    """Controller: the fds of ``clones`` clones (``FDS_PER_SANDBOX`` each, then one per
    entry of ``cgroups``, in the order of the FORK request that follows on the ring).
    ``cgroups``: the controllers of each cgroup.procs fd a clone gets (its own groups,
    gym_fork/system/cgroups.py); ``cgroup_errors``: controller -> why a clone has no
    group of its own under it. ``layer_follows``: the layer helper freezes the source's
    /tmp writes meanwhile (gym_fork/system/frozen_layers.py): a :class:`FrozenLayer`
    follows the FORK request. ``fork_id``: the FORK's, as in its request and in every
    side-socket message of it (:func:`receive_for`)."""

    OP = "clone-fds"
    clones: int
    cgroups: list[list[str]] = field(default_factory=list)
    cgroup_errors: dict[str, str] = field(default_factory=dict)
    layer_follows: bool = False
    fork_id: int = 0

    def fds_per_clone(self) -> int:
        return FDS_PER_SANDBOX + len(self.cgroups)

    def fd_count(self) -> int:
        return self.fds_per_clone() * self.clones


@dataclass(frozen=True)
class ForkQuiet(Message):
    """Worker, once it has a FORK whose CloneFds said a layer follows: its env code (in
    the thread that serves) is held off from here until it has taken its new layer, so
    the freeze may begin (a /tmp write of its meanwhile could land in no layer its
    clones hold). Where nothing is frozen, no one waits for it: :func:`receive_for`
    reads past it."""

    OP = "fork-quiet"
    fork_id: int = 0


@dataclass(frozen=True)
class FrozenLayer(Message):
    """Controller, after a FORK whose CloneFds said a layer follows: ``frozen``: the
    source's /tmp writes are a shared read-only layer now, and its new upper layer's fd
    comes with this (else its clones copy its writes); ``sealed``: the frozen layer is
    read-only already (no file of it was open for writing), so no LayerAdopted /
    LayerSealed exchange follows; ``cancelled``: the controller gave the fork up (the
    FORK then fails)."""

    OP = "frozen-layer"
    frozen: bool
    sealed: bool = False
    cancelled: bool = False
    fork_id: int = 0

    def fd_count(self) -> int:
        return int(self.frozen)


@dataclass(frozen=True)
class LayerAdopted(Message):
    """Worker: it keeps the new /tmp layer that came with the FrozenLayer and has reopened
    its /tmp files on it: its frozen layer may be sealed (made read-only)."""

    OP = "layer-adopted"
    fork_id: int = 0


@dataclass(frozen=True)
class LayerSealed(Message):
    """Controller: the frozen layer is read-only (``sealed``), or why not (the FORK
    then fails: its clones would share a layer that can still be written);
    ``cancelled``: the controller gave the fork up (the FORK fails, the layer kept)."""

    OP = "layer-sealed"
    sealed: bool
    why: str = ""
    fork_id: int = 0
    cancelled: bool = False


@dataclass(frozen=True)
class ClonesForked(Message):
    """Worker: its clones' pids, a pidfd of each that lives; ``layer_ms``: how long it
    spent on its /tmp's new layer (waiting for it, adopting it, its seal), 0 where none
    was to come (its word: a figure for benchmarks, never acted on)."""

    OP = "clones-forked"
    pids: list[int]
    pidfds: list[bool] = field(default_factory=list)
    fork_id: int = 0
    layer_ms: float = 0.0


# The side-socket messages of a FORK, as each end reads them; at most MAX_EARLIER of
# earlier FORKs are dropped in one wait (a FORK leaves at most four behind).
MAX_EARLIER = 16
TO_SOURCE: tuple[type[Message], ...] = (CloneFds, FrozenLayer, LayerSealed)
TO_CONTROLLER: tuple[type[Message], ...] = (ForkQuiet, LayerAdopted, ClonesForked)


def receive_for(
    sock: Any,
    fork_id: int,
    expected: type[_M],
    timeout: float,
    what: str,
    earlier: Callable[[Message, list[int]], None] = lambda _message, fds: close_fds(fds),
) -> tuple[_M, list[int]]:
    """The ``expected`` message of FORK ``fork_id`` on a side socket, within ``timeout``
    seconds. A message of an earlier FORK (one given up before all of it was read: its
    source timed out, or the controller failed midway) goes to ``earlier`` (default: its
    fds closed), so that one lost exchange never shifts the later ones. Anything else
    raises SandboxStartError."""
    kinds = TO_SOURCE if expected in TO_SOURCE else TO_CONTROLLER
    deadline = time.monotonic() + timeout
    for _ in range(MAX_EARLIER + 1):  # a peer flooding earlier ones is not waited on for ever
        left = deadline - time.monotonic()
        if left <= 0:
            break
        message, fds = receive_reply(sock, left, what, *kinds)
        number = getattr(message, "fork_id", None)
        if number == fork_id and type(message) is expected:
            return message, fds
        if number == fork_id and type(message) is ForkQuiet:
            close_fds(fds)  # waited for only where a freeze follows: else read past
            continue
        if isinstance(number, int) and number < fork_id:
            earlier(message, fds)
            continue
        close_fds(fds)
        raise SandboxStartError(
            f"{what}: {message.OP} of fork {number} where {expected.OP} of fork {fork_id} was due"
        )
    raise SandboxStartError(f"{what}: no {expected.OP} of fork {fork_id} within {timeout} s")
