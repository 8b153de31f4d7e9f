"""Idle sandboxes: forked, isolated and confined ahead of need, waiting for their fds.

A clone of the warm parent (a ``reset()`` by clone, a replacement) costs a fork of the
warm parent and the sandbox's isolation set-up (namespaces, mounts, capabilities,
seccomp) before its env can answer. The warm parent never changes after it prepared,
so a sandbox forked from it earlier is the same as one forked now: the pool keeps a few
forked and isolated already, each blocked on a socket of its own until a spawn request
hands it its spec and fds (slab, channel, side socket, stdout, stderr). The pool is
refilled after the reply to a request (off the request's path), and only once a second
spawn request shows that the tree makes sandboxes after its construction.

An idle sandbox holds nothing of the controller's: it closes the warm parent's socket,
its pidfd of the controller and the other idle sandboxes' sockets before isolating.
``GYM_FORK_IDLE_SANDBOXES`` sets the pool's size (default 2; 0 turns it off).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from gym_fork.errors import ControlMessageError
from gym_fork.hosts.process import messages as M
from gym_fork.system.children import child_state, fork, kill_child

DEFAULT_SIZE = 2


def pool_size() -> int:
    """How many idle sandboxes a warm parent keeps (``GYM_FORK_IDLE_SANDBOXES``)."""
    try:
        return max(0, min(16, int(os.environ.get("GYM_FORK_IDLE_SANDBOXES", DEFAULT_SIZE))))
    except ValueError:
        return DEFAULT_SIZE


@dataclass
class Idle:
    """One idle sandbox, seen from the warm parent."""

    pid: int
    sock: socket.socket


class IdlePool:
    """The warm parent's idle sandboxes.

    ``become(sock, close)`` runs in each new child: it must isolate the process, close
    the fds in ``close`` and never return (it waits for its assignment on ``sock``)."""

    def __init__(self, size: int, become: Callable[[socket.socket, list[int]], None]) -> None:
        self.size = size
        self.become = become
        self.waiting: list[Idle] = []
        self.requests = 0
        self.discarded: list[list] = []  # [pid, state] of stopped ones killed unused

    def note_request(self) -> None:
        """A spawn request was served: from the second on, the pool is kept full."""
        self.requests += 1

    def forget(self, pid: int) -> None:
        """``pid`` was reaped: if it was idle, it is out of the pool."""
        for idle in self.waiting:
            if idle.pid == pid:
                idle.sock.close()
                self.waiting.remove(idle)
                return

    def fill(self) -> list[int]:
        """Fork idle sandboxes until the pool is full; returns the new pids."""
        new = []
        while self.requests >= 2 and len(self.waiting) < self.size:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            pid = fork()
            if pid == 0:
                ours.close()
                self.become(theirs, [i.sock.fileno() for i in self.waiting])
                os._exit(70)  # never reached: become() does not return
            theirs.close()
            self.waiting.append(Idle(pid, ours))
            new.append(pid)
        return new

    def assign(self, assignment: M.Assign, fds: list[int]) -> int:
        """Hand ``assignment`` and ``fds`` to an idle sandbox; its pid, or 0 when none is
        left usable. The caller closes its copies of ``fds``.

        An idle sandbox that is stopped (another sandbox of the tree can SIGSTOP it: one
        pid namespace, one uid) or dead is never handed a spec: it is killed (it is our
        child, not reaped yet, so its pid is still its own) and listed in
        ``discarded``; the next one, or a fresh fork, is used instead."""
        while self.waiting:
            idle = self.waiting.pop(0)
            try:
                state = child_state(idle.pid)
                if state in _UNUSABLE:
                    if state in ("T", "t"):
                        self.discarded.append([idle.pid, state])
                    kill_child(idle.pid)
                    continue
                M.send(idle.sock, assignment, fds)
                return idle.pid
            except OSError:
                kill_child(idle.pid)
            finally:
                idle.sock.close()
        return 0

    def take_discarded(self) -> list[list]:
        """[pid, state] of the stopped idle sandboxes killed since the last call."""
        discarded, self.discarded = self.discarded, []
        return discarded

    def close(self) -> None:
        for idle in self.waiting:
            idle.sock.close()
        self.waiting.clear()


# States of an idle sandbox that must not be handed a spec: stopped (by a signal, or in
# a tracing stop, or with a stop signal pending), a zombie, dead. An unreadable state
# (reaped) is used: a send to it fails.
_UNUSABLE = ("T", "t", "Z", "X", "x")


def await_assignment(sock: socket.socket) -> tuple[M.Assign, list[int]]:
    """In an idle sandbox: block until the warm parent hands over a spec and fds; exit
    quietly if it closes the socket instead (the tree is going away), with 70 if what
    came is not an assignment."""
    try:
        message, fds = M.receive(sock, M.Assign)
    except ControlMessageError:
        os._exit(70)
    except (EOFError, ConnectionError, OSError):
        os._exit(0)
    sock.close()
    return message, fds
