"""The process host's control messages: one type per message, who sends it, and the
checks every received one passes.

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
3. warm parent -> idle sandbox (``idle.py``): :class:`Assign` (+ its fds).
4. controller -> worker, on its side socket (``host.py`` / ``sandbox.py``):
   :class:`CloneFds` (+ ``FDS_PER_SANDBOX`` per clone) goes with the ring's FORK request,
   answered :class:`ClonesForked` (+ pidfds) before the FORK reply.

A warm parent and a worker run env code: what they send is untrusted. :func:`decode`
refuses (:class:`~gym_fork.errors.ControlMessageError`, every fd closed) a message that
is not one of the types expected at that point, has other fields, a value of another
type, more items or text than bounded, or another number of fds than it announces.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, overload

from gym_fork.errors import ControlMessageError, SandboxStartError
from gym_fork.system.linux import wait_readable
from gym_fork.transport.control import MAX_MESSAGE_BYTES, recv_message, send_message

# Fds handed to a new sandbox: its slab, channel, side socket, stdout, stderr.
FDS_PER_SANDBOX = 5
MAX_ITEMS = 4096  # items of one list or dict in a message
MAX_TEXT = 1 << 20  # characters of one str


@dataclass(frozen=True)
class Message:
    """Base of every control message; ``OP`` names it on the wire."""

    OP: ClassVar[str]
    MAX_BYTES: ClassVar[int] = 1 << 20  # the largest frame of this type a receiver reads
    FDS: ClassVar[int] = 0  # fds that come with it, besides a pidfd per True in pidfds

    def fd_count(self) -> int:
        """How many fds come with this message."""
        return self.FDS + sum(getattr(self, "pidfds", ()))

    def encode(self) -> dict[str, Any]:
        return {"op": self.OP, **dataclasses.asdict(self)}


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
class Retire(Message):
    """Controller: fork nothing more; exit once the last warm parent has exited."""

    OP = "retire"


# -- controller <-> warm parent ---------------------------------------------------------


@dataclass(frozen=True)
class Init(Message):
    """Controller, first: what to prepare (``recipe``: gym_fork.hosts.base.init_message)
    and how to live (the pre-import's known names, the controller, the isolation)."""

    OP = "init"
    MAX_BYTES = MAX_MESSAGE_BYTES  # cloudpickled env_fns
    recipe: dict[str, Any]
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
    """Warm parent: preparing the env_fns raised (gym_fork.hosts.base.prepare_failure)."""

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
    that lives; ``idle_discarded``: [pid, state] of stopped idle sandboxes it killed."""

    OP = "spawned"
    pids: list[int]
    idle_discarded: list[list[Any]]
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
    """Controller: the fds of ``clones`` clones (``FDS_PER_SANDBOX`` each, in the order
    of the FORK request that follows on the ring)."""

    OP = "clone-fds"
    clones: int

    def fd_count(self) -> int:
        return FDS_PER_SANDBOX * self.clones


@dataclass(frozen=True)
class ClonesForked(Message):
    """Worker: its clones' pids, a pidfd of each that lives."""

    OP = "clones-forked"
    pids: list[int]
    pidfds: list[bool] = field(default_factory=list)


# -- sending and receiving --------------------------------------------------------------

# The types a receiver expects: what it gets is one of them (the checker narrows it).
_A = TypeVar("_A", bound=Message)
_B = TypeVar("_B", bound=Message)
_C = TypeVar("_C", bound=Message)


def send(sock: socket.socket, message: Message, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send ``message`` with ``fds`` (as many as it announces)."""
    if len(fds) != message.fd_count():
        raise ValueError(f"{message.OP}: {len(fds)} fds given, {message.fd_count()} announced")
    send_message(sock, message.encode(), fds=tuple(fds))


def send_with_pidfds(sock: socket.socket, message: Message, pids: list[int]) -> None:
    """Send ``message`` with a pidfd of each of ``pids`` (the receiver learns their pids
    in its own namespace from them); its ``pidfds`` says which came (a process already
    reaped has none)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except ProcessLookupError:
            fds.append(-1)
    try:
        if "pidfds" not in {f.name for f in dataclasses.fields(message)}:
            raise TypeError(f"{message.OP} has no pidfds field")
        message = dataclasses.replace(message, **{"pidfds": [fd >= 0 for fd in fds]})
        send(sock, message, [fd for fd in fds if fd >= 0])
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


@overload
def receive(sock: socket.socket, a: type[_A], /) -> tuple[_A, list[int]]: ...
@overload
def receive(sock: socket.socket, a: type[_A], b: type[_B], /) -> tuple[_A | _B, list[int]]: ...
@overload
def receive(
    sock: socket.socket, a: type[_A], b: type[_B], c: type[_C], /
) -> tuple[_A | _B | _C, list[int]]: ...
def receive(sock: socket.socket, *expected: type[Message]) -> tuple[Message, list[int]]:
    """The next message, which must be one of ``expected``, and its fds (the caller's).
    Raises ``EOFError`` (``ControlMessageError`` for a bad message) with fds closed."""
    raw, fds = recv_message(sock, max(kind.MAX_BYTES for kind in expected))
    return decode(raw, fds, *expected), fds


@overload
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, a: type[_A], /
) -> tuple[_A, list[int]]: ...
@overload
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, a: type[_A], b: type[_B], /
) -> tuple[_A | _B, list[int]]: ...
def receive_reply(
    sock: socket.socket, timeout: float | None, what: str, *expected: type[Message]
) -> tuple[Message, list[int]]:
    """The answer to a request (``what``), within ``timeout`` seconds; a missing, dead
    or malformed answer raises SandboxStartError."""
    if not wait_readable(sock.fileno(), timeout):
        raise SandboxStartError(f"{what}: no answer within {timeout} s")
    try:
        return receive(sock, *expected)
    except ControlMessageError as exc:
        raise SandboxStartError(f"{what}: {exc}") from exc
    except (EOFError, ConnectionError) as exc:
        raise SandboxStartError(f"{what}: the other end closed the connection (died)") from exc


def close_fds(fds: list[int]) -> None:
    """Close fds that came with a message and are not kept."""
    for fd in fds:
        os.close(fd)


def decode(raw: Any, fds: list[int], *expected: type[Message]) -> Message:
    """``raw`` (a received dict) as one of ``expected``, checked field by field."""
    try:
        kinds = {kind.OP: kind for kind in expected}
        op = raw.get("op") if isinstance(raw, dict) else None
        kind = kinds.get(op) if isinstance(op, str) else None
        if kind is None:
            shown = repr(op)[:80] if isinstance(raw, dict) else f"a {type(raw).__name__}"
            raise _refuse(f"expected {' or '.join(kinds)}, got {shown}")
        fields = {k: v for k, v in raw.items() if k != "op"}
        message = _build(kind, fields, kind.OP)
        if message.fd_count() != len(fds):
            raise _refuse(f"{kind.OP}: {len(fds)} fds came, {message.fd_count()} announced")
        return message
    except BaseException:
        close_fds(fds)
        raise


def _refuse(text: str) -> ControlMessageError:
    return ControlMessageError(f"a malformed control message: {text}", reason="malformed")


@functools.cache
def _hints(kind: type) -> dict[str, Any]:
    return {f.name: typing.get_type_hints(kind)[f.name] for f in dataclasses.fields(kind)}


def _build(kind: type, fields: Any, where: str) -> Any:
    hints = _hints(kind)
    if not isinstance(fields, dict):
        raise _refuse(f"{where}: expected a dict, got {type(fields).__name__}")
    missing = dataclasses.MISSING
    required = {
        f.name
        for f in dataclasses.fields(kind)
        if f.default is missing and f.default_factory is missing
    }
    if set(fields) - set(hints) or required - set(fields):
        got = sorted(map(str, fields))[:20]
        raise _refuse(f"{where}: fields {got}, expected {sorted(hints)}")
    return kind(**{k: _check(v, hints[k], f"{where}.{k}") for k, v in fields.items()})


def _check(value: Any, hint: Any, where: str) -> Any:
    """``value`` if it is of type ``hint`` (a dataclass built from its dict), else refused."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is types.UnionType or origin is typing.Union:
        for option in args:
            if option is type(None) and value is None:
                return None
        return _check(value, next(a for a in args if a is not type(None)), where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    if origin in (list, dict):
        if not isinstance(value, origin) or len(value) > MAX_ITEMS:
            raise _refuse(f"{where}: expected a {origin.__name__} of at most {MAX_ITEMS}")
        if origin is list:
            return [_check(item, args[0], f"{where}[]") for item in value]
        return {
            _check(k, args[0], f"{where} key"): _check(v, args[1], f"{where}[{k!r:.40}]")
            for k, v in value.items()
        }
    ok = isinstance(value, hint) and not (hint is int and isinstance(value, bool))
    if not ok or (hint is str and len(value) > MAX_TEXT):
        raise _refuse(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    return value
