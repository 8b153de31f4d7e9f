"""Launching the process host's zygote interpreter; its client is
``gym_fork/hosts/process/zygote.py``, the program ``zygote_program.py``.

Apart from the client because importing anything under ``gym_fork.hosts`` loads the
host interface and its transport first (~70 ms of CPU after gymnasium, measured on 2
loaded cores): the lookup of ``gym_fork.ForkVectorEnv`` launches the zygote with only
what this module imports, then imports the rest while the zygote starts (the zygote,
importing for ~0.3 s, is the first vector env's long pole). The client adopts the
launched zygote when it is imported (:func:`take_early`).

``GYM_FORK_ZYGOTE=shared`` (opt-in, a prototype) keeps one zygote across the processes
of a user with the same start-up inputs (:func:`connect_shared`): a socket in a 0700
directory of the user, whose peer's uid both sides check; the zygote exits after
``GYM_FORK_ZYGOTE_IDLE`` seconds (120) with no connection and no warm parent.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import stat
import struct
import subprocess
import sys

# Set in every warm parent's environment to the controller's pid, and so inherited by
# every sandbox and whatever it starts: leak checks find a tree's processes by it.
SANDBOX_MARKER = "GYM_FORK_SANDBOX"
ZYGOTE_PROGRAM = "gym_fork.hosts.process.zygote_program"

# A zygote is rebuilt when one of these differs: they are read while an interpreter
# starts or while the modules it pre-imports load. Every other variable a warm parent
# gets afresh with each fork (os.environ), so none of them is in the key: gym_fork sets
# some of its own at run time (GYM_FORK_SCRATCH_BASE), which must not cost a zygote.
_KEY_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "LC_", "LANG")
_KEY_SUFFIXES = ("_NUM_THREADS",)
_KEY_NAMES = ("GYM_FORK_SPIN",)  # read when the ring module is imported

# The directory holding gym_fork.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# Linux 6.5+: a pidfd of the socket's peer, taken by the kernel (no pid reuse race).
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
_PEERCRED = struct.Struct("3i")  # pid, uid, gid


def enabled() -> bool:
    """Whether warm parents are forked from a zygote (``GYM_FORK_ZYGOTE``, default on)."""
    return os.environ.get("GYM_FORK_ZYGOTE", "1") != "0"


def shared() -> bool:
    """Whether the zygote is kept across processes (``GYM_FORK_ZYGOTE=shared``)."""
    return os.environ.get("GYM_FORK_ZYGOTE") == "shared"


def zygote_key(env: dict[str, str]) -> tuple:
    """What a zygote's pre-imported state depends on."""
    chosen = sorted((k, v) for k, v in env.items() if _in_key(k))
    ids = (os.getuid(), os.geteuid(), os.getgid(), os.getegid(), tuple(os.getgroups()))
    return (sys.executable, ids, tuple(chosen))


def warm_parent_environment() -> dict[str, str]:
    """The environment of a warm parent: the controller's, with gym_fork importable
    and the leak-check marker set."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [_PACKAGE_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env[SANDBOX_MARKER] = str(os.getpid())
    return env


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


def peer_uid(sock: socket.socket) -> int:
    """The uid of the other end of a Unix socket (SO_PEERCRED: of the process that
    connected, or, seen by a client, that called listen)."""
    _, uid, _ = _PEERCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    )
    return uid


def connect_shared(env: dict[str, str]) -> socket.socket | None:
    """Our connection to this user's shared zygote for ``env`` (started if none
    listens); None where none can be used (the caller then starts its own). The
    zygote's ready message, as with any zygote, says its pid."""
    directory = _private_directory()
    if directory is None:
        return None
    path = os.path.join(directory, f"zygote-{shared_key(env)}.sock")
    found = _connect(path)
    if found is None:
        # Whoever binds the name starts the zygote; one that lost the race connects.
        _start_shared(path, env)
        found = _connect(path)
    return found


def shared_key(env: dict[str, str]) -> str:
    """The shared zygote's name: the per-process key (interpreter, ids, start-up
    variables), this process's import path, gym_fork's version and confinement."""
    from gym_fork._version import __version__

    key = repr((zygote_key(env), sys.path, __version__, confinement("self")))
    return hashlib.sha256(key.encode()).hexdigest()[:24]


_STATUS_FIELDS = ("NoNewPrivs:", "Seccomp:", "CapInh:", "CapPrm:", "CapEff:", "CapBnd:")


def confinement(pid: str) -> tuple:
    """What a warm parent would not get from its controller if it were a shared
    zygote's fork and they differed: namespaces, cgroup, no_new_privs, seccomp mode,
    capabilities (of /proc/PID). A shared zygote serves only controllers of its own."""
    spaces: list[str | None] = []
    for name in ("mnt", "pid", "net", "user", "ipc", "uts", "cgroup"):
        try:
            spaces.append(os.readlink(f"/proc/{pid}/ns/{name}"))
        except OSError:
            spaces.append(None)
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = [line.strip() for line in f if line.startswith(_STATUS_FIELDS)]
    except OSError:
        return (None,)  # matches no live process's
    return (tuple(spaces), cgroup, tuple(status))


def _private_directory() -> str | None:
    """This user's directory for shared zygotes, made 0700; None if it is anything
    else (another owner, open to others, a link)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    path = os.path.join(base, f"gym_fork-{os.geteuid()}")
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        found = os.lstat(path)
    except OSError:
        return None
    mine = found.st_uid == os.geteuid() and not found.st_mode & 0o077
    return path if stat.S_ISDIR(found.st_mode) and mine else None


def _connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        uid = peer_uid(sock)
    except ConnectionRefusedError:  # its zygote is gone: a new one takes the name
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    except OSError:
        sock.close()
        return None
    try:  # the zygote watches us by the pidfd this gives it: refused if it cannot
        os.close(sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
    except OSError:
        uid = -1
    if uid != os.geteuid():
        sock.close()
        return None
    return sock


def _start_shared(path: str, env: dict[str, str]) -> None:
    """Bind ``path`` here (so that clients may connect at once) and start the zygote on
    it, in its own session, with only the start-up variables of ``env``: it outlives
    this process and must keep nothing of it (nor its leak-check marker). Nothing if
    the name is taken (another process started one just now)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        umask = os.umask(0o177)
        try:
            listener.bind(path)
        finally:
            os.umask(umask)
        listener.listen(64)
        kept = {k: v for k, v in env.items() if _in_key(k)}
        kept["PATH"] = env.get("PATH", os.defpath)
        idle = os.environ.get("GYM_FORK_ZYGOTE_IDLE", "120")
        fd = str(listener.fileno())
        subprocess.Popen(
            [sys.executable, "-m", ZYGOTE_PROGRAM, "--shared", fd, path, idle],
            pass_fds=(listener.fileno(),),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=kept,
            cwd=os.path.dirname(path),
            start_new_session=True,
        )
    except OSError:
        pass
    finally:
        listener.close()


def _in_key(name: str) -> bool:
    return name.startswith(_KEY_PREFIXES) or name.endswith(_KEY_SUFFIXES) or name in _KEY_NAMES


_started_early = False
# (key, our socket, process: None if shared) of the zygote launched early, until the
# client adopts it.
_early: tuple[tuple, socket.socket, subprocess.Popen | None] | None = None


def launch_early() -> bool:
    """Launch the zygote when the controller first looks up ``gym_fork.ForkVectorEnv``
    (or ``make_vec``), for the client to adopt. Only in a controller that would use it:
    not in a process of a tree (a warm parent, a sandbox, what env code starts: they
    have the marker), not with zygotes off or another host by ``GYM_FORK_HOST``; once.
    Returns whether it launched one (errors are left to the first vector env)."""
    global _started_early, _early
    if _started_early or SANDBOX_MARKER in os.environ or not enabled():
        return False
    _started_early = True
    if os.environ.get("GYM_FORK_HOST", "process") not in ("", "process"):
        return False
    env = warm_parent_environment()
    found = connect_shared(env) if shared() else None
    if found is not None:
        _early = (zygote_key(env), found, None)
        return True
    try:
        sock, process = start_interpreter(ZYGOTE_PROGRAM, env)
    except OSError:
        return False
    _early = (zygote_key(env), sock, process)
    return True


def take_early() -> tuple[tuple, socket.socket, subprocess.Popen | None] | None:
    """The zygote launched early and not yet adopted, as (key, socket, process: None if
    shared); None if there is none."""
    global _early
    early, _early = _early, None
    return early


def _after_fork_in_child() -> None:
    # A fork between the launch and the adoption: the zygote is the parent's.
    global _early
    if _early is not None:
        _early[1].close()
        _early = None


os.register_at_fork(after_in_child=_after_fork_in_child)
