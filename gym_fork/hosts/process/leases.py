"""Idle sandboxes leased to the controller: a new sandbox without a round trip.

From its second spawn request on, a warm parent hands each idle sandbox it makes to the
controller over a lease channel (gym_fork/hosts/process/idle.py): a
:class:`~gym_fork.hosts.process.messages.Leased` with a pidfd of it and its assignment
socket. A spawn of one sandbox then sends the new sandbox's spec and fds straight to a
leased idle sandbox; the warm parent is not on that path at all (its reply, and the
pages it copies after each of its forks, cost ~1-3 ms there).

What comes on the channel is the warm parent's word, and it runs env code: each lease
must carry a pidfd of a live child of the warm parent that the controller does not hold
yet (``admit``), and a socket; a stopped or dead idle sandbox is killed and skipped (as
the warm parent itself skips one it would assign). A channel that sends anything else,
is closed (a message is read only once all of it is queued: a trickle stalls nothing),
and spawns then ask the warm parent as before. Received fds are close-on-exec from the
moment they arrive (control.py: a user's ``os.system`` child must not hold an idle
sandbox's socket).

Both ends of a lease live here: the warm parent's :class:`LeaseSender` (driven by
idle.py's ``IdlePool``, which forks, and parent.py's ``serve``, which watches the taken
pipes) and the controller's :class:`IdleLeases` (driven by host.py's spawn). One table:

State (where) -- how a lease gets there -> what ends the state:

- no channel (both) -- start; ``GYM_FORK_LEASES=0`` (the warm parent opens none; the
  controller closes one a warm parent older than the knob sends) -> the 2nd spawn
  request: a channel comes with the warm parent's ``Spawned``.
- forked (warm parent) -- ``fill()`` after a reply (after a taken lease: 20 ms later while
  another is left) -> ``LeaseSender.send``: sent with a pidfd and its socket; taken pipe kept.
- queued (channel) -- sent -> ``_drain``, under the host's lock, before each sandbox of a
  spawn (a spawn of several takes leases for as many as there are).
- ready (controller) -- admitted: a pidfd of a new member of the tree and a stream socket
  -> ``take``: a stopped or dead one is killed and skipped; the last spawn waits up to
  ``OWED_WAIT_S`` for one owed.
- taking (controller) -- taken for one spec (``owed`` + 1) -> ``assign`` sent: a
  registered sandbox; or discarded (dead, socket full); either way ``settle``.
- taken (warm parent) -- the idle sandbox wrote ``TAKEN`` and closed its pipe (EOF alone:
  it died) -> ``taken()``: replaced; ``MAX_LEASE_DEATHS`` deaths in a row stop leasing.
- closed (both) -- a bad lease, EOF, a send that timed out (``LEASE_SEND_TIMEOUT_S``),
  close -> never reopened: held leases stay usable, new idle sandboxes wait in the pool.

Measured (benchmarks/lease_ab.py, 2 cores, medians of 3, reset by clone + first step of
``from_parent`` CartPole): one sub-env reset 30 ms apart (an episode's end) 5.6 ms with
leases, 8.7 ms without; back to back (the lease not replaced yet) 8.0 = 7.9; eight
sub-envs at once (leases serve a spawn of one) 52.8 = 53.4. The win is the warm
parent's round trip on the reset of one sub-env, which is what an RL loop's episode ends
are; on 8 cores the same (it is latency of one path, not a shared core) is expected.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass

from gym_fork import knobs
from gym_fork.errors import ControlMessageError, SandboxStartError
from gym_fork.hosts.process import messages as M
from gym_fork.system.children import child_state, kill_child
from gym_fork.system.linux import ProcessWatch, wait_readable
from gym_fork.transport.control import frame_queued
from gym_fork.transport.typed_messages import adopt_pidfds

# The most leases held at once (the warm parent leases as many as its pool's size).
MAX_LEASES = 16
# A lease message stalled mid-way for longer than this closes the channel.
CHANNEL_TIMEOUT_S = 1.0
# How long a spawn of its last sandbox waits for a lease the warm parent owes before it
# asks the warm parent instead (back-to-back resets by clone, CartPole: p99 27-29 ->
# 19-20 ms, mean 11.4-12.6 -> 10.7-11.1; docs/benchmarks-notebook.md, session 10).
OWED_WAIT_S = 0.015
# A lease the controller does not take within this long closes the lease channel.
LEASE_SEND_TIMEOUT_S = 1.0
# Leased idle sandboxes that may die unassigned before the warm parent stops leasing
# (each is replaced: a sibling killing them would otherwise keep it forking).
MAX_LEASE_DEATHS = 16
# What an assigned leased idle sandbox writes on its taken pipe before closing it.
TAKEN = b"T"
# Process states of an idle sandbox that must not be assigned (as in idle.py).
_UNUSABLE = ("T", "t", "Z", "X", "x")


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


@dataclass
class Lease:
    """One idle sandbox the controller may assign: its pid in the tree's namespace, a
    watch of it (our pid), and its assignment socket."""

    local_pid: int
    watch: ProcessWatch
    sock: socket.socket

    def assign(self, assignment: M.Assign, fds: list[int]) -> bool:
        """Send it ``assignment`` and ``fds`` (ours to close); False, and it is discarded,
        if it cannot take them (dead). TimeoutError (discarded too) if the send waited:
        a small message into an empty buffer only waits if someone filled it."""
        try:
            self.sock.settimeout(2.0)
            M.send(self.sock, assignment, fds)
        except TimeoutError:
            self.discard()
            raise
        except OSError:
            self.discard()
            return False
        self.sock.close()
        return True

    def discard(self) -> None:
        """Kill it (it never ran a sub-env) and let go of it."""
        with contextlib.suppress(OSError):
            self.watch.kill()
        self.close()

    def close(self) -> None:
        """Let go of it: an idle sandbox whose socket closes exits."""
        self.sock.close()
        self.watch.close()


class IdleLeases:
    """The controller's leased idle sandboxes of one warm parent (callers hold the
    host's lock)."""

    def __init__(self) -> None:
        self.channel: socket.socket | None = None
        # A channel was closed: none is taken again (GYM_FORK_LEASES=0: none ever).
        self.given_up = knobs.read("GYM_FORK_LEASES") == "0"
        self.ready: list[Lease] = []
        self.taking: set[int] = set()  # pids of leases taken, not yet settled
        self.discarded: list[list] = []  # [pid, state] of stopped ones killed unused
        self.owed = 0  # leases taken that the warm parent has not replaced yet

    def open(self, fd: int) -> None:
        """The warm parent's lease channel arrived (our end, ``fd``): kept if it is a
        stream socket and none is open (a warm parent sends one), closed otherwise."""
        if self.channel is not None or self.given_up or not _is_socket(fd):
            os.close(fd)
            return
        try:
            channel = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            return
        if channel.type != socket.SOCK_STREAM:
            channel.close()
            return
        channel.settimeout(CHANNEL_TIMEOUT_S)
        self.channel = channel

    def pids(self) -> set[int]:
        """The pids (ours) of the leases held or being assigned: no spawn, fork or lease
        may name them again."""
        return {lease.watch.pid for lease in self.ready} | self.taking

    def settle(self, lease: Lease) -> None:
        """``lease`` (taken) became a registered sandbox, or was discarded."""
        self.taking.discard(lease.watch.pid)

    def take(
        self, admit: Callable[[list[ProcessWatch], str], list[ProcessWatch]], wait_s: float = 0.0
    ) -> Lease | None:
        """A usable leased idle sandbox, or None. ``admit`` checks that a watch names a
        new sandbox of the tree (the host's ``_new_members``). With none left but some
        owed (the warm parent replaces each one taken, at once when it was the last),
        waits up to ``wait_s`` for one: for a single sandbox, asking the warm parent
        instead makes it fork one more while it forks those it owes, on the same cores."""
        deadline = time.monotonic() + wait_s
        while True:
            self._drain(admit)
            while self.ready:
                lease = self.ready.pop(0)
                state = child_state(lease.watch.pid) if lease.watch.alive() else "X"
                if state not in _UNUSABLE:
                    self.taking.add(lease.watch.pid)
                    self.owed += 1
                    return lease
                if state in ("T", "t"):
                    self.discarded.append([lease.watch.pid, state])
                lease.discard()
            left = deadline - time.monotonic()
            if self.channel is None or self.owed <= 0 or left <= 0:
                return None
            # Readable but no whole lease queued (a frame begun, not finished): no wait
            # for it, which would spin until the deadline; the spawn asks the warm parent.
            if wait_readable(self.channel.fileno(), left) and not frame_queued(
                self.channel, M.Leased.MAX_BYTES
            ):
                return None

    def take_discarded(self) -> list[list]:
        """[pid, state] of the stopped leased sandboxes killed since the last call."""
        discarded, self.discarded = self.discarded, []
        return discarded

    def _drain(self, admit: Callable[[list[ProcessWatch], str], list[ProcessWatch]]) -> None:
        """Read the leases waiting on the channel (without blocking for new ones; at
        most MAX_LEASES per call, however many a warm parent keeps sending)."""
        for _ in range(MAX_LEASES):
            channel = self.channel
            if channel is None or not frame_queued(channel, M.Leased.MAX_BYTES):
                return
            try:
                lease, fds = M.receive(channel, M.Leased)
            except (ControlMessageError, EOFError, OSError):
                self.close_channel()  # the warm parent went, or sent what it must not
                return
            if lease.pidfds != [True]:  # an idle sandbox comes with a pidfd of it, alive
                M.close_fds(fds)
                self.close_channel()
                return
            pidfd, sock_fd = fds
            if not _is_socket(sock_fd):
                M.close_fds(fds)
                self.close_channel()
                return
            try:
                (watch,) = adopt_pidfds([lease.pid], lease.pidfds, [pidfd])  # or pidfd closed
            except SandboxStartError:
                os.close(sock_fd)
                self.close_channel()
                return
            sock = socket.socket(fileno=sock_fd)
            try:
                admit([watch], "a leased idle sandbox")
            except SandboxStartError:
                sock.close()  # admit() closed the watch
                self.close_channel()
                return
            if len(self.ready) >= MAX_LEASES:
                Lease(lease.pid, watch, sock).discard()
                continue
            self.ready.append(Lease(lease.pid, watch, sock))
            self.owed = max(0, self.owed - 1)

    def close_channel(self) -> None:
        """No more leases from this warm parent (those held stay usable)."""
        self.given_up = True
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def close(self) -> None:
        """Let go of the channel and every lease (their idle sandboxes exit)."""
        self.close_channel()
        for lease in self.ready:
            lease.close()
        self.ready.clear()


class LeaseSender:
    """The warm parent's end: it sends each idle sandbox it forks, while the channel is
    open, to the controller, and watches each leased one's taken pipe (TAKEN then EOF:
    assigned; EOF alone: it died) to know when to fork the next. The pool
    (idle.py ``IdlePool``) decides when a channel opens and when to fork."""

    def __init__(self) -> None:
        self.channel: socket.socket | None = None  # our end of the lease channel
        # Until the channel is given up (then never again); GYM_FORK_LEASES=0: never (the
        # controller closes a channel too, where this warm parent came before the knob).
        self.leasing = knobs.read("GYM_FORK_LEASES") != "0"
        self.leased: dict[int, int] = {}  # leased idle sandbox's pid -> its taken pipe
        self.deaths = 0  # leased idle sandboxes that died unassigned, in a row

    @property
    def open(self) -> bool:
        """Whether new idle sandboxes are leased (a channel is open)."""
        return self.channel is not None

    def open_channel(self) -> int | None:
        """The controller's end of a new lease channel (once), for the caller to send and
        close; None when leasing is off or given up, or a channel was opened before."""
        if not self.leasing or self.channel is not None:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.settimeout(LEASE_SEND_TIMEOUT_S)  # a controller that stops reading
        self.channel = ours
        return theirs.detach()

    def stop(self) -> None:
        """Close the lease channel for good: new idle sandboxes wait in the pool."""
        self.leasing = False
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def taken_fds(self) -> list[int]:
        """The taken pipes of the leased idle sandboxes (readable: taken or dead)."""
        return list(self.leased.values())

    def internal_fds(self) -> list[int]:
        """What a new idle sandbox must not keep: the taken pipes and the channel."""
        fds = list(self.leased.values())
        return fds + ([self.channel.fileno()] if self.channel is not None else [])

    def send(self, pid: int, sock: socket.socket, taken_r: int) -> None:
        """Lease idle sandbox ``pid`` (its assignment socket ``sock``, closed here, and the
        read end of its taken pipe) to the controller; if the channel is gone or the send
        timed out, the sandbox is killed and leasing stops."""
        assert self.channel is not None
        try:
            pidfd = os.pidfd_open(pid)
            try:
                M.send(self.channel, M.Leased(pid, [True]), [pidfd, sock.fileno()])
            finally:
                os.close(pidfd)
        except OSError:
            kill_child(pid)
            os.close(taken_r)
            self.stop()
        else:
            self.leased[pid] = taken_r
        finally:
            sock.close()

    def taken(self, fd: int) -> None:
        """The leased idle sandbox of taken pipe ``fd`` was assigned, or died unassigned."""
        for pid, pipe in list(self.leased.items()):
            if pipe == fd:
                del self.leased[pid]
                self._let_go_of(pipe)

    def forget(self, pid: int) -> None:
        """``pid`` was reaped: if it was leased, let go of its pipe."""
        pipe = self.leased.pop(pid, None)
        if pipe is not None:
            self._let_go_of(pipe)

    def _let_go_of(self, pipe: int) -> None:
        """Close a taken pipe, counting its sandbox dead unless it said TAKEN; after
        MAX_LEASE_DEATHS deaths in a row (a sibling killing them), no more leases."""
        try:
            assigned = os.read(pipe, 1) == TAKEN
        except OSError:  # nothing written yet (non-blocking): it died unassigned
            assigned = False
        os.close(pipe)
        self.deaths = 0 if assigned else self.deaths + 1
        if self.deaths >= MAX_LEASE_DEATHS:
            self.stop()

    def close(self) -> None:
        for pipe in self.leased.values():
            os.close(pipe)
        self.leased.clear()
        self.stop()
