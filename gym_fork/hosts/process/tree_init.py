"""The tree's pid 1: with a pid namespace of the tree's own, the process the controller
started forks the warm parent as pid 1 of it (entering the tree's own user namespace on
the way, when the tree has an unprivileged uid) and only waits for it, then removes the
tree's cgroups and scratch (gym_fork/hosts/process/parent.py runs the rest of its life).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import time

from gym_fork.system import cgroups, children, confine, identity, linux
from gym_fork.system import namespaces as ns
from gym_fork.system.isolation import Isolation, IsolationConfig, become_tree_init, read_only_tree
from gym_fork.system.scratch import sweep


def start_tree_init(
    sock: socket.socket, controller: int, config: IsolationConfig, tree: Isolation
) -> None:
    """Fork pid 1 of the tree's new pid namespace and return in it; this process only
    waits for it (killing it if the controller dies first), removes the tree's cgroups
    and scratch, and exits with its status."""
    me = os.pidfd_open(os.getpid())
    uid = tree.tree.get("uid", 0)
    asked, answered = os.pipe(), os.pipe()  # the user namespace's handshake
    if uid:
        cgroups.delegate(tree.tree_id, uid)
    pid = children.fork()
    if pid == 0:
        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([me], [], [], 0)[0]:
            os._exit(70)  # the waiter died before PDEATHSIG was set
        os.close(me)
        become_tree_init(tree)
        tree.tree["birth"].append("tree_init")
        read_only_tree(config, tree)
        tree.tree["birth"].append("read_only_view")
        if uid:
            _enter_tree_user_namespace(tree, asked[1], answered[0])
            tree.tree["birth"].append("user_namespace")
        for fd in (*asked, *answered):
            os.close(fd)
        return
    os.close(me)
    sock.close()
    if uid:
        _map_tree_user_namespace(pid, uid, asked[0], answered[1])
    for fd in (*asked, *answered):
        os.close(fd)
    init = os.pidfd_open(pid)
    try:
        # The init watches the controller too, but not while it prepares (env_fns).
        select.select([init, controller], [], [])
    except BaseException:
        pass  # SIGTERM: fall through and take the tree down
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # nothing may cut the cleanup short
        if not linux.wait_readable(init, 0.5):  # time for the init to clean up itself
            signal.pidfd_send_signal(init, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # every process of the tree is gone by now
        code = os.waitstatus_to_exitcode(status)
        deadline = time.monotonic() + 1.0
        while cgroups.tree_exists(tree.tree_id) and time.monotonic() < deadline:
            cgroups.remove_tree(tree.tree_id)
            time.sleep(0.01)
        sweep(tree.tree_id)
        os._exit(code if code >= 0 else 128 - code)


def _enter_tree_user_namespace(tree: Isolation, asked: int, answered: int) -> None:
    """In pid 1 of the tree, before any env code: a user namespace of the tree's own,
    whose root is the tree's unprivileged uid on the host (the waiter maps it). The
    warm parent keeps every capability there, for its sandboxes' namespaces and mounts,
    and none on the host: what env code runs in it (from_parent's env_fn and warmup,
    the env_fns' imports) is that uid's, on a host it cannot write. Where the kernel
    refuses, the tree stays root and its sandboxes change uid themselves
    (gym_fork/system/sandbox_isolation.py)."""
    uid = tree.tree["uid"]
    parent = os.getppid()
    groups = os.getgroups()
    try:
        # Made by the tree's uid, not by root: the kernel charges a user namespace's
        # per-user counts (inotify instances, ...) to its creator, all the way up. Its
        # capabilities are kept until the namespace is made, to come back if it is not.
        identity.become(uid)
        ns.unshare(ns.CLONE_NEWUSER)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.setresuid(0, 0, 0)
            os.setresgid(0, 0, 0)
            os.setgroups(groups)
        if os.geteuid() != 0:
            os._exit(70)  # neither root nor in its namespace: the start fails
        tree.missing["warm_parent_user_namespace"] = (
            f"the warm parent runs env code (from_parent's env_fn, imports) as the host's "
            f"root: no user namespace ({exc.strerror or exc})"
        )
        linux.die_with_parent(parent)
        os.write(asked, b"f")
        return
    os.write(asked, b"u")
    if not linux.wait_readable(answered, 10.0) or os.read(answered, 1) != b"m":
        os._exit(70)  # unmapped: neither root nor the tree's uid; the start fails
    # Its uid is the tree's on the host, unmapped in here until it takes the namespace's
    # root (the same uid on the host).
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    confine.replan_capabilities()
    tree.tree["userns"] = True


def _map_tree_user_namespace(pid: int, uid: int, asked: int, answered: int) -> None:
    """The waiter's side of :func:`_enter_tree_user_namespace`."""
    if not linux.wait_readable(asked, 10.0) or os.read(asked, 1) != b"u":
        return  # it stays root (and says so), or it died
    # The init mounted the tree's own /proc over the one we share with it: there it is
    # pid 1 and this process, outside its pid namespace, has no /proc/self.
    target = pid if os.path.exists("/proc/self") else 1
    try:
        identity.map_user_namespace(target, uid)
    except OSError:
        return  # it exits: the start fails, with nothing half-mapped
    os.write(answered, b"m")
