"""Idle sandboxes: forked, isolated and confined ahead of need, waiting for their fds.

A clone of the warm parent (a ``reset()`` by clone, a replacement) costs a fork of the
warm parent and the sandbox's isolation set-up (namespaces, mounts, capabilities,
seccomp) before its env can answer. The warm parent never changes after it prepared,
so a sandbox forked from it earlier is the same as one forked now: the pool keeps a few
forked and isolated already, each blocked on a socket of its own until a spawn request
hands it its spec and fds (slab, channel, side socket, stdout, stderr). The pool is
refilled after the reply to a request (off the request's path), and only once a second
spawn request shows that the tree makes sandboxes after its construction.

Leases: from the second request on, the warm parent hands each idle sandbox it makes
to the controller (a :class:`~gym_fork.hosts.process.messages.Leased` on a lease
channel, with a pidfd of it and its assignment socket), which then sends a new
sandbox's spec and fds to it directly: no round trip to the warm parent before a clone
starts, and the warm parent's work after its fork (it copies the pages it writes, ~2 ms)
off that path. An idle sandbox closes its end of a "taken" pipe once assigned; its EOF
(or the sandbox's death) tells the warm parent to make the next one. A lease's states at
both ends, and what leases are measured to buy: leases.py's docstring.

An idle sandbox holds nothing of the controller's: it closes the warm parent's socket,
its pidfd of the controller, the lease channel and the other idle sandboxes' sockets and
pipes before isolating. ``GYM_FORK_IDLE_SANDBOXES`` sets the pool's size (default 2; 0
turns it off).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from gym_fork import knobs
from gym_fork.errors import ControlMessageError
from gym_fork.hosts.process import messages as M
from gym_fork.hosts.process.leases import TAKEN, LeaseSender
from gym_fork.system.children import child_state, fork, kill_child

DEFAULT_SIZE = int(knobs.BY_NAME["GYM_FORK_IDLE_SANDBOXES"].default)


def pool_size() -> int:
    """How many idle sandboxes a warm parent keeps (``GYM_FORK_IDLE_SANDBOXES``)."""
    try:
        return max(0, min(16, int(knobs.read("GYM_FORK_IDLE_SANDBOXES"))))
    except ValueError:
        return DEFAULT_SIZE


@dataclass
class Idle:
    """One idle sandbox, seen from the warm parent."""

    pid: int
    sock: socket.socket


Become = Callable[[socket.socket, list[int], int], None]


class IdlePool:
    """The warm parent's idle sandboxes.

    ``become(sock, close, taken)`` runs in each new child: it must isolate the process,
    close the fds in ``close`` and never return (it waits for its assignment on ``sock``,
    then closes ``taken`` unless it is -1: :func:`await_assignment`)."""

    def __init__(self, size: int, become: Become) -> None:
        self.size = size
        self.become = become
        self.waiting: list[Idle] = []
        self.requests = 0
        self.discarded: list[list] = []  # [pid, state] of stopped ones killed unused
        self.leases = LeaseSender()  # the lease channel's warm-parent end

    def open_lease_channel(self) -> int | None:
        """From the second request on (once): the controller's end of a new lease
        channel, for the caller to send and close; None when there is none to open."""
        if self.size == 0 or self.requests < 2:
            return None
        return self.leases.open_channel()

    def _internal_fds(self) -> list[int]:
        """What a new idle sandbox must not keep of the warm parent's own."""
        return [i.sock.fileno() for i in self.waiting] + self.leases.internal_fds()

    def note_request(self) -> None:
        """A spawn request was served: from the second on, the pool is kept full."""
        self.requests += 1

    def forget(self, pid: int) -> None:
        """``pid`` was reaped: if it was idle, it is out of the pool."""
        self.leases.forget(pid)
        for idle in self.waiting:
            if idle.pid == pid:
                idle.sock.close()
                self.waiting.remove(idle)
                return

    def fill(self) -> list[int]:
        """Fork idle sandboxes until the pool (waiting and leased) is full, each leased
        to the controller where a lease channel is open; returns the new pids."""
        new = []
        while self.requests >= 2 and len(self.waiting) + len(self.leases.leased) < self.size:
            try:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError:  # EMFILE: no refill now; a spawn forks its own sandbox
                break
            taken_r, taken_w = -1, -1
            try:
                if self.leases.open:
                    taken_r, taken_w = os.pipe()
                pid = fork()
            except OSError:  # EAGAIN (a pids limit), ENOMEM: as above
                ours.close()
                theirs.close()
                for fd in (taken_r, taken_w):
                    if fd >= 0:
                        os.close(fd)
                break
            if pid == 0:
                ours.close()
                if taken_r >= 0:
                    os.close(taken_r)
                self.become(theirs, self._internal_fds(), taken_w)
                os._exit(70)  # never reached: become() does not return
            theirs.close()
            new.append(pid)
            if taken_r < 0:
                self.waiting.append(Idle(pid, ours))
                continue
            os.close(taken_w)
            os.set_blocking(taken_r, False)
            self.leases.send(pid, ours, taken_r)
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
        self.leases.close()


# States of an idle sandbox that must not be handed a spec: stopped (by a signal, or in
# a tracing stop, or with a stop signal pending), a zombie, dead. An unreadable state
# (reaped) is used: a send to it fails.
_UNUSABLE = ("T", "t", "Z", "X", "x")


def await_assignment(sock: socket.socket, taken: int = -1) -> tuple[M.Assign, list[int]]:
    """In an idle sandbox: block until the warm parent (or, leased, the controller)
    hands over a spec and fds, then close ``taken`` (unless -1); exit quietly if the
    other end closes the socket instead (the tree is going away), with 70 if what came
    is not an assignment."""
    try:
        message, fds = M.receive(sock, M.Assign)
    except ControlMessageError:
        os._exit(70)
    except (EOFError, ConnectionError, OSError):
        os._exit(0)
    sock.close()
    if taken >= 0:
        os.write(taken, TAKEN)  # EOF alone would also mean it died
        os.close(taken)
    return message, fds
