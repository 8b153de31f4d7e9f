"""A hostile sandbox, played by a forked child, against the controller's end of a ring:
every wait ends (deadline, dead peer, Ctrl-C), scribbled counters are caught, shared
memory cannot be resized under the controller, and a fragment flood stays bounded."""

from __future__ import annotations

import errno
import os
import select
import signal
import struct
import threading
import time
import tracemalloc

import pytest

from gym_fork.errors import PeerGone, RingTimeout, TransportError
from gym_fork.transport.channel import MORE, Channel
from gym_fork.transport.codec import pack
from gym_fork.transport.region import Region, check_shared_fd, sealed_memfd
from gym_fork.transport.ring import SLICE, Ring, ring_bytes

from .hostile import READ_POS, WRITE_POS, Peer, counters, poke

CAP = 1 << 12
RECORD = b"r" * 200  # 216 bytes in the ring with its header


def fill(ring: Ring) -> int:
    """Write records until the ring is full; how many fit."""
    count = 0
    while True:
        try:
            ring.write(RECORD, timeout=0)
        except RingTimeout:
            return count
        count += 1


def wait_for(pipe_r: int, timeout: float = 5.0) -> None:
    """Wait for the other process's go-ahead; a peer gives up (and exits) after
    ``timeout``, so that a test that fails never leaves it behind."""
    ready, _, _ = select.select([pipe_r], [], [], timeout)
    assert ready, "no go-ahead"
    assert os.read(pipe_r, 1) == b"."


# -- scribbled counters --------------------------------------------------------------


def _rewind_read_pos(region: Region) -> None:
    _, rpos = counters(region.map)
    poke(region.map, READ_POS, rpos - 64)  # backwards, and the ring looks full


def _read_pos_ahead(region: Region) -> None:
    wpos, _ = counters(region.map)
    poke(region.map, READ_POS, wpos + 64)


def _push_write_pos(region: Region) -> None:
    # The writer's own counter, moved so that write_pos - read_pos == capacity: full.
    _, rpos = counters(region.map)
    poke(region.map, WRITE_POS, rpos + CAP)


@pytest.mark.parametrize(
    "scribble", [_rewind_read_pos, _read_pos_ahead, _push_write_pos], ids=lambda f: f.__name__
)
def test_scribbled_counters_fail_a_blocked_send_at_once(scribble):
    """The sandbox reads a few requests, then scribbles the request ring's counters so
    that it looks full: the controller's send with no timeout fails with ``counters``
    instead of waiting forever for space."""
    controller = Channel.create("victim", CAP)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()

    def sandbox() -> None:
        inbox = Ring(controller.region, 0, CAP, create=False, name="sandbox")
        wait_for(go_r)
        for _ in range(2):
            inbox.read(1)
        os.write(done_w, b".")
        wait_for(go_r)
        scribble(controller.region)
        os.write(done_w, b".")
        wait_for(go_r)  # stays alive: the controller must not rely on its death

    try:
        with Peer(sandbox) as peer:
            assert fill(controller.outbox) > 2
            os.write(go_w, b".")
            wait_for(done_r)
            controller.send_raw(RECORD, timeout=0)  # sees the reader's progress
            os.write(go_w, b".")
            wait_for(done_r)
            start = time.monotonic()
            with pytest.raises(TransportError) as info:
                controller.send_raw(RECORD, timeout=None, alive=peer.alive)
            assert time.monotonic() - start < 0.5
            assert info.value.reason == "counters"
            assert "victim requests" in str(info.value)
            assert peer.alive()
            os.write(go_w, b".")
            assert peer.wait() == 0
    finally:
        for fd in (go_r, go_w, done_r, done_w):
            os.close(fd)
        controller.close()


def test_a_rewound_write_position_fails_the_reader_at_once():
    """The sandbox publishes two replies; once the controller took the first, it rewinds
    the reply ring's write position onto the controller's read position: the ring looks
    empty, and the controller's read says ``counters`` instead of waiting."""
    controller = Channel.create("victim", CAP)
    go_r, go_w = os.pipe()
    done_r, done_w = os.pipe()
    second = ring_bytes(CAP)

    def sandbox() -> None:
        outbox = Ring(controller.region, second, CAP, create=False, name="sandbox")
        outbox.write(RECORD)
        outbox.write(RECORD)
        os.write(done_w, b".")
        wait_for(go_r)
        _, rpos = counters(controller.region.map, second)
        poke(controller.region.map, second + WRITE_POS, rpos)
        os.write(done_w, b".")
        wait_for(go_r)

    try:
        with Peer(sandbox) as peer:
            wait_for(done_r)
            assert bytes(controller.inbox.read(1)) == RECORD
            os.write(go_w, b".")
            wait_for(done_r)
            assert controller.inbox.pending() == 0  # looks empty
            start = time.monotonic()
            with pytest.raises(TransportError) as info:
                controller.inbox.read(None, alive=peer.alive)
            assert time.monotonic() - start < 0.5
            assert info.value.reason == "counters"
            assert "victim replies" in str(info.value)
            os.write(go_w, b".")
            assert peer.wait() == 0
    finally:
        for fd in (go_r, go_w, done_r, done_w):
            os.close(fd)
        controller.close()


# -- deadlines, dead peers, signals --------------------------------------------------


def test_a_send_to_a_peer_that_never_reads_times_out_at_its_deadline():
    controller = Channel.create("stuck", CAP)
    stop_r, stop_w = os.pipe()
    try:
        with Peer(lambda: wait_for(stop_r)) as peer:
            fill(controller.outbox)
            for timeout in (0.05, 0.35):  # within one slice, and over several
                start = time.monotonic()
                with pytest.raises(RingTimeout, match="stayed full"):
                    controller.send_raw(RECORD, timeout=timeout, alive=peer.alive)
                elapsed = time.monotonic() - start
                assert timeout <= elapsed < timeout + 0.3
            os.write(stop_w, b".")
            assert peer.wait() == 0
    finally:
        os.close(stop_r)
        os.close(stop_w)
        controller.close()


def stamp(fd: int) -> None:
    """Send this instant (CLOCK_MONOTONIC is one clock for every process)."""
    os.write(fd, struct.pack("<d", time.monotonic()))


def stamped(fd: int) -> float:
    return struct.unpack("<d", os.read(fd, 8))[0]


def test_a_send_without_deadline_ends_when_the_reader_dies():
    controller = Channel.create("dying", CAP)
    fill(controller.outbox)
    when_r, when_w = os.pipe()
    try:
        with Peer(lambda: (time.sleep(0.3), stamp(when_w))) as peer:
            with pytest.raises(PeerGone) as info:
                controller.send_raw(RECORD, timeout=None, alive=peer.alive)
            noticed = time.monotonic()
            assert info.value.reason == "peer_gone"
            assert "dying requests" in str(info.value)
        assert noticed - stamped(when_r) < 2 * SLICE + 0.2
    finally:
        os.close(when_r)
        os.close(when_w)
        controller.close()


class Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise Interrupted


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("restart", [False, True], ids=["eintr", "sa_restart"])
def test_a_blocked_wait_without_timeout_is_interruptible(op, restart):
    """A signal whose handler raises ends a wait with no deadline within a slice, both
    when the signal interrupts the sleep (EINTR) and when the kernel restarts it."""
    region = Region(ring_bytes(CAP))
    writer = Ring(region, 0, CAP, create=True, name="blocked")
    reader = Ring(region, 0, CAP, create=False, name="blocked")
    if op == "write":
        fill(writer)
    previous = signal.signal(signal.SIGUSR1, _raise_interrupted)
    signal.siginterrupt(signal.SIGUSR1, not restart)
    parent = os.getpid()
    when_r, when_w = os.pipe()
    try:
        with Peer(lambda: (time.sleep(0.3), stamp(when_w), os.kill(parent, signal.SIGUSR1))):
            with pytest.raises(Interrupted):
                if op == "read":
                    reader.read(None)
                else:
                    writer.write(RECORD, timeout=None)
            returned = time.monotonic()
        assert returned - stamped(when_r) < 0.2
        # The interrupted call left the ring as it was: it still works both ways.
        if op == "write":
            fill_count = 0
            while reader.pending():
                reader.read(0)
                fill_count += 1
            assert fill_count > 0
        writer.write(b"after", timeout=0)
        assert bytes(reader.read(0)) == b"after"
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(when_r)
        os.close(when_w)
        writer.release()
        reader.release()
        region.close()


def test_ctrl_c_interrupts_a_read_without_timeout():
    region = Region(ring_bytes(CAP))
    reader = Ring(region, 0, CAP, create=True, name="ctrl-c")
    sent = []

    def ctrl_c() -> None:
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    # Python's own Ctrl-C handler, also where this test runs in a background job (whose
    # shell starts it with SIGINT ignored: the read would wait forever).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.2, ctrl_c)
    try:
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            reader.read(None)
        assert time.monotonic() - sent[0] < 0.2
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGINT, previous)
        reader.release()
        region.close()


def test_a_record_published_just_before_death_is_still_delivered():
    """The peer's last record races its death: a reader that sees ``alive()`` False
    takes what was published first, and only then reports the peer gone."""
    region = Region(ring_bytes(CAP))
    writer = Ring(region, 0, CAP, create=True, name="last-word")
    reader = Ring(region, 0, CAP, create=False, name="last-word")
    calls = []

    def alive() -> bool:
        if not calls:
            writer.write(b"last word")  # published between two slices, then "dies"
        calls.append(1)
        return False

    try:
        assert bytes(reader.read(None, alive)) == b"last word"
        with pytest.raises(PeerGone):
            reader.read(None, alive)
    finally:
        writer.release()
        reader.release()
        region.close()


# -- multi-part messages ---------------------------------------------------------------


def test_a_sender_dying_after_the_first_fragment_is_noticed_at_once():
    controller = Channel.create("torn", CAP)
    when_r, when_w = os.pipe()

    def sandbox() -> None:
        worker = Ring(controller.region, ring_bytes(CAP), CAP, create=False, name="w")
        worker.write_tagged(b"first of many", MORE)
        stamp(when_w)  # and dies

    try:
        with Peer(sandbox) as peer:
            with pytest.raises(PeerGone, match="after 1 parts"):
                controller.recv(5.0, alive=peer.alive)
            noticed = time.monotonic()
            assert peer.wait() == 0
        assert noticed - stamped(when_r) < 2 * SLICE + 0.2
        # The rest of that message must never be taken for a message of its own.
        with pytest.raises(TransportError) as info:
            controller.recv(0)
        assert info.value.reason == "torn"
    finally:
        os.close(when_r)
        os.close(when_w)
        controller.close()


def test_a_fragment_flood_is_refused_with_bounded_memory():
    """A sandbox that sends fragments without end: the controller stops at its bound
    (``too_big``) and its memory stays within a small multiple of that bound."""
    controller = Channel.create("flood", 1 << 16)
    bound = 1 << 20
    fragment = b"f" * (controller.max_fragment - 1)

    def sandbox() -> None:
        worker = Ring(controller.region, ring_bytes(1 << 16), 1 << 16, create=False, name="w")
        for _ in range(16 * bound // len(fragment)):  # 16 x the bound, if it were read
            worker.write_tagged(fragment, MORE, timeout=5)

    tracemalloc.start()
    try:
        with Peer(sandbox):
            with pytest.raises(TransportError) as info:
                controller.recv(5.0, max_bytes=bound)
            _, peak = tracemalloc.get_traced_memory()
        assert info.value.reason == "too_big"
        assert "flood replies" in str(info.value)
        assert peak < 3 * bound
    finally:
        tracemalloc.stop()
        controller.close()


def test_the_channel_bound_applies_and_messages_under_it_cross():
    controller = Channel.create("bounded", CAP, max_message=3000)
    worker = Channel.attach(os.dup(controller.region.fd), CAP, "bounded")
    try:
        worker.send_raw(pack(b"a" * 2900))  # three fragments, under the bound
        assert controller.recv(1) == b"a" * 2900
        worker.send_raw(pack(b"b" * 3100))
        with pytest.raises(TransportError) as info:
            controller.recv(1)
        assert info.value.reason == "too_big"
    finally:
        worker.close()
        controller.close()


# -- sealed shared memory --------------------------------------------------------------


def _resize_errors(fd: int, size: int) -> list[int]:
    errors = []
    for new_size in (0, size // 2, size * 2):
        try:
            os.ftruncate(fd, new_size)
            errors.append(0)
        except OSError as exc:
            errors.append(exc.errno)
    return errors


@pytest.mark.parametrize("make", ["region", "channel", "sealed_memfd"])
def test_a_sandbox_cannot_resize_shared_memory_under_the_controller(make):
    size = 1 << 16
    if make == "channel":
        channel = Channel.create("sealed", CAP)
        region = channel.region
        size = region.size
    elif make == "region":
        channel, region = None, Region(size)
    else:
        channel, region = None, Region(size, fd=sealed_memfd("test", size))
    region.map[size - 8 :] = b"sentinel"
    report_r, report_w = os.pipe()

    def sandbox() -> None:
        os.write(report_w, bytes(str(_resize_errors(region.fd, size)), "ascii"))

    try:
        with Peer(sandbox) as peer:
            assert peer.wait() == 0
        assert os.read(report_r, 100) == bytes(str([errno.EPERM] * 3), "ascii")
        assert os.fstat(region.fd).st_size == size
        # Touches every page, the last included: no SIGBUS.
        assert bytes(region.map[size - 8 :]) == b"sentinel"
        assert sum(region.map[: size - 8]) >= 0
    finally:
        os.close(report_r)
        os.close(report_w)
        if channel is not None:
            channel.close()
        else:
            region.close()


def test_an_unsealed_memfd_can_be_shrunk_and_is_refused():
    """The control case: without seals the child's truncation works, which is why the
    attach refuses such an fd."""
    size = 1 << 16
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    try:
        with Peer(lambda: os.ftruncate(fd, 0)) as peer:
            assert peer.wait() == 0
        assert os.fstat(fd).st_size == 0
        os.ftruncate(fd, size)
        with pytest.raises(TransportError) as info:
            Region.attach(fd, size, name="unsealed")
        assert info.value.reason == "unsealed"
        assert "sealed_memfd" in str(info.value)
        os.fstat(fd)  # still the caller's to close
    finally:
        os.close(fd)


def test_attach_refuses_a_short_memfd_and_accepts_a_device():
    fd = sealed_memfd("short", 4096)
    try:
        with pytest.raises(TransportError) as info:
            Region.attach(fd, 8192)
        assert info.value.reason == "short"
        with pytest.raises(TransportError):
            check_shared_fd(fd, 4096, offset=4096)
        check_shared_fd(fd, 4096)
    finally:
        os.close(fd)
    # A character device (as /dev/mem in a microVM guest, mapped at an offset) has no
    # size a peer could shrink: it is mapped as it is.
    region = Region.attach(os.open("/dev/zero", os.O_RDWR), 4096)
    try:
        region.map[:4] = b"abcd"
        assert bytes(region.map[:4]) == b"abcd"
    finally:
        region.close()


def test_a_channel_attach_refuses_an_unsealed_region():
    size = 2 * ring_bytes(CAP)
    fd = os.memfd_create("unsealed-channel", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    try:
        with pytest.raises(TransportError) as info:
            Channel.attach(fd, CAP, "worker 7")
        assert info.value.reason == "unsealed"
        assert "worker 7" in str(info.value)
    finally:
        os.close(fd)


# -- slices keep the waiting strategy ------------------------------------------------------


def test_a_sliced_polling_read_still_sleeps_on_its_doorbell():
    """A polling read with no deadline is cut into slices; the time it has waited carries
    over from slice to slice, so after GF_POLL_IDLE_AFTER_NS (200 ms) it still blocks on
    its doorbell (ext/gf_ring.c, invariants 11 and 13), and one byte wakes it."""
    region = Region(ring_bytes(CAP))
    writer = Ring(region, 0, CAP, create=True, name="bell", poll=True)
    bell_r, bell_w = os.pipe()
    result_r, result_w = os.pipe()

    def guest() -> None:
        reader = Ring(region, 0, CAP, create=False, name="bell", poll=True)
        reader.bell_fd = bell_r
        os.write(result_w, bytes(reader.read(None)))

    try:
        with Peer(guest) as peer:
            deadline = time.monotonic() + 2.0
            while not writer.reader_sleeps() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert writer.reader_sleeps(), "the sliced read never reached its doorbell"
            writer.peer_bell_fd = bell_w
            sent = time.monotonic()
            writer.write(b"wake up")
            assert select.select([result_r], [], [], 1.0)[0]
            assert time.monotonic() - sent < SLICE
            assert os.read(result_r, 100) == b"wake up"
            assert peer.wait() == 0
    finally:
        for fd in (bell_r, bell_w, result_r, result_w):
            os.close(fd)
        writer.release()
        region.close()
