"""The controller's zygotes: the client side of ``zygote_program.py``, which forks warm
parents.

A warm parent must not be a fork of the user's process (threads, locks, a CUDA
context), so it used to be a fresh interpreter: ~0.2 s of start-up and imports per
vector env. A zygote pays that once per controller process and then forks one warm
parent per request, which runs exactly what a freshly started one runs (``parent.run``)
with the controller's current environment, stdout and stderr. The zygote does that one
job: the controller watches each warm parent through the pidfd that comes with the
answer.

Start: when the controller first looks up ``gym_fork.ForkVectorEnv`` or ``make_vec``
(:func:`start_early`, launched by ``gym_fork/zygote_launch.py`` before this module is
imported), so that it imports (~0.25 s of CPU) while the user's script goes on; else at
:func:`prestart` or the first vector env. Starting costs the controller a ``Popen``;
the first fork waits for the zygote's ready message. ``import gym_fork`` alone (the
CLI, a warm parent, a sandbox) starts none.

Lifetime: a zygote exits when the controller closes its socket (at exit) or dies. Its
warm parents get SIGTERM when it exits (PDEATHSIG) and take their trees down, so a
zygote that failed one request is retired, never closed: it forks nothing more and
exits once its last warm parent has (and the last layer helper it forked for a process
host: gym_fork/system/layer_helper.py, which ends when its host closes). A zygote whose
start-up inputs no longer match the controller's (interpreter, uid/gid, ``PYTHON*``,
``LD_*``, ``MALLOC_*``, ``LC_*``/``LANG``, ``*_NUM_THREADS``, ``GYM_FORK_SPIN``) is
retired the same way when a zygote for the new inputs starts: one is live at a time. A
zygote no vector env has used is killed instead (it may still be importing: an exit must
not wait for that).

``GYM_FORK_ZYGOTE=0`` turns it off (every warm parent is a fresh interpreter again).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import threading

from gym_fork import zygote_launch
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.process import messages as M
from gym_fork.system.inherited import inherited_state
from gym_fork.system.linux import ProcessWatch, pidfd_pids
from gym_fork.zygote_launch import (
    enabled,
    start_interpreter,
    warm_parent_environment,
    zygote_key,
)


class Zygote:
    """Controller side of one zygote process (``sock``: our end of its socket).

    Starting one costs the controller a ``Popen`` (milliseconds); the zygote imports in
    the background and says it is ready, which the first :meth:`fork_parent` waits for."""

    def __init__(self, key: tuple, sock: socket.socket, process: subprocess.Popen) -> None:
        self.key = key
        self._lock = threading.Lock()
        self.process = process
        self.sock: socket.socket | None = sock
        self.ready = False
        self.forked = 0  # warm parents asked for; a zygote never asked gives way (_register)

    def alive(self) -> bool:
        return self.sock is not None and self.process.poll() is None

    def wait_ready(self, timeout: float) -> None:
        """Wait for the zygote's ready message (once): it started and pre-imported."""
        with self._lock:
            self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        if self.sock is None:
            raise SandboxStartError("zygote start: closed")
        if not self.ready:
            M.receive_reply(self.sock, timeout, "zygote start", M.ZygoteReady)
            self.ready = True

    def fork_parent(
        self, environ: dict[str, str], timeout: float
    ) -> tuple[socket.socket, ProcessWatch]:
        """A new warm parent, connected to the returned socket, and a watch of it (by
        the pidfd that came with the answer: it is not our child, and its pid could be
        reused once the zygote reaps it)."""
        out_fd, err_fd = _output_fds()
        try:
            with self._lock:
                self.forked += 1
                self._wait_ready(timeout)
                request = M.ForkWarmParent(environ, inherited_state())
                return self._fork(request, (out_fd, err_fd), M.WarmParentForked, timeout)
        finally:
            for fd in (out_fd, err_fd):
                os.close(fd)

    def fork_layer_helper(
        self, size_bytes: int, timeout: float
    ) -> tuple[socket.socket, ProcessWatch]:
        """A layer helper (gym_fork/system/layer_helper.py) serving the returned socket,
        and a watch of it; only from a zygote that is ready (SandboxStartError else: a
        fresh one is quicker than waiting for its imports)."""
        with self._lock:
            if not self.ready:
                raise SandboxStartError("zygote fork: not ready")
            request = M.ForkLayerHelper(size_bytes)  # its protocol is one message a packet:
            return self._fork(request, (), M.LayerHelperForked, timeout, socket.SOCK_SEQPACKET)

    def _fork(
        self,
        request: M.ForkWarmParent | M.ForkLayerHelper,
        fds: tuple[int, ...],
        answer: type[M.WarmParentForked] | type[M.LayerHelperForked],
        timeout: float,
        kind: int = socket.SOCK_STREAM,
    ) -> tuple[socket.socket, ProcessWatch]:
        """Ask for one fork (under the lock): its end of a new socket (of ``kind``)
        goes first, then ``fds``; the answer's pidfd becomes the watch."""
        if self.sock is None:
            raise SandboxStartError("zygote fork: closed")
        ours, theirs = socket.socketpair(socket.AF_UNIX, kind)
        try:
            M.send(self.sock, request, (theirs.fileno(), *fds))
            reply, got = M.receive_reply(self.sock, timeout, "zygote fork", answer, M.Refused)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        if isinstance(reply, M.Refused):
            ours.close()
            raise SandboxStartError(f"zygote fork: {reply.error}")
        pids = pidfd_pids(got[0]) if len(got) == 1 else []
        if not pids or pids[-1] != reply.pid:
            M.close_fds(got)
            ours.close()
            raise SandboxStartError(f"zygote fork: not a pidfd of process {reply.pid}")
        return ours, ProcessWatch(pids[0], got[0])

    def retire(self) -> None:
        """Fork nothing more; exit once every warm parent it forked has exited (at once
        if it never forked one: then nothing of it is worth waiting for)."""
        if not self.forked:
            self.close()
            return
        with self._lock, contextlib.suppress(OSError):
            if self.sock is not None:
                M.send(self.sock, M.Retire())
        self._forget()

    def close(self) -> None:
        """Exit now (its warm parents get SIGTERM and take their trees down). One that
        never forked a warm parent is killed: it may still be importing, and an exit
        must not wait for that."""
        self._forget()
        if not self.forked:
            with contextlib.suppress(OSError):
                self.process.kill()
        try:
            self.process.wait(2.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _forget(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            sock.close()


def _output_fds() -> tuple[int, int]:
    """Copies of this process's stdout and stderr (or /dev/null where one is closed)
    for a new warm parent: they may have been redirected since the zygote started."""
    fds = []
    for fd in (1, 2):
        try:
            fds.append(os.dup(fd))
        except OSError:
            fds.append(os.open(os.devnull, os.O_WRONLY))
    return fds[0], fds[1]


# -- the controller's zygotes -----------------------------------------------------------

_zygotes: dict[tuple, Zygote] = {}
_registry_lock = threading.Lock()


def fork_warm_parent(
    env: dict[str, str], timeout: float
) -> tuple[socket.socket, ProcessWatch] | None:
    """A warm parent forked from this controller's zygote for ``env`` (started on first
    use), or None when zygotes are off or the zygote failed (the caller then starts a
    fresh interpreter; a failed zygote is replaced next time)."""
    if not enabled():
        return None
    key = zygote_key(env)
    zygote = None
    try:
        zygote = _zygote_for(env)
        return zygote.fork_parent(env, timeout)
    except (OSError, SandboxStartError):
        # Retired, not closed: its warm parents (other vector envs) die with it.
        with _registry_lock:
            if zygote is not None and _zygotes.get(key) is zygote:
                _zygotes.pop(key).retire()
        return None


def fork_layer_helper(
    size_bytes: int, timeout: float = 5.0
) -> tuple[socket.socket, ProcessWatch] | None:
    """A layer helper forked from this controller's live, ready zygote (a millisecond or
    two), or None where there is none (zygotes off, none started, still importing, or
    failing): the caller then starts a fresh interpreter."""
    if not enabled():
        return None
    with _registry_lock:
        ready = [z for z in _zygotes.values() if z.alive() and z.ready]
    for zygote in ready:
        try:
            return zygote.fork_layer_helper(size_bytes, timeout)
        except (OSError, SandboxStartError):
            # Retired, as fork_warm_parent does: a late answer would meet the next request.
            with _registry_lock:
                if _zygotes.get(zygote.key) is zygote:
                    _zygotes.pop(zygote.key).retire()
            return None
    return None


def start_warm_parent(
    timeout: float | None, pass_env: tuple[str, ...] | bool = ()
) -> tuple[socket.socket, ProcessWatch, subprocess.Popen | None]:
    """A new warm parent, the socket to it and a watch of it: a fork of the controller's
    zygote, or (zygotes off or failing) a fresh interpreter, then also its Popen (ours
    to reap)."""
    env = warm_parent_environment(pass_env)
    forked = fork_warm_parent(env, 60.0 if timeout is None else timeout)
    if forked is not None:
        return (*forked, None)
    sock, process = start_interpreter("gym_fork.hosts.process.parent", env)
    return sock, ProcessWatch(process.pid), process


def _zygote_for(env: dict[str, str]) -> Zygote:
    """The live zygote for ``env``'s key, started if there is none."""
    key = zygote_key(env)
    displaced = []
    with _registry_lock:
        zygote = _live(key)
        if zygote is None:
            # Started with the allowlist alone: a warm parent gets its pass_env at its fork
            # (its environ), and the zygote's exec environment is every fork's.
            started = start_interpreter(zygote_launch.ZYGOTE_PROGRAM, warm_parent_environment())
            zygote = Zygote(key, *started)
            displaced = _register(zygote)
    for old in displaced:  # outside the lock: one may be busy forking for another thread
        old.retire()
    return zygote


def _live(key: tuple) -> Zygote | None:
    """The registry's live zygote for ``key`` (a dead one is dropped); under the lock."""
    zygote = _zygotes.get(key)
    if zygote is not None and not zygote.alive():
        _zygotes.pop(key).close()
        return None
    return zygote


def _register(zygote: Zygote) -> list[Zygote]:
    """Make ``zygote`` the live one, under the lock; returns the one before (for start-up
    inputs the controller has changed since), for the caller to retire once it has let
    go of the lock."""
    displaced = [_zygotes.pop(key) for key in [k for k in _zygotes if k != zygote.key]]
    _zygotes[zygote.key] = zygote
    return displaced


def prestart(wait: bool = False) -> None:
    """Start this controller's zygote now, so that even the first vector env's warm
    parent is a fork: call it early, e.g. before loading a model. It imports in the
    background; ``wait``: until it is ready. Errors are left to the first vector env,
    which retries."""
    if not enabled():
        return
    with contextlib.suppress(OSError, SandboxStartError):
        zygote = _zygote_for(warm_parent_environment())
        if wait:
            zygote.wait_ready(60.0)


def start_early() -> bool:
    """Start the zygote when the controller first looks up ``gym_fork.ForkVectorEnv``
    (or ``make_vec``): it imports while the controller goes on with the user's script,
    and the first vector env finds it ready (where and when:
    :func:`gym_fork.zygote_launch.launch_early`). Returns whether it started one."""
    started = zygote_launch.launch_early()
    adopt_early()
    return started


def adopt_early() -> None:
    """Take the zygote ``gym_fork.zygote_launch`` launched early into this registry."""
    early = zygote_launch.take_early()
    if early is None:
        return
    launched = Zygote(*early)
    displaced = []
    with _registry_lock:
        if _live(launched.key) is not None:  # one started since (prestart): keep that one
            launched.close()
        else:
            displaced = _register(launched)
    for old in displaced:
        old.retire()


def running() -> list[tuple[int, int]]:
    """(pid, controller-side socket fd) of this process's live zygotes: tests leave
    them out of their leak checks, since a zygote lives as long as its controller."""
    with _registry_lock:
        return [(z.process.pid, z.sock.fileno()) for z in _zygotes.values() if z.sock is not None]


def shutdown() -> None:
    """Stop every zygote of this process (at exit; also usable by hand)."""
    with _registry_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zygote in zygotes:
        zygote.close()


def _after_fork_in_child() -> None:
    """In a fork of the controller: the zygotes (and the lock's state) are the
    parent's. Drop them; this process starts its own if it needs one."""
    global _registry_lock
    _registry_lock = threading.Lock()
    for zygote in _zygotes.values():
        if zygote.sock is not None:
            zygote.sock.close()  # our copy only: the parent's stays connected
            zygote.sock = None
    _zygotes.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)
