"""The zygote: one clean, pre-imported interpreter per controller that forks warm parents.

A warm parent must not be a fork of the user's process (threads, locks, a CUDA
context), so it used to be a fresh interpreter: ~0.2 s of start-up and imports per
vector env. The zygote pays that once per controller process (started lazily, or early
with :func:`prestart`): it imports what a warm parent imports, freezes those objects
for copy-on-write, and then forks one warm parent per request. A forked warm parent
runs exactly what a freshly started one runs (``parent.run``) with the controller's
current environment, stdout and stderr.

Lifetime: the zygote exits when the controller closes its socket (at exit) or dies
(watched through a pidfd). Its warm parents get SIGTERM when it exits (PDEATHSIG) and
take their trees down, so a zygote that failed one request is retired, never closed:
it forks nothing more and exits once its last warm parent has. A zygote whose start-up
inputs no longer match the controller's (interpreter, uid/gid, ``PYTHON*``, ``LD_*``,
``MALLOC_*``, ``LC_*``/``LANG``, ``*_NUM_THREADS``, ``GYM_FORK_SPIN``) is kept until a
third set of inputs appears (``MAX_ZYGOTES``), then retired the same way.

``GYM_FORK_ZYGOTE=0`` turns it off (every warm parent is a fresh interpreter again).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from gym_fork.errors import SandboxStartError
from gym_fork.system.linux import ProcessWatch, pidfd_pids, wait_readable
from gym_fork.transport.control import recv_message, send_message

# A zygote is rebuilt when one of these differs: they are read while an interpreter
# starts or while the modules it pre-imports load. Every other variable a warm parent
# gets afresh with each fork (os.environ), so none of them is in the key: gym_fork sets
# some of its own at run time (GYM_FORK_SCRATCH_BASE), which must not cost a zygote.
_KEY_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "LC_", "LANG")
_KEY_SUFFIXES = ("_NUM_THREADS",)
_KEY_NAMES = ("GYM_FORK_SPIN",)  # read when the ring module is imported
# Zygotes kept at once (one per set of start-up inputs); older ones are retired.
MAX_ZYGOTES = 2
EXIT_UNKNOWN = 255  # the exit code of a warm parent its retired zygote no longer knows


def enabled() -> bool:
    """Whether warm parents are forked from a zygote (``GYM_FORK_ZYGOTE``, default on)."""
    return os.environ.get("GYM_FORK_ZYGOTE", "1") != "0"


def zygote_key(env: dict[str, str]) -> tuple:
    """What a zygote's pre-imported state depends on."""
    chosen = sorted(
        (k, v)
        for k, v in env.items()
        if k.startswith(_KEY_PREFIXES) or k.endswith(_KEY_SUFFIXES) or k in _KEY_NAMES
    )
    ids = (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), tuple(os.getgroups()))
    return (sys.executable, ids, tuple(chosen))


def process_state() -> dict[str, Any]:
    """What a fresh interpreter would inherit from the controller besides its
    environment, as it is now: a zygote started earlier passes it to each warm parent."""
    umask = None
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            with contextlib.suppress(OSError, ValueError):
                limits[name] = list(resource.getrlimit(getattr(resource, name)))
    return {
        "umask": umask,
        "rlimits": limits,
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def apply_process_state(state: dict[str, Any]) -> None:
    """In a warm parent forked by a zygote: take on the controller's process state
    (each part best effort: a limit the zygote cannot set is left as it is)."""
    if isinstance(state.get("umask"), int):
        os.umask(state["umask"])
    for name, (soft, hard) in (state.get("rlimits") or {}).items():
        if name.startswith("RLIMIT_") and hasattr(resource, name):
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(getattr(resource, name), (soft, hard))
    with contextlib.suppress(OSError, ValueError, TypeError):
        os.sched_setaffinity(0, state["affinity"])
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        os.setpriority(os.PRIO_PROCESS, 0, state["nice"])


def start_interpreter(module: str, env: dict[str, str]) -> tuple[socket.socket, subprocess.Popen]:
    """``python -m module FD`` with ``env``, and our end of the socket whose other end
    is FD in it."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=env,
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return ours, process


class ForkedParent:
    """A warm parent forked by a zygote: the part of ``subprocess.Popen`` a host uses."""

    def __init__(self, pid: int, pidfd: int, zygote: Zygote) -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._zygote = zygote
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has exited (from the zygote, which reaped it)."""
        if self.returncode is None and self._pidfd >= 0 and wait_readable(self._pidfd, 0):
            code = self._zygote.exit_code(self.pid)
            self.returncode = EXIT_UNKNOWN if code is None else code
            self._close_pidfd()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._pidfd >= 0 and not wait_readable(self._pidfd, timeout):
            raise subprocess.TimeoutExpired(f"warm parent {self.pid}", timeout or 0)
        code = self.poll()
        return EXIT_UNKNOWN if code is None else code

    def watch(self) -> ProcessWatch:
        """A watch of this process on its own copy of the pidfd (never by pid: the
        process is not our child, its pid could be reused once it is reaped)."""
        if self._pidfd < 0:
            return ProcessWatch(self.pid, -1)
        return ProcessWatch(self.pid, os.dup(self._pidfd))

    def kill(self) -> None:
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)

    def _close_pidfd(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1

    def __del__(self) -> None:
        self._close_pidfd()


class Zygote:
    """Controller side of one zygote process."""

    def __init__(self, env: dict[str, str], timeout: float) -> None:
        self.key = zygote_key(env)
        self._lock = threading.Lock()
        ours, self.process = start_interpreter("gym_fork.hosts.process.zygote", env)
        self.sock: socket.socket | None = ours
        try:
            reply, fds = self._reply(timeout, "start")
            _close_all(fds)
            if reply.get("op") != "ready":
                raise SandboxStartError(f"zygote start: unexpected answer {reply!r}")
        except BaseException:
            self.close()
            raise

    def _reply(
        self, timeout: float | None, what: str, status_of: int | None = None
    ) -> tuple[dict, list[int]]:
        """The next answer; a status answer that is not about ``status_of`` (a late one,
        after its request timed out) is dropped."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.sock is None:
                raise SandboxStartError(f"zygote {what}: closed")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not wait_readable(self.sock.fileno(), left):
                raise SandboxStartError(f"zygote {what}: no answer within {timeout} s")
            try:
                reply, fds = recv_message(self.sock)
            except (EOFError, ConnectionError) as exc:
                raise SandboxStartError(f"zygote {what}: it died") from exc
            if not isinstance(reply, dict):
                _close_all(fds)
                raise SandboxStartError(f"zygote {what}: malformed answer")
            if reply.get("op") == "status" and reply.get("pid") != status_of:
                _close_all(fds)
                continue
            return reply, fds

    def alive(self) -> bool:
        return self.sock is not None and self.process.poll() is None

    def fork_parent(
        self, environ: dict[str, str], timeout: float
    ) -> tuple[socket.socket, ForkedParent]:
        """A new warm parent, connected to the returned socket."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out_fd, err_fd = _output_fds()
        try:
            with self._lock:
                if self.sock is None:
                    raise SandboxStartError("zygote fork: closed")
                send_message(
                    self.sock,
                    {"op": "fork", "environ": environ, "state": process_state()},
                    fds=(theirs.fileno(), out_fd, err_fd),
                )
                reply, fds = self._reply(timeout, "fork")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            for fd in (out_fd, err_fd):
                os.close(fd)
        pid = reply.get("pid")
        if reply.get("op") != "forked" or len(fds) != 1 or not isinstance(pid, int):
            _close_all(fds)
            ours.close()
            raise SandboxStartError(f"zygote fork: {reply.get('error', reply)!r}")
        pids = pidfd_pids(fds[0])
        if not pids or pids[-1] != pid:
            _close_all(fds)
            ours.close()
            raise SandboxStartError(f"zygote fork: not a pidfd of process {pid}")
        return ours, ForkedParent(pids[0], fds[0], self)

    def exit_code(self, pid: int) -> int | None:
        """The exit code of a warm parent it forked, None if it no longer knows."""
        with self._lock:
            try:
                send_message(self.sock, {"op": "status", "pid": pid})
                reply, fds = self._reply(2.0, "status", status_of=pid)
            except (OSError, SandboxStartError, TypeError, AttributeError):
                return None
        _close_all(fds)
        code = reply.get("code")
        return code if isinstance(code, int) else None

    def retire(self) -> None:
        """Fork nothing more; exit once every warm parent it forked has exited."""
        with self._lock, contextlib.suppress(OSError, AttributeError):
            send_message(self.sock, {"op": "retire"})
        self._forget()

    def close(self) -> None:
        """Exit now (its warm parents get SIGTERM and take their trees down)."""
        self._forget()
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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


# -- the controller's zygotes -----------------------------------------------------------

_zygotes: dict[tuple, Zygote] = {}
_starting: dict[tuple, threading.Event] = {}
_registry_lock = threading.Lock()


def fork_warm_parent(
    env: dict[str, str], timeout: float
) -> tuple[socket.socket, ForkedParent] | None:
    """A warm parent forked from this controller's zygote for ``env`` (started on first
    use), or None when zygotes are off or the zygote failed (the caller then starts a
    fresh interpreter; a failed zygote is replaced next time)."""
    if not enabled():
        return None
    key = zygote_key(env)
    try:
        zygote = _zygote_for(env, timeout)
    except (OSError, SandboxStartError):
        return None
    try:
        return zygote.fork_parent(env, timeout)
    except (OSError, SandboxStartError):
        # Retired, not closed: its warm parents (other vector envs) die with it.
        with _registry_lock:
            if _zygotes.get(key) is zygote:
                _zygotes.pop(key).retire()
        return None


def _zygote_for(env: dict[str, str], timeout: float) -> Zygote:
    """The live zygote for ``env``'s key, started if there is none (older ones retired).

    A zygote starts outside the registry lock (a fork of this process meanwhile must not
    inherit a held lock); threads that need the same key wait for the one starting it."""
    key = zygote_key(env)
    while True:
        with _registry_lock:
            zygote = _zygotes.get(key)
            if zygote is not None and not zygote.alive():
                _zygotes.pop(key).close()
                zygote = None
            if zygote is not None:
                return zygote
            starting = _starting.get(key)
            if starting is None:
                starting = _starting[key] = threading.Event()
                break
        starting.wait(timeout)  # another thread is starting it: then look again
    try:
        zygote = Zygote(env, timeout)
    finally:
        with _registry_lock:
            _starting.pop(key, None)
        starting.set()
    with _registry_lock:
        _zygotes[key] = zygote
        while len(_zygotes) > MAX_ZYGOTES:
            _zygotes.pop(next(iter(_zygotes))).retire()
    return zygote


def prestart(wait: bool = False) -> None:
    """Start this controller's zygote now (in a background thread unless ``wait``), so
    that even the first vector env's warm parent is a fork: call it early, e.g. before
    loading a model. Errors are left to the first vector env, which retries."""

    def start() -> None:
        from gym_fork.hosts.process.host import warm_parent_environment

        if enabled():
            with contextlib.suppress(OSError, SandboxStartError):
                _zygote_for(warm_parent_environment(), 60.0)

    if wait:
        start()
    else:
        threading.Thread(target=start, name="gym_fork-zygote-start", daemon=True).start()


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
    """In a fork of the controller: the zygotes (and any start in progress, and the
    lock's state) are the parent's. Drop them; this process starts its own if it needs
    one."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _starting.clear()
    for zygote in _zygotes.values():
        if zygote.sock is not None:
            zygote.sock.close()  # our copy only: the parent's stays connected
            zygote.sock = None
    _zygotes.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(shutdown)


# -- the zygote process -----------------------------------------------------------------


class _ZygoteProcess:
    """The zygote's own state: the warm parents it forked and their exit codes."""

    def __init__(self, sock: socket.socket, controller: int) -> None:
        self.sock = sock
        self.controller = controller
        self.children: set[int] = set()
        self.exit_codes: dict[int, int] = {}
        self.retired = False

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.exit_codes[pid] = os.waitstatus_to_exitcode(status)

    def serve(self) -> None:
        watched = [self.sock, self.controller]
        while True:
            readable, _, _ = select.select(watched, [], [], 0.2)
            self.reap()
            if self.controller in readable:
                return  # the controller died
            if self.retired and not self.children:
                return
            if self.sock not in readable:
                continue
            try:
                message, fds = recv_message(self.sock)
            except (EOFError, ConnectionError):
                if not self.retired:
                    return
                watched = [self.controller]
                continue
            self.handle(message, fds)

    def handle(self, message: Any, fds: list[int]) -> None:
        op = message.get("op") if isinstance(message, dict) else None
        if op == "fork" and len(fds) == 3 and not self.retired:
            self.fork(message.get("environ") or {}, message.get("state") or {}, *fds)
        elif op == "status":
            _close_all(fds)
            pid = message.get("pid")
            code = self.exit_codes.pop(pid, None) if isinstance(pid, int) else None
            send_message(self.sock, {"op": "status", "pid": pid, "code": code})
        elif op == "retire":
            _close_all(fds)
            self.retired = True
        else:
            _close_all(fds)
            send_message(self.sock, {"op": "error", "error": f"zygote: refused {op!r}"})

    def fork(
        self,
        environ: dict[str, str],
        state: dict[str, Any],
        parent_end: int,
        out_fd: int,
        err_fd: int,
    ) -> None:
        from gym_fork.hosts.process.sandbox import send_with_pidfds

        sys.stdout.flush()
        sys.stderr.flush()
        me = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:  # EAGAIN, ENOMEM: this request fails, the zygote serves on
            _close_all([parent_end, out_fd, err_fd])
            send_message(self.sock, {"op": "error", "error": f"zygote fork: {exc}"})
            return
        if pid == 0:
            self._become_warm_parent(me, environ, state, parent_end, out_fd, err_fd)
        _close_all([parent_end, out_fd, err_fd])
        self.children.add(pid)
        send_with_pidfds(self.sock, {"op": "forked", "pid": pid}, [pid])

    def _become_warm_parent(
        self,
        zygote: int,
        environ: dict[str, str],
        state: dict[str, Any],
        parent_end: int,
        out_fd: int,
        err_fd: int,
    ) -> None:
        from gym_fork.hosts.process import parent
        from gym_fork.system import linux

        code = 1
        try:
            linux.die_with_parent(zygote, signal.SIGTERM)  # SIGTERM: the cleanup runs
            self.sock.close()
            os.dup2(out_fd, 1)
            os.dup2(err_fd, 2)
            _close_all([out_fd, err_fd])
            os.environ.clear()
            os.environ.update(environ)
            apply_process_state(state)
            parent.run(socket.socket(fileno=parent_end), controller=self.controller)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller decides about Ctrl-C
    controller_pid = os.getppid()
    try:
        controller = os.pidfd_open(controller_pid)
    except ProcessLookupError:
        os._exit(70)
    if os.getppid() != controller_pid:
        os._exit(70)  # the controller died before we watched it
    # What every warm parent imports, once: its forks share these pages.
    import gymnasium.envs.registration  # noqa: F401

    import gym_fork.hosts.process.parent
    import gym_fork.hosts.process.sandbox  # noqa: F401
    from gym_fork.system import confine

    with contextlib.suppress(Exception):  # a warm parent reports the reason itself
        confine.prepare_seccomp()  # built once (~8 ms); every fork only loads it

    gc.collect()
    gc.freeze()
    zygote = _ZygoteProcess(sock, controller)
    try:
        send_message(sock, {"op": "ready", "pid": os.getpid()})
        zygote.serve()
    except (OSError, EOFError):
        pass


if __name__ == "__main__":
    main()
