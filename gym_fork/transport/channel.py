"""A worker's channel: one shared region holding its request and reply rings."""

from __future__ import annotations

from typing import Any

from gym_fork.errors import RingTimeout, TransportError

from .codec import pack, unpack
from .region import Region
from .ring import CONTROL_BYTES, Ring, ring_bytes

DEFAULT_RING_BYTES = 1 << 20

# Each record ends with one tag byte: a message fits in one record (WHOLE) or is split
# into fragments (MORE ... LAST) so that no message is ever too big for a ring.
WHOLE, MORE, LAST = 0, 1, 2
# How long a reader waits for the next fragment of a message already begun.
FRAGMENT_TIMEOUT = 30.0


def region_bytes(capacity: int) -> int:
    """The power of two that holds both rings of ``capacity`` (a PCI BAR's size)."""
    need = 2 * ring_bytes(capacity)
    return 1 << (need - 1).bit_length()


class Channel:
    """Requests flow controller -> worker, replies worker -> controller.

    The controller creates the region (``Channel.create``) and passes ``region.fd`` to
    the worker, which attaches with ``Channel.attach``. Each side only writes its own
    ring, so both rings stay single-producer / single-consumer.
    """

    def __init__(
        self,
        region: Region,
        capacity: int,
        *,
        controller: bool,
        create: bool,
        name: str,
        poll: bool = False,
    ):
        self.region = region
        self.capacity = capacity
        self.poll = poll
        requests = Ring(region, 0, capacity, create=create, name=f"{name} requests", poll=poll)
        replies = Ring(
            region,
            ring_bytes(capacity),
            capacity,
            create=create,
            name=f"{name} replies",
            poll=poll,
        )
        self.outbox, self.inbox = (requests, replies) if controller else (replies, requests)
        self.max_fragment = capacity // 4

    @classmethod
    def create(
        cls, name: str, capacity: int = DEFAULT_RING_BYTES, *, poll: bool = False
    ) -> Channel:
        """A new region with both rings; ``poll`` for a worker inside a VM (its region
        is then sized to a power of two, as a PCI BAR must be)."""
        size = region_bytes(capacity) if poll else 2 * ring_bytes(capacity)
        region = Region(size, name=f"gym_fork-{name}")
        return cls(region, capacity, controller=True, create=True, name=name, poll=poll)

    @classmethod
    def attach(
        cls, fd: int, capacity: int, name: str, *, poll: bool = False, offset: int = 0
    ) -> Channel:
        region = Region.attach(fd, 2 * ring_bytes(capacity), offset)
        return cls(region, capacity, controller=False, create=False, name=name, poll=poll)

    def positions(self) -> bytes:
        """Both rings' control blocks (positions and sequence numbers), for a copy."""
        second = ring_bytes(self.capacity)
        view = self.region.map
        return bytes(view[:CONTROL_BYTES]) + bytes(view[second : second + CONTROL_BYTES])

    def set_positions(self, blocks: bytes) -> None:
        """Continue where the channel that gave ``blocks`` stood (both rings drained).

        A microVM clone resumes inside a ring read whose position the guest's CPU still
        holds; its new channel must start from the same counters."""
        if len(blocks) != 2 * CONTROL_BYTES:
            raise ValueError(f"expected {2 * CONTROL_BYTES} bytes of control blocks")
        second = ring_bytes(self.capacity)
        view = self.region.map
        view[:CONTROL_BYTES] = blocks[:CONTROL_BYTES]
        view[second : second + CONTROL_BYTES] = blocks[CONTROL_BYTES:]

    def send(self, message: Any, timeout: float | None = None) -> None:
        """Encode ``message`` and append it to this side's outgoing ring."""
        self.send_raw(pack(message), timeout)

    def send_raw(self, record: bytes, timeout: float | None = None) -> None:
        """Append an already-encoded message (hot path: one encode, many workers)."""
        if len(record) <= self.max_fragment:
            self.outbox.write_tagged(record, WHOLE, timeout)
            return
        view = memoryview(record)
        step = self.max_fragment
        for start in range(0, len(view), step):
            tag = LAST if start + step >= len(view) else MORE
            self.outbox.write_tagged(view[start : start + step], tag, timeout)

    def recv(self, timeout: float | None = None) -> Any:
        """Take and decode the next incoming message."""
        view = self.inbox.read(timeout)
        if len(view) and view[-1] == WHOLE:
            return self._decode(view[:-1])
        parts = []
        while True:
            if not len(view) or view[-1] not in (MORE, LAST):
                raise TransportError(
                    f"{self.inbox.name!r}: record tag {bytes(view[-1:])!r} is not a gym_fork tag",
                    worker=self.inbox.name,
                    reason="tag",
                )
            parts.append(bytes(view[:-1]))
            if view[-1] == LAST:
                return self._decode(b"".join(parts))
            try:
                view = self.inbox.read(FRAGMENT_TIMEOUT)
            except RingTimeout:
                raise TransportError(
                    f"{self.inbox.name!r}: a multi-part message stopped after {len(parts)} parts",
                    worker=self.inbox.name,
                    reason="torn",
                ) from None

    def _decode(self, data) -> Any:
        try:
            return unpack(data)
        except Exception as exc:
            raise TransportError(
                f"{self.inbox.name!r}: a record does not decode ({type(exc).__name__}: {exc})",
                worker=self.inbox.name,
                reason="decode",
            ) from exc

    def close(self) -> None:
        self.outbox.release()
        self.inbox.release()
        self.region.close()
