"""Python face of the C ring (ext/gf_ring.c): records in, records out, typed errors.

Every wait, here and in the controller's waits for its sandboxes (gym_fork.vector.pool),
is :func:`wait`: slices of at most :data:`SLICE` seconds (ext/gf_ring.c, invariant 13),
between which Python runs signal handlers (Ctrl-C), checks the overall deadline and,
when given, whether the peer is still alive. The first slice is the only work done when
a record or space is there at once.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TypeVar

from gym_fork import knobs
from gym_fork._ring import ffi, lib
from gym_fork.errors import PeerGone, RingTimeout, TransportError

from .region import Region

CONTROL_BYTES = int(lib.gf_ring_control_size())
# Busy-wait rounds before a futex sleep (pause x32, then sched_yield); measured in
# docs/benchmarks-notebook.md. GYM_FORK_SPIN overrides it for tuning.
DEFAULT_SPIN = int(knobs.read("GYM_FORK_SPIN"))

_REASONS = {
    lib.GF_EMAGIC: "magic",
    lib.GF_ELENGTH: "length",
    lib.GF_ESEQ: "sequence",
    lib.GF_ECOUNTERS: "counters",
    lib.GF_ETOOBIG: "too_big",
    lib.GF_EINVAL: "invalid",
}


_TAGS = [ffi.new("char[1]", bytes([t])) for t in range(4)]

# A wait on several rings at once (no futex spans rings) polls their positions: rounds
# that find nothing yield the core for ANY_SPIN_S, then sleep ANY_FIRST_SLEEP, twice as
# long each round, up to ANY_LAST_SLEEP (a record waits at most ~0.25 ms to be noticed).
ANY_SPIN_S = 100e-6
ANY_FIRST_SLEEP = 20e-6
ANY_LAST_SLEEP = 200e-6


def ring_bytes(capacity: int) -> int:
    """Bytes one ring of ``capacity`` data bytes occupies in a region."""
    return CONTROL_BYTES + capacity


# Longest single wait in C: the bound on how late a signal handler, a deadline or a
# dead peer is noticed.
SLICE = 0.1
_SLICE_NS = int(SLICE * 1e9)
_WAITING = (lib.GF_ETIMEDOUT, lib.GF_EINTR)

T = TypeVar("T")


def _slice_ns(timeout: float) -> int:
    """The first slice of a wait of ``timeout`` seconds, in ns."""
    if timeout >= SLICE:
        return _SLICE_NS
    return int(timeout * 1e9) if timeout > 0 else 0


def rest_deadline(rc: int, timeout: float | None) -> float | None:
    """The deadline (``time.monotonic()``) of a wait of ``timeout`` s whose first slice
    ended with ``rc``: one that timed out used all of itself, one cut by a signal counts
    as nothing (a deadline at most one slice late, never early)."""
    if timeout is None:
        return None
    spent = min(timeout, SLICE) if rc == lib.GF_ETIMEDOUT else 0.0
    return time.monotonic() + max(0.0, timeout - spent)


def wait(
    attempt: Callable[[int], T | None],
    deadline: float | None,
    between: Callable[[], T | None] | None = None,
    *,
    checked: float = -SLICE,
) -> T | None:
    """The one wait loop, entered after a first attempt found nothing.

    ``attempt(ns)`` looks, waiting up to ``ns`` ns (a ring's spin then futex, polling
    sleep or doorbell; :class:`AnyRing`'s polls), in slices of at most :data:`SLICE` s,
    until it returns a value. ``between()``, the liveness check, runs before an attempt
    once a slice has passed since it last ran (since ``checked``, ``time.monotonic()``;
    by default at once: the first attempt waited a slice); it raises, or returns a value
    that ends the wait. None once ``deadline`` (``time.monotonic()``; None: never) has
    passed, after a last ``between()``. Between slices Python runs the signal handlers (Ctrl-C)."""
    check_at = checked + SLICE
    while True:
        if between is not None:
            now = time.monotonic()
            if now >= check_at:
                got = between()
                if got is not None:
                    return got
                check_at = now + SLICE
        if deadline is None:
            ns = _SLICE_NS
        else:
            left = deadline - time.monotonic()
            if left <= 0:
                # A peer that died within the last slice is reported as dead, not as
                # slow: the check runs once more before the wait gives up.
                return between() if between is not None else None
            ns = _SLICE_NS if left >= SLICE else int(left * 1e9)
        got = attempt(ns)
        if got is not None:
            return got


class Ring:
    """One direction of a channel: a single-producer, single-consumer record ring.

    ``create=True`` initialises the control block (done once, by the side that
    allocates the region); the peer attaches with ``create=False``. ``poll=True`` (both
    ends) waits by polling with growing sleeps instead of futexes, for a peer inside a
    VM. ``name`` is used in error messages, e.g. ``"worker 3 replies"``.
    """

    def __init__(
        self,
        region: Region,
        offset: int,
        capacity: int,
        *,
        create: bool,
        name: str,
        spin: int = DEFAULT_SPIN,
        poll: bool = False,
    ) -> None:
        if offset + ring_bytes(capacity) > region.size:
            raise ValueError(f"ring {name!r} does not fit in its region")
        self.name = name
        self.capacity = capacity
        # poll: the peer runs under another kernel (a VM), where no futex reaches it.
        self.spin = spin | (lib.GF_SPIN_POLL if poll else 0)
        self._base = ffi.from_buffer(region.map)
        self._ring = ffi.cast("gf_ring *", self._base + offset)
        if create:
            rc = lib.gf_ring_init(self._ring, capacity, spin)
        else:
            rc = lib.gf_ring_check(self._ring, capacity)
        if rc != lib.GF_OK:
            raise TransportError(
                f"ring {name!r}: control block is not initialised for capacity {capacity}",
                worker=name,
                reason=_REASONS.get(rc, str(rc)),
            )
        self.polling = poll
        # Doorbells (microVM channels): the fd this side blocks on when idle (reads), and
        # the fd to write a byte to when the peer sleeps on its own (writes). -1: none.
        self.bell_fd = -1
        self.peer_bell_fd = -1
        # This side's private view of the counters (invariant 12): never in shared memory.
        self._side = ffi.new("gf_side *")
        lib.gf_side_sync(self._ring, self._side)
        self._out = bytearray(4096)
        self._out_c = ffi.from_buffer(self._out)
        self._needed = ffi.new("uint64_t *")

    def set_spin(self, rounds: int) -> None:
        """Spin ``rounds`` before sleeping from now on (a polling ring keeps its own)."""
        if not self.polling:
            self.spin = rounds

    def sync(self) -> None:
        """Adopt the counters now in the control block (after they were set from a copy)."""
        lib.gf_side_sync(self._ring, self._side)

    def write(
        self,
        head: bytes,
        body=None,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Append one record (``head`` then the bytes-like ``body``); wait while full.

        ``timeout=None`` waits for space as long as ``alive()`` (checked between slices)
        stays true, or forever without it; Ctrl-C interrupts the wait either way.
        Raises :class:`RingTimeout`, :class:`PeerGone` or :class:`TransportError`.
        """
        if body is None:
            body_len, body_ptr = 0, ffi.NULL
        else:
            body_len = memoryview(body).nbytes
            body_ptr = ffi.from_buffer(body) if body_len else ffi.NULL
        rc = lib.gf_ring_write(
            self._ring,
            self.capacity,
            self.spin,
            self._side,
            head,
            len(head),
            body_ptr,
            body_len,
            _SLICE_NS if timeout is None else _slice_ns(timeout),
        )
        if rc != lib.GF_OK:
            self._write_rest(rc, head, len(head), body_ptr, body_len, timeout, alive)

    def _write_rest(self, rc, head, head_len, body, body_len, timeout, alive) -> None:
        """Everything after a first slice that did not simply write the record."""
        if rc in _WAITING:

            def attempt(ns: int) -> int | None:
                rc = lib.gf_ring_write(
                    self._ring, self.capacity, self.spin, self._side,
                    head, head_len, body, body_len, ns,
                )  # fmt: skip
                return None if rc in _WAITING else rc

            try:
                got = wait(attempt, rest_deadline(rc, timeout), self._gone(alive, writing=True))
            finally:
                self._side.interval = self._side.slept = 0
            if got is None:
                raise RingTimeout(f"ring {self.name!r} stayed full for {timeout} s")
            rc = got
        if rc == lib.GF_WAKE:
            self._ring_peer()
        elif rc != lib.GF_OK:
            self._raise_write(rc, head_len + body_len)

    def _gone(self, alive: Callable[[], bool] | None, *, writing: bool):
        """The check between slices of a wait: PeerGone once ``alive()`` is False (a
        reader first takes what the peer published before it died: its last word)."""
        if alive is None:
            return None

        def between() -> int | None:
            if alive():
                return None
            if not writing:
                n = self._take(0)
                if n not in _WAITING:
                    return n
            waited = "for space in a full ring" if writing else "for a record"
            raise PeerGone(f"ring {self.name!r}: its peer is gone (this side waited {waited})",
                           worker=self.name)  # fmt: skip

        return between

    def _raise_write(self, rc: int, size: int) -> None:
        if rc == lib.GF_ETOOBIG:
            raise TransportError(
                f"ring {self.name!r}: a record of {size} bytes can never fit "
                f"in a ring of {self.capacity} bytes",
                worker=self.name,
                reason="too_big",
            )
        raise self._corrupt(rc)

    def write_tagged(
        self,
        record,
        tag: int,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Append ``record`` followed by one tag byte (no per-call buffer export for bytes);
        waits as :meth:`write` does."""
        size = len(record) if type(record) is bytes else memoryview(record).nbytes
        if type(record) is not bytes:
            record = ffi.from_buffer(record)
        rc = lib.gf_ring_write(
            self._ring,
            self.capacity,
            self.spin,
            self._side,
            record,
            size,
            _TAGS[tag],
            1,
            _SLICE_NS if timeout is None else _slice_ns(timeout),
        )
        if rc != lib.GF_OK:
            self._write_rest(rc, record, size, _TAGS[tag], 1, timeout, alive)

    def read(
        self, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> memoryview:
        """Take the next record; the view is valid until the next ``read``.

        ``timeout=None`` waits as long as ``alive()`` (checked between slices) stays
        true, or forever without it; Ctrl-C interrupts the wait either way. A record
        the peer published before it died is still returned.
        Raises :class:`RingTimeout`, :class:`PeerGone` or :class:`TransportError`.
        """
        n = lib.gf_ring_read(
            self._ring,
            self.capacity,
            self.spin,
            self._side,
            self._out_c,
            len(self._out),
            _SLICE_NS if timeout is None else _slice_ns(timeout),
            self._needed,
            self.bell_fd,
        )
        if n >= 0:
            return memoryview(self._out)[:n]
        return self._read_rest(n, timeout, alive)

    def _take(self, ns: int) -> int:
        """One slice of reading, growing the buffer for a record that does not fit."""
        while True:
            n = lib.gf_ring_read(
                self._ring, self.capacity, self.spin, self._side, self._out_c,
                len(self._out), ns, self._needed, self.bell_fd,
            )  # fmt: skip
            if n != lib.GF_ETOOSMALL:
                return n
            # Bounded: a record's length never exceeds what was published (<= capacity).
            self._grow(int(self._needed[0]))
            ns = 0

    def _read_rest(self, n: int, timeout, alive) -> memoryview:
        """Everything after a first slice that did not simply return a record."""
        if n == lib.GF_ETOOSMALL:
            self._grow(int(self._needed[0]))
            n = self._take(0)
        if n in _WAITING:
            try:
                got = wait(
                    self._record, rest_deadline(n, timeout), self._gone(alive, writing=False)
                )
            finally:
                self._side.interval = self._side.slept = 0
            if got is None:
                raise RingTimeout(f"ring {self.name!r}: nothing arrived within {timeout} s")
            n = got
        if n < 0:
            raise self._corrupt(n)
        return memoryview(self._out)[:n]

    def _record(self, ns: int) -> int | None:
        """One slice of :meth:`read`'s wait: the record's length (or an error code), None
        if none came."""
        n = self._take(ns)
        return None if n in _WAITING else n

    def _ring_peer(self) -> None:
        """The reader sleeps on its doorbell: one byte wakes it (a full or closed bell
        already holds wake-ups, or its VM is gone: nothing to do)."""
        if self.peer_bell_fd >= 0:
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionError):
                os.write(self.peer_bell_fd, b"\0")

    def pending(self) -> int:
        """Bytes written and not yet read (headers and padding included)."""
        return int(lib.gf_ring_pending(self._ring))

    def reader_sleeps(self) -> bool:
        """True while the reader sleeps (futex, or its doorbell when polling)."""
        return bool(lib.gf_ring_consumer_sleeping(self._ring))

    def release(self) -> None:
        """Drop the buffer export on the region so that it can be unmapped."""
        if self._base is not None:
            ffi.release(self._base)
            self._base = None
            self._ring = None

    def _grow(self, needed: int) -> None:
        size = len(self._out)
        while size < needed:
            size *= 2
        ffi.release(self._out_c)
        self._out = bytearray(size)
        self._out_c = ffi.from_buffer(self._out)

    def _corrupt(self, rc: int) -> TransportError:
        reason = _REASONS.get(rc, str(rc))
        if rc == lib.GF_ECOUNTERS:
            return TransportError(
                f"ring {self.name!r}: its shared positions are inconsistent (one moved "
                "backwards, or they are further apart than the ring is long); the peer "
                "wrote over the ring's control block",
                worker=self.name,
                reason=reason,
            )
        return TransportError(
            f"ring {self.name!r}: corrupt record ({reason}); the peer wrote bytes that are "
            "not a valid gym_fork record",
            worker=self.name,
            reason=reason,
        )


class AnyRing:
    """The primitive of a wait on several rings for the first record in any of them:
    shared-counter reads, no system call, then yields and growing sleeps (restarted
    by each record found)."""

    __slots__ = ("idle_since", "pause", "rings")

    def __init__(self, rings: dict[int, Ring]) -> None:
        self.rings = {key: ring._ring for key, ring in rings.items()}
        self.idle_since: float | None = None
        self.pause = ANY_FIRST_SLEEP

    def ready(self) -> list[int]:
        """Keys of the rings that hold a record now."""
        pending = lib.gf_ring_pending
        return [key for key, ring in self.rings.items() if pending(ring)]

    def drop(self, key: int) -> None:
        """Stop watching one ring."""
        del self.rings[key]

    def within(self, ns: int) -> list[int] | None:
        """:meth:`ready`, waiting up to ``ns`` ns for one ring at least; None if none."""
        end = time.monotonic() + ns / 1e9
        while True:
            ready = self.ready()
            if ready:
                self.idle_since, self.pause = None, ANY_FIRST_SLEEP
                return ready
            now = time.monotonic()
            if now >= end:
                return None
            if self.idle_since is None:
                self.idle_since = now
            if now - self.idle_since < ANY_SPIN_S:
                os.sched_yield()
            else:
                time.sleep(min(self.pause, end - now))
                self.pause = min(self.pause * 2, ANY_LAST_SLEEP)
