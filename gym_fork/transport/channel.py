"""A worker's channel: one shared region holding its request and reply rings."""

from __future__ import annotations

from typing import Any

from .codec import pack, unpack
from .region import Region
from .ring import Ring, ring_bytes

DEFAULT_RING_BYTES = 1 << 20


class Channel:
    """Requests flow controller -> worker, replies worker -> controller.

    The controller creates the region (``Channel.create``) and passes ``region.fd`` to
    the worker, which attaches with ``Channel.attach``. Each side only writes its own
    ring, so both rings stay single-producer / single-consumer.
    """

    def __init__(self, region: Region, capacity: int, *, controller: bool, create: bool, name: str):
        self.region = region
        self.capacity = capacity
        requests = Ring(region, 0, capacity, create=create, name=f"{name} requests")
        replies = Ring(
            region, ring_bytes(capacity), capacity, create=create, name=f"{name} replies"
        )
        self.outbox, self.inbox = (requests, replies) if controller else (replies, requests)

    @classmethod
    def create(cls, name: str, capacity: int = DEFAULT_RING_BYTES) -> Channel:
        region = Region(2 * ring_bytes(capacity), name=f"gym_fork-{name}")
        return cls(region, capacity, controller=True, create=True, name=name)

    @classmethod
    def attach(cls, fd: int, capacity: int, name: str) -> Channel:
        region = Region.attach(fd, 2 * ring_bytes(capacity))
        return cls(region, capacity, controller=False, create=False, name=name)

    def send(self, message: Any, timeout: float | None = None) -> None:
        """Encode ``message`` and append it to this side's outgoing ring."""
        self.outbox.write(pack(message), timeout=timeout)

    def send_raw(self, record: bytes, timeout: float | None = None) -> None:
        """Append an already-encoded record (hot path: one encode, many workers)."""
        self.outbox.write(record, timeout=timeout)

    def recv(self, timeout: float | None = None) -> Any:
        """Take and decode the next incoming record."""
        return unpack(self.inbox.read(timeout))

    def close(self) -> None:
        self.outbox.release()
        self.inbox.release()
        self.region.close()
