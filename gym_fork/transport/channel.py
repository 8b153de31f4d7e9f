"""A worker's channel: one shared region holding its request and reply rings."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from gym_fork.errors import PeerGone, RingTimeout, TransportError

from . import codec
from .codec import DecodeTooBig, check_bounds, pack, unpack
from .region import Region
from .ring import CONTROL_BYTES, Ring, ring_bytes

DEFAULT_RING_BYTES = 1 << 20

# Each record ends with one tag byte: a message fits in one record (WHOLE) or is split
# into fragments (MORE ... LAST) so that no message is ever too big for a ring.
WHOLE, MORE, LAST = 0, 1, 2
# How long a reader waits for the next fragment of a message already begun (the bound
# when it has no ``alive`` check to notice a dead sender at once).
FRAGMENT_TIMEOUT = 30.0
# Largest message a reader reassembles from fragments: a sender that keeps sending
# fragments must not grow the reader without bound.
DEFAULT_MAX_MESSAGE = 256 << 20


def region_bytes(capacity: int) -> int:
    """The power of two that holds both rings of ``capacity`` (a VM's channel device)."""
    need = 2 * ring_bytes(capacity)
    return 1 << (need - 1).bit_length()


class Channel:
    """Requests flow controller -> worker, replies worker -> controller.

    The controller creates the region (``Channel.create``) and passes ``region.fd`` to
    the worker, which attaches with ``Channel.attach``. Each side only writes its own
    ring, so both rings stay single-producer / single-consumer. ``max_message`` bounds
    the size of a message reassembled from fragments.

    A send or receive cut off in the middle of a multi-part message (deadline, dead
    peer, Ctrl-C, a bound) leaves that direction torn: its next use raises
    ``TransportError(reason="torn")`` rather than splice two messages together.
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
        max_message: int = DEFAULT_MAX_MESSAGE,
    ):
        self.region = region
        self.capacity = capacity
        self.poll = poll
        self.max_message = max_message
        # False (an untrusted peer): pickles in a record are not loaded; ``refused``
        # lists the sizes of those in the last record, for the reader to refuse it. The
        # controller's end starts untrusted (its owner lifts it for trusted=True envs).
        self.allow_pickle = not controller
        self.refused: list[int] = []
        # The values a record from a sandbox may decode to (see gym_fork.transport.codec);
        # a worker reads the controller's records unbounded.
        self.max_objects = codec.MAX_OBJECTS if controller else None
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
        # Why a direction is unusable after a message was cut in the middle (None: fine).
        self._torn_out: str | None = None
        self._torn_in: str | None = None

    @classmethod
    def create(
        cls,
        name: str,
        capacity: int = DEFAULT_RING_BYTES,
        *,
        poll: bool = False,
        max_message: int = DEFAULT_MAX_MESSAGE,
    ) -> Channel:
        """A new region with both rings; ``poll`` for a worker inside a VM (its region
        is then sized to a power of two, as the VM's channel device is)."""
        size = region_bytes(capacity) if poll else 2 * ring_bytes(capacity)
        region = Region(size, name=f"gym_fork-{name}")
        try:
            return cls(
                region, capacity, controller=True, create=True, name=name, poll=poll,
                max_message=max_message,
            )  # fmt: skip
        except BaseException:
            region.close()
            raise

    @classmethod
    def attach(
        cls,
        fd: int,
        capacity: int,
        name: str,
        *,
        poll: bool = False,
        offset: int = 0,
        max_message: int = DEFAULT_MAX_MESSAGE,
    ) -> Channel:
        """The worker's end of a channel created elsewhere, from its region's ``fd``
        (which the channel then owns). A memfd must be sealed and large enough."""
        region = Region.attach(fd, 2 * ring_bytes(capacity), offset, name=name)
        try:
            return cls(
                region, capacity, controller=False, create=False, name=name, poll=poll,
                max_message=max_message,
            )  # fmt: skip
        except BaseException:
            region.close()
            raise

    @property
    def max_objects(self) -> int | None:
        """The most values one incoming record may decode to (None: no bound); a record
        holding more raises :class:`DecodeTooBig` before any of it is built."""
        return self._max_objects

    @max_objects.setter
    def max_objects(self, value: int | None) -> None:
        self._max_objects = value
        # A record of at most this many bytes cannot hold more values: not walked.
        self._unchecked = sys.maxsize if value is None else value

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
        self.outbox.sync()
        self.inbox.sync()

    def send(
        self,
        message: Any,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Encode ``message`` and append it to this side's outgoing ring."""
        self.send_raw(pack(message), timeout, alive)

    def send_raw(
        self,
        record: bytes,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """Append an already-encoded message (hot path: one encode, many workers).

        ``timeout`` bounds the whole message (None: no deadline); ``alive`` is checked
        between wait slices and raises :class:`PeerGone` once it returns False.
        """
        if len(record) <= self.max_fragment and self._torn_out is None:
            self.outbox.write_tagged(record, WHOLE, timeout, alive)
            return
        self._send_fragments(record, timeout, alive)

    def _send_fragments(self, record, timeout, alive) -> None:
        if self._torn_out is not None:
            raise TransportError(
                f"{self.outbox.name!r}: an earlier message was cut off ({self._torn_out}); "
                "this channel cannot carry more messages",
                worker=self.outbox.name,
                reason="torn",
            )
        view = memoryview(record)
        if len(view) <= self.max_fragment:
            self.outbox.write_tagged(record, WHOLE, timeout, alive)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        step = self.max_fragment
        for start in range(0, len(view), step):
            tag = LAST if start + step >= len(view) else MORE
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                self.outbox.write_tagged(view[start : start + step], tag, left, alive)
            except BaseException as exc:
                if start:  # the reader holds the first part of a message never finished
                    self._torn_out = f"{type(exc).__name__} after {start} bytes"
                raise

    def recv(
        self,
        timeout: float | None = None,
        alive: Callable[[], bool] | None = None,
        max_bytes: int | None = None,
    ) -> Any:
        """Take and decode the next incoming message.

        ``timeout`` bounds the wait for its first record (None: no deadline); each next
        fragment of a multi-part message must follow within :data:`FRAGMENT_TIMEOUT`.
        ``alive`` is checked between wait slices: once it returns False, :class:`PeerGone`
        is raised (after taking what the peer published before it died). A multi-part
        message larger than ``max_bytes`` (default: the channel's ``max_message``) raises
        ``TransportError(reason="too_big")``.
        """
        if self._torn_in is None:
            view = self.inbox.read(timeout, alive)
            size = len(view)
            if size and view[-1] == WHOLE:
                if size > self._unchecked:
                    self._check(view[:-1])
                return self._decode(view[:-1])
        else:
            view = None
        return self._recv_fragments(view, alive, max_bytes)

    def _recv_fragments(self, view, alive, max_bytes) -> Any:
        name = self.inbox.name
        if self._torn_in is not None:
            raise TransportError(
                f"{name!r}: an earlier message was cut off ({self._torn_in}); this channel "
                "cannot deliver more messages",
                worker=name,
                reason="torn",
            )
        limit = self.max_message if max_bytes is None else max_bytes
        data = bytearray()
        parts = 0
        try:
            while True:
                if not len(view) or view[-1] not in (MORE, LAST):
                    raise TransportError(
                        f"{name!r}: record tag {bytes(view[-1:])!r} is not a gym_fork tag",
                        worker=name,
                        reason="tag",
                    )
                if len(data) + len(view) - 1 > limit:
                    raise TransportError(
                        f"{name!r}: a multi-part message grew past {limit} bytes "
                        f"after {parts} parts",
                        worker=name,
                        reason="too_big",
                    )
                data += view[:-1]
                parts += 1
                if view[-1] == LAST:
                    break
                try:
                    view = self.inbox.read(FRAGMENT_TIMEOUT, alive)
                except RingTimeout:
                    raise TransportError(
                        f"{name!r}: a multi-part message stopped after {parts} parts",
                        worker=name,
                        reason="torn",
                    ) from None
                except PeerGone:
                    raise PeerGone(
                        f"{name!r}: the sender died after {parts} parts of a message",
                        worker=name,
                    ) from None
        except BaseException as exc:
            # The rest of this message may still come: never splice it onto the next one.
            self._torn_in = f"{type(exc).__name__} after {parts} parts"
            raise
        if len(data) > self._unchecked:
            self._check(data)
        return self._decode(data)

    def _check(self, data) -> None:
        """Refuse a record holding more values than :attr:`max_objects` (it was read
        whole: the channel stays in step)."""
        if self._max_objects is None:  # no bound (then no record is ever checked)
            return
        try:
            check_bounds(data, self._max_objects)
        except DecodeTooBig as exc:
            raise DecodeTooBig(f"{self.inbox.name!r}: {exc}", worker=self.inbox.name) from None
        except ValueError as exc:
            raise TransportError(
                f"{self.inbox.name!r}: a record does not decode ({exc})",
                worker=self.inbox.name,
                reason="decode",
            ) from None

    def _decode(self, data) -> Any:
        try:
            if self.allow_pickle:
                return unpack(data)
            self.refused = []
            return unpack(data, allow_pickle=False, refused=self.refused)
        except DecodeTooBig as exc:  # a bound met while decoding (tuple keys): too_big
            raise DecodeTooBig(f"{self.inbox.name!r}: {exc}", worker=self.inbox.name) from None
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
