"""Python face of the C ring (ext/gf_ring.c): records in, records out, typed errors."""

from __future__ import annotations

import contextlib
import os

from gym_fork._ring import ffi, lib
from gym_fork.errors import RingTimeout, TransportError

from .region import Region

CONTROL_BYTES = int(lib.gf_ring_control_size())
RECORD_HEADER = int(lib.GF_RECORD_HEADER)
# Busy-wait rounds before a futex sleep (pause x32, then sched_yield); measured in
# docs/benchmarks.md. GYM_FORK_SPIN overrides it for tuning.
DEFAULT_SPIN = int(os.environ.get("GYM_FORK_SPIN", "400"))

_REASONS = {
    lib.GF_EMAGIC: "magic",
    lib.GF_ELENGTH: "length",
    lib.GF_ESEQ: "sequence",
    lib.GF_ECOUNTERS: "counters",
    lib.GF_ETOOBIG: "too_big",
    lib.GF_EINVAL: "invalid",
}


_TAGS = [ffi.new("char[1]", bytes([t])) for t in range(4)]


def ring_bytes(capacity: int) -> int:
    """Bytes one ring of ``capacity`` data bytes occupies in a region."""
    return CONTROL_BYTES + capacity


def _timeout_ns(timeout: float | None) -> int:
    return -1 if timeout is None else max(0, int(timeout * 1e9))


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
        # Doorbells (microVM channels): the fd this side blocks on when idle (reads), and
        # the fd to write a byte to when the peer sleeps on its own (writes). -1: none.
        self.bell_fd = -1
        self.peer_bell_fd = -1
        self._out = bytearray(4096)
        self._out_c = ffi.from_buffer(self._out)
        self._needed = ffi.new("uint64_t *")

    def write(self, head: bytes, body=None, timeout: float | None = None) -> None:
        """Append one record (``head`` then the bytes-like ``body``); wait while full."""
        if body is None:
            body_len, body_ptr = 0, ffi.NULL
        else:
            body_len = memoryview(body).nbytes
            body_ptr = ffi.from_buffer(body) if body_len else ffi.NULL
        rc = lib.gf_ring_write(
            self._ring,
            self.capacity,
            self.spin,
            head,
            len(head),
            body_ptr,
            body_len,
            -1 if timeout is None else _timeout_ns(timeout),
        )
        if rc != lib.GF_OK:
            if rc == lib.GF_WAKE:
                self._ring_peer()
                return
            self._raise_write(rc, len(head) + body_len, timeout)

    def _raise_write(self, rc: int, size: int, timeout: float | None) -> None:
        if rc == lib.GF_ETIMEDOUT:
            raise RingTimeout(f"ring {self.name!r} stayed full for {timeout} s")
        if rc == lib.GF_ETOOBIG:
            raise TransportError(
                f"ring {self.name!r}: a record of {size} bytes can never fit "
                f"in a ring of {self.capacity} bytes",
                worker=self.name,
                reason="too_big",
            )
        raise self._corrupt(rc)

    def write_tagged(self, record, tag: int, timeout: float | None = None) -> None:
        """Append ``record`` followed by one tag byte (no per-call buffer export for bytes)."""
        size = len(record) if type(record) is bytes else memoryview(record).nbytes
        if type(record) is not bytes:
            record = ffi.from_buffer(record)
        rc = lib.gf_ring_write(
            self._ring,
            self.capacity,
            self.spin,
            record,
            size,
            _TAGS[tag],
            1,
            -1 if timeout is None else _timeout_ns(timeout),
        )
        if rc != lib.GF_OK:
            if rc == lib.GF_WAKE:
                self._ring_peer()
                return
            self._raise_write(rc, size + 1, timeout)

    def read(self, timeout: float | None = None) -> memoryview:
        """Take the next record; the view is valid until the next ``read``."""
        while True:
            n = lib.gf_ring_read(
                self._ring,
                self.capacity,
                self.spin,
                self._out_c,
                len(self._out),
                _timeout_ns(timeout),
                self._needed,
                self.bell_fd,
            )
            if n >= 0:
                return memoryview(self._out)[:n]
            if n == lib.GF_ETOOSMALL:
                self._grow(int(self._needed[0]))
                continue
            if n == lib.GF_ETIMEDOUT:
                raise RingTimeout(f"ring {self.name!r}: nothing arrived within {timeout} s")
            raise self._corrupt(n)

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
        return TransportError(
            f"ring {self.name!r}: corrupt record ({reason}); the peer wrote bytes that are "
            "not a valid gym_fork record",
            worker=self.name,
            reason=reason,
        )
