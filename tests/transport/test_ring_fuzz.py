"""Fuzz the reader: whatever a hostile peer writes into the shared region, a read
returns a record or raises a typed error, promptly; it never crashes or hangs."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_fork.errors import RingTimeout, TransportError
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import unpack
from gym_fork.transport.region import Region
from gym_fork.transport.ring import CONTROL_BYTES, Ring, ring_bytes

CAPACITY = 1024


@settings(max_examples=300, deadline=None)
@given(
    records=st.lists(st.binary(max_size=200), max_size=6),
    writes=st.lists(
        st.tuples(st.integers(0, CONTROL_BYTES + CAPACITY - 1), st.binary(min_size=1, max_size=64)),
        max_size=8,
    ),
)
def test_reader_survives_arbitrary_scribbles(records, writes):
    region = Region(ring_bytes(CAPACITY))
    writer = Ring(region, 0, CAPACITY, create=True, name="fuzz")
    reader = Ring(region, 0, CAPACITY, create=False, name="fuzz")
    try:
        for rec in records:
            writer.write(rec, timeout=0)
        for offset, data in writes:
            data = data[: len(region.map) - offset]
            region.map[offset : offset + len(data)] = data
        start = time.monotonic()
        for _ in range(len(records) + 2):
            try:
                out = reader.read(0)
            except (RingTimeout, TransportError):
                break
            assert len(out) <= CAPACITY
        assert time.monotonic() - start < 1.0
    finally:
        writer.release()
        reader.release()
        region.close()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 3))
def test_channel_decodes_or_raises_a_transport_error(payload, tag):
    import gym_fork.transport.channel as channel_module

    saved, channel_module.FRAGMENT_TIMEOUT = channel_module.FRAGMENT_TIMEOUT, 0.01
    controller = Channel.create("fuzz", 1 << 12)
    try:
        # Play the worker: put raw bytes and a tag in the reply ring.
        peer = Ring(controller.region, ring_bytes(1 << 12), 1 << 12, create=False, name="peer")
        peer.write(payload + bytes([tag]), timeout=0)
        failure = {1: "torn", 3: "tag"}.get(tag)  # MORE with nothing after; unknown tag
        if failure is None:
            try:
                expected = unpack(payload)
            except Exception:
                failure = "decode"
        if failure is not None:
            with pytest.raises(TransportError) as info:
                controller.recv(0.01)
            assert info.value.reason == failure
        else:
            from gymnasium.utils.env_checker import data_equivalence

            assert data_equivalence(controller.recv(0.01), expected)
        peer.release()
    finally:
        controller.close()
        channel_module.FRAGMENT_TIMEOUT = saved
