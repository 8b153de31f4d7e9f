"""The controller's side of a FORK on the process host: each source gets its clones'
channels, sockets, output pipes and cgroups, and its answer is checked and adopted as
new sandboxes of the tree (the worker's side: ``sandbox.py``). ``ProcessHost.fork_many``
(``host.py``) is :func:`fork_many`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gym_fork.errors import SandboxStartError
from gym_fork.gpu.cuda import ForkUnsafeError
from gym_fork.hosts.base import CloneOrder, ForkJob, WorkerHandle
from gym_fork.hosts.batching import Finishing, fork_overlapped
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process.ends import SandboxEnds, SandboxLink, hand_over
from gym_fork.system import cgroups
from gym_fork.system.held_signals import held
from gym_fork.system.linux import ProcessWatch
from gym_fork.text_safety import escape_controls
from gym_fork.transport.control import MAX_FDS
from gym_fork.transport.typed_messages import adopt_pidfds
from gym_fork.worker import protocol as P

if TYPE_CHECKING:
    from gym_fork.hosts.process.host import ProcessHost

# Sandboxes per spawn or fork message: each takes FDS_PER_SANDBOX fds, and the kernel
# passes at most 253 fds in one message (SCM_MAX_FD).
SPAWN_BATCH = 50
SEAL_WAIT_S = 10.0  # a source reopens its /tmp files: milliseconds (its own wait: 60 s)
QUIET_WAIT_S = 10.0  # a source takes its FORK off its ring and says ForkQuiet: milliseconds
assert SPAWN_BATCH * M.FDS_PER_SANDBOX <= MAX_FDS


def fork_many(
    host: ProcessHost,
    jobs: Sequence[ForkJob],
    num_envs: int,
    ring_capacity: int,
    meanwhile: Callable[[], None] | None = None,
) -> list[list[WorkerHandle]]:
    """Every source gets its clones' channels, sockets and output pipes on its side
    socket and its FORK request (SPAWN_BATCH clones per request) before any answer
    is awaited, so that the sources fork at once (gym_fork.hosts.batching.fork_overlapped:
    a source's reply and side-socket answer are matched in order); ``meanwhile`` runs
    then. A source replies once every clone of its FORK has done its set-up (the
    snapshot pipe of sandbox.py): the clones come back isolated as they will run, their
    HELLO still to come (``measure_born``)."""
    limits = host.config.isolation.limits
    # A clone's cgroup fds come with its others: fewer clones per message then.
    per_clone = M.FDS_PER_SANDBOX + cgroups.fds_per_clone(limits.memory_bytes, limits.processes)
    made = fork_overlapped(
        jobs,
        min(SPAWN_BATCH, MAX_FDS // per_clone),
        lambda job, orders, fds, keep: _start_fork(
            host, job, orders, fds, num_envs, ring_capacity, keep
        ),
        meanwhile,
    )
    return made  # registered with the host as each was adopted


def _start_fork(
    host: ProcessHost,
    job: ForkJob,
    orders: list[CloneOrder],
    slab_fds: list[int],
    num_envs: int,
    ring_capacity: int,
    keep: Callable[[Finishing], None],
) -> None:
    """Send one source its clones' fds and FORK request; ``keep`` gets (signals held) what
    waits for the answer and what adopts the clones, and from then on the caller takes
    the answer whatever comes (a Ctrl-C included); before, this gives the fork up."""
    source = job.source
    link: SandboxLink = source.host_data
    what = f"fork of {source.name}"
    layers = host.tmp_layers
    ends: list[SandboxEnds] = []
    groups: cgroups.CloneGroups | None = None
    fork_id = -1
    frozen: tuple[int, int | None] | None = None
    waiting: Callable[[], Any] | None = None
    layer_said = False  # the source knows whether a layer comes (it waits for one else)
    sealing = False  # _seal_when_adopted begun: the source is told, whatever comes
    kept = False  # the caller has the Finishing: its answer is the caller's to take
    taken: list[list[int]] = []  # the answer, once taken: wait() again returns it
    ended: list[bool] = []  # wait() failed, or the fork was let go of: nothing to adopt

    def wait() -> list[int]:
        """The source's answer: its clones' pids (interruptible: a Ctrl-C lets go of
        the clones' ends, and kills the clones the source makes all the same). Asked
        again, the same answer (or, after a failure, RuntimeError at once)."""
        assert waiting is not None  # asked before the caller could keep this
        if taken:
            return taken[0]
        if ended:
            raise RuntimeError(f"{what}: given up")
        try:
            pids = waiting()
            if isinstance(pids, dict):  # refused: it would share memory with its clones
                raise _shared_memory_refused(source, pids)
            taken.append(pids)
        except BaseException as exc:
            try:
                if isinstance(exc, KeyboardInterrupt) and source.awaiting:
                    # Cut short before the answer: the source forks on, and its clones
                    # are killed once it says which (a second Ctrl-C: left to the tree).
                    _kill_clones_of_given_up(host, link, fork_id, what, waiting)
            finally:
                let_go()
            raise
        return pids

    def let_go() -> None:
        if not ended and groups is not None:
            ended.append(True)
            _let_go(ends, groups)

    def adopt(pids: list[int]) -> list[WorkerHandle]:
        """The clones exist: their handles (the caller holds signals until it keeps
        them: bounded, ClonesForked's deadline)."""
        assert groups is not None  # made before the caller could keep this

        def exchange() -> list[ProcessWatch]:
            # The worker sent a pidfd of each clone on its side socket before replying.
            reply, pidfds = M.receive_for(link.sock, fork_id, M.ClonesForked, 5.0, what)
            if reply.pids != list(pids):
                M.close_fds(pidfds)
                raise SandboxStartError(f"{what}: pidfds do not match")
            watches = host._new_members(adopt_pidfds(reply.pids, reply.pidfds, pidfds), what)
            host.tmp_layers.source_swapped(reply.layer_ms)
            return watches

        try:
            watches = hand_over(ends, exchange)
        except BaseException:
            # Clones killed and not yet gone keep theirs until the tree's are removed.
            cgroups.remove_groups([p for paths in groups.paths for p in paths])
            raise
        handles = [
            end.handle(pid, watch) for end, pid, watch in zip(ends, pids, watches, strict=True)
        ]
        for handle, paths in zip(handles, groups.paths, strict=True):
            if paths:  # removed when the handle is released, i.e. once it is seen gone
                link_of = handle.host_data
                handle.host_data = _CloneLink(link_of.sock, link_of.local_pid, paths)
        return host._register(handles)  # the tree's, from here on (weakly: released ones go)

    try:
        with held():  # made is kept: the except below lets go of them
            made = [SandboxEnds(order.spec, ring_capacity, host._collector()) for order in orders]
            try:
                groups = _clone_groups(host, len(orders))
            except BaseException:
                for end in made:
                    end.handed_over()
                    end.abort()
                raise
            ends = made
        fds = []
        for end, slab_fd, own in zip(ends, slab_fds, groups.fds, strict=True):
            fds += [slab_fd, *end.fds(), *own]
        clones = [[o.source_index, o.branch_index, o.seed, o.spec.name] for o in orders]
        fork_id = next(host.fork_ids)  # in the FORK and each side-socket message of it
        try:
            freezing = layers.may_freeze(source, host.tree_isolation)
            layer_said = not freezing
            handed = M.CloneFds(
                len(orders), groups.controllers, groups.errors, freezing, fork_id=fork_id
            )
            try:
                M.send(link.sock, handed, fds)
            except OSError as exc:  # a timeout, or a stream ended after a torn message
                raise SandboxStartError(
                    f"{what}: its side socket took no message ({exc}): the sandbox did "
                    "not read it in time (after a message cut short there, it never "
                    "will: its steps go on, its forks are refused), or it is gone"
                ) from exc
        finally:
            groups.close_fds()  # the source has its copies
        arg = {
            "clones": clones,
            "num_envs": num_envs,
            "ring_capacity": ring_capacity,
            "fork_id": fork_id,
        }
        with held():  # asked is recorded: the except below gives it up (ring send: at once)
            waiting = job.ask_later(P.FORK, arg)
        if freezing and layers.wrote(source):  # the helper works while the source wakes
            # Its env code is held off before its /tmp is frozen under it.
            M.receive_for(link.sock, fork_id, M.ForkQuiet, QUIET_WAIT_S, what)
            with held():  # the freeze, until its layer is the source's (a Ctrl-C: then)
                if layers.freeze(source) is not None:
                    frozen = layers.take_in_flight(source)
                _send_layer(link, frozen, fork_id)
                layer_said = True
                if frozen is not None:
                    os.close(frozen[0])  # the source's now
        elif freezing:  # nothing to freeze: the source is told so
            _send_layer(link, None, fork_id)
            layer_said = True
        if frozen is not None and frozen[1] is not None:
            sealing = True
            _seal_when_adopted(host, source, link, frozen[1], fork_id, what)
        with held():  # from here the caller takes the answer, whatever comes
            keep(Finishing(wait, adopt, let_go))
            kept = True
    except BaseException:
        if kept:  # a Ctrl-C held until the caller had it: the caller's to finish
            raise
        try:
            if waiting is not None:
                # A freeze the helper made reaches its source even now (a Ctrl-C too),
                # and a source that has its layer is told about its seal.
                due = None if layer_said else (layers.take_in_flight(source) or frozen,)
                unsealed = None if sealing or not layer_said or frozen is None else frozen[1]
                _give_up(host, source, link, waiting, due, unsealed, fork_id, what)
        finally:  # a second Ctrl-C too
            if groups is not None:
                _let_go(ends, groups)
        raise


def _let_go(ends: list[SandboxEnds], groups: cgroups.CloneGroups) -> None:
    """A fork's clones never came: close their ends, remove their cgroups."""
    try:
        for end in ends:
            end.handed_over()
            end.abort()
    finally:
        cgroups.remove_groups([p for paths in groups.paths for p in paths])


def _send_layer(
    link: SandboxLink, frozen: tuple[int, int | None] | None, fork_id: int, cancelled: bool = False
) -> None:
    """Send the source its new /tmp layer (FrozenLayer; ``frozen`` None: none, its clones
    copy its writes; ``cancelled``: the fork is given up, the layer kept all the same).
    A freeze the helper made always reaches its source: its /tmp is the new layer now."""
    token = None if frozen is None else frozen[1]
    layer = M.FrozenLayer(frozen is not None, token is None, cancelled, fork_id)
    # The caller closes the layer's fd, once (after the send, or after giving up on it).
    M.send(link.sock, layer, [] if frozen is None else [frozen[0]])


def _give_up(
    host: ProcessHost,
    source: WorkerHandle,
    link: SandboxLink,
    waiting: Callable[[], Any],
    due: tuple[tuple[int, int | None] | None] | None,
    unsealed: int | None,
    fork_id: int,
    what: str,
) -> None:
    """A FORK asked and then given up by the controller. A source still waiting for its
    layer (``due``: the frozen layer, or None where the helper froze none) is told, with
    the layer where there is one; a source that has its layer (sent, or sent now) and
    waits for its seal (``unsealed``: its token) gets it (else the token stays recorded
    unsealed, and is sealed before the source's next fork): either way it fails the FORK
    at once, and its answer is taken (a source must not be left with a stale one: the
    next request would get it)."""
    token = unsealed
    if due is not None:
        frozen = due[0]
        with held():  # a second Ctrl-C: once the layer is the source's, or recorded lost
            try:
                _send_layer(link, frozen, fork_id, cancelled=True)
            except Exception:  # gone, or deaf
                if frozen is not None:
                    host.tmp_layers.lose(source, "its new /tmp layer could not be sent to it")
                    os.close(frozen[0])
                frozen = None
            else:
                if frozen is not None:
                    os.close(frozen[0])
        if frozen is not None:
            token = frozen[1]
    if token is not None:
        with contextlib.suppress(Exception):
            _seal_when_adopted(host, source, link, token, fork_id, what, given_up=True)
    _kill_clones_of_given_up(host, link, fork_id, what, waiting)


def _kill_clones_of_given_up(
    host: ProcessHost, link: SandboxLink, fork_id: int, what: str, waiting: Callable[[], Any]
) -> None:
    """Take the source's answer to a FORK the controller gave up (a source must not be
    left with a stale one: the next request would get it); where it made its clones
    all the same (it was told too late), kill them: no handle will hold them. Only
    what adoption would take for new sandboxes of the tree is killed (the source is
    untrusted: it could name its warm parent, or a sibling)."""
    with contextlib.suppress(Exception):
        pids = waiting()
        if isinstance(pids, list) and pids:
            reply, pidfds = M.receive_for(link.sock, fork_id, M.ClonesForked, 5.0, what)
            watches = host._new_members(adopt_pidfds(reply.pids, reply.pidfds, pidfds), what)
            for watch in watches:
                try:
                    if watch.fd >= 0:
                        watch.kill()
                finally:
                    watch.close()


def _seal_when_adopted(
    host: ProcessHost,
    source: WorkerHandle,
    link: SandboxLink,
    token: int,
    fork_id: int,
    what: str,
    given_up: bool = False,
) -> None:
    """The source reopened its /tmp files on its new layer (LayerAdopted): make the
    frozen one read-only and tell it (LayerSealed); it forks its clones only then. Done
    right after the layer is sent, whatever other sources of the fork are doing. A layer
    not sealed here (no word from the source in time, a file of it still open for
    writing, a Ctrl-C) stays recorded unsealed from its freeze on: the source's next
    fork seals it first, and is refused until it can. The source is told, whatever
    happened, so that it does not wait out its own deadline (``given_up``: that its
    FORK fails, sealed or not)."""
    sealed, why = False, "the controller gave the fork up"
    try:
        M.receive_for(link.sock, fork_id, M.LayerAdopted, SEAL_WAIT_S, what)
        why = host.tmp_layers.seal(source, token)
        sealed = not why
    except SandboxStartError as exc:  # no word in time: sealed if it can be, all the same
        host.tmp_layers.seal(source, token)
        why = f"its new /tmp layer was not adopted in time ({exc})"
        raise SandboxStartError(f"{what}: {why}") from exc
    except BaseException:  # a Ctrl-C: the source's FORK fails, whatever was sealed
        given_up = True
        raise
    finally:
        with held(), contextlib.suppress(OSError):  # told, or it waits its 60 s out
            said = M.LayerSealed(sealed, escape_controls(why[:500]), fork_id, given_up)
            M.send(link.sock, said)


def _clone_groups(host: ProcessHost, count: int) -> cgroups.CloneGroups:
    """The clones' own cgroups, made here (the trusted side) when the limits ask for
    any: a clone cannot make them (gym_fork/system/cgroups.py)."""
    limits = host.config.isolation.limits
    if limits.memory_bytes is None and limits.processes is None:
        return cgroups.CloneGroups.none(count)
    if host.watch is None or not host.tree_isolation.get("tree", {}).get("pid"):
        # Without a pid namespace of the tree's, whoever holds a group's fd could move
        # any process of the host into it (the controller's too).
        why = "the tree has no pid namespace of its own, so no clone gets a group's fd"
        asked = [("memory", limits.memory_bytes), ("pids", limits.processes)]
        errors = {name: why for name, value in asked if value is not None}
        return cgroups.CloneGroups.none(count, errors)
    # Named by the process the controller started, as the warm parent names its tree.
    return cgroups.make_clone_groups(host.watch.pid, count, limits.memory_bytes, limits.processes)


@dataclass
class _CloneLink(SandboxLink):
    """A clone's link, with its own cgroups (made by the controller): removed with it."""

    cgroups: list[str] = field(default_factory=list)

    def close(self) -> None:
        super().close()
        cgroups.remove_groups(self.cgroups)


def _shared_memory_refused(source: WorkerHandle, refused: dict[str, Any]) -> ForkUnsafeError:
    """The error for a FORK that ``shared_memory="refuse"`` refused, naming what the
    source said its clones would share with it (its words: shown escaped)."""
    names, envs = refused.get("shared_with_source"), refused.get("envs")
    shown = [escape_controls(str(n)[:200]) for n in names[:5]] if isinstance(names, list) else []
    kinds = [escape_controls(str(n)[:100]) for n in envs[:5]] if isinstance(envs, list) else []
    env = f" ({', '.join(kinds)})" if kinds else ""
    return ForkUnsafeError(
        f"fork refused: sub-env(s) {source.indices}{env}, pid {source.pid}, map memory or "
        f"files a fork does not copy: {', '.join(shown) or '(unnamed)'}. A branch's writes "
        "through them would reach its source, and the source's the branch (anonymous "
        "shared memory such as mmap.mmap(-1, n), multiprocessing's RawArray and Value). "
        "Keep the env's state in private memory, or pass shared_memory='warn' to fork "
        "anyway",
        pid=source.pid,
        evidence=shown,
    )
