"""The C ring through its Python face: records, wraparound, full ring, corruption."""

from __future__ import annotations

import os
import struct
import time
import types
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_fork.errors import RingTimeout, TransportError
from gym_fork.transport import ring as ring_module
from gym_fork.transport.region import Region
from gym_fork.transport.ring import CONTROL_BYTES, SLICE, AnyRing, Ring, ring_bytes, wait


def make_pair(capacity: int = 1024):
    region = Region(ring_bytes(capacity))
    writer = Ring(region, 0, capacity, create=True, name="test")
    reader = Ring(region, 0, capacity, create=False, name="test")
    return region, writer, reader


def close(region, *rings):
    for ring in rings:
        ring.release()
    region.close()


def test_round_trip_keeps_bytes_and_order():
    region, w, r = make_pair()
    w.write(b"head", b"body")
    w.write(b"", b"")
    w.write(b"x" * 100)
    assert bytes(r.read(0)) == b"headbody"
    assert bytes(r.read(0)) == b""
    assert bytes(r.read(0)) == b"x" * 100
    with pytest.raises(RingTimeout):
        r.read(0)
    close(region, w, r)


def test_full_ring_blocks_then_times_out_without_overwriting():
    region, w, r = make_pair(256)
    written = 0
    with pytest.raises(RingTimeout):
        for i in range(100):
            w.write(bytes([i]) * 40, timeout=0.05)
            written += 1
    assert 0 < written < 100
    for i in range(written):
        assert bytes(r.read(0)) == bytes([i]) * 40
    w.write(b"after", timeout=0)
    assert bytes(r.read(0)) == b"after"
    close(region, w, r)


def test_record_that_can_never_fit_is_a_clear_error():
    region, w, r = make_pair(256)
    with pytest.raises(TransportError, match="can never fit") as info:
        w.write(b"z" * 300)
    assert info.value.reason == "too_big"
    close(region, w, r)


def test_capacity_must_be_a_power_of_two():
    region = Region(ring_bytes(1000))
    with pytest.raises(TransportError):
        Ring(region, 0, 1000, create=True, name="odd")
    region.close()


def test_reader_grows_its_buffer_for_large_records():
    region, w, r = make_pair(1 << 16)
    payload = os.urandom(50_000)
    w.write(payload)
    assert bytes(r.read(0)) == payload
    close(region, w, r)


@pytest.mark.parametrize(
    ("offset", "value", "reason"),
    [
        (0, 0xDEADBEEF, "magic"),  # record magic
        (4, 0x7FFFFFF0, "length"),  # record length beyond what was published
        (8, 99, "sequence"),  # record sequence number
    ],
)
def test_corrupt_record_is_detected_and_not_consumed(offset, value, reason):
    region, w, r = make_pair()
    w.write(b"hello")
    data = CONTROL_BYTES  # the first record starts at data[0]
    struct.pack_into("<I", region.map, data + offset, value)
    for _ in range(2):  # reported every time: the reader does not skip it
        with pytest.raises(TransportError) as info:
            r.read(0)
        assert info.value.reason == reason
        assert "test" in str(info.value)
    close(region, w, r)


def test_scribbled_counters_are_detected():
    region, w, r = make_pair()
    w.write(b"hello")
    struct.pack_into("<Q", region.map, 0, 1 << 40)  # write_pos far beyond capacity
    with pytest.raises(TransportError) as info:
        r.read(0)
    assert info.value.reason == "counters"
    close(region, w, r)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=300), st.binary(max_size=300)), max_size=80))
def test_random_records_with_wraparound(records):
    region, w, r = make_pair(1024)
    for head, body in records:  # interleave so the ring wraps many times
        w.write(head, body, timeout=0)
        assert bytes(r.read(0)) == head + body
    assert r.pending() == 0
    close(region, w, r)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=120), min_size=1, max_size=40))
def test_batches_up_to_full_then_drain(records):
    region, w, r = make_pair(512)
    queued = []
    for rec in records:
        try:
            w.write(rec, timeout=0)
            queued.append(rec)
        except RingTimeout:
            break
    assert [bytes(r.read(0)) for _ in queued] == queued
    close(region, w, r)


def _checksummed(i: int) -> bytes:
    body = (i * 2654435761 % 4093).to_bytes(2, "little") * (i % 61)
    return struct.pack("<QI", i, zlib.crc32(body)) + body


@pytest.mark.slow  # 4.2 s here
def test_two_processes_a_million_checksummed_records():
    region, w, r = make_pair(1 << 14)
    count = 1_000_000
    pid = os.fork()
    if pid == 0:  # producer
        code = 0
        try:
            for i in range(count):
                w.write(_checksummed(i), timeout=10)
        except BaseException:
            code = 1
        os._exit(code)
    try:
        for i in range(count):
            rec = bytes(r.read(10))
            seq, crc = struct.unpack_from("<QI", rec)
            assert seq == i
            assert zlib.crc32(rec[12:]) == crc
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    close(region, w, r)


def test_the_one_wait_loop_checks_liveness_once_a_slice_and_ends_at_its_deadline(monkeypatch):
    clock = types.SimpleNamespace(now=100.0)
    monkeypatch.setattr(ring_module, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    checks, attempts = [], []

    def attempt(ns):  # returns early, as a wait on several rings does once it took some
        attempts.append(ns)
        clock.now += 0.001
        return None

    assert wait(attempt, 100.25, lambda: checks.append(clock.now)) is None
    assert clock.now >= 100.25 and 240 <= len(attempts) <= 251
    assert max(attempts) == int(SLICE * 1e9) and min(attempts) < int(SLICE * 1e9)
    # At once, then once a slice (not once per attempt), and once more at the deadline.
    assert [round(t - 100.0, 3) for t in checks] == [0.0, 0.1, 0.2, 0.25]
    assert wait(lambda ns: None, None, lambda: "dead") == "dead"  # the check ends it
    # A peer that died within the last slice: dead, not timed out.
    clock.now = 200.0
    found = iter([None, "dead"])
    assert wait(attempt, 200.05, lambda: next(found)) == "dead"


def test_any_ring_names_the_rings_holding_a_record_and_times_out_when_none_does():
    first, w1, r1 = make_pair()
    second, w2, r2 = make_pair()
    rings = AnyRing({3: r1, 7: r2})
    started = time.monotonic()
    assert rings.within(int(0.02e9)) is None
    assert time.monotonic() - started >= 0.02
    w2.write(b"x")
    assert rings.ready() == [7] and rings.within(int(1e9)) == [7]
    rings.drop(7)
    assert rings.ready() == []
    close(first, w1, r1)
    close(second, w2, r2)
