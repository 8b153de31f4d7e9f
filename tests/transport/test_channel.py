"""Channels: messages of any size cross rings of a fixed size, in fragments."""

from __future__ import annotations

import os

import numpy as np
import pytest

from gym_fork.errors import TransportError
from gym_fork.transport.channel import LAST, MORE, Channel


def test_a_message_many_times_the_ring_size_crosses_in_fragments():
    controller = Channel.create("big", 1 << 12)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 12, "big")
    frame = np.arange(300_000, dtype=np.uint8).reshape(500, 600)
    pid = os.fork()
    if pid == 0:
        try:
            worker.send({"frame": frame, "tail": "end"})
        finally:
            os._exit(0)
    received = controller.recv(10)
    os.waitpid(pid, 0)
    assert np.array_equal(received["frame"], frame) and received["tail"] == "end"
    worker.close()
    controller.close()


def test_a_torn_multi_part_message_is_reported(monkeypatch):
    import gym_fork.transport.channel as channel_module

    monkeypatch.setattr(channel_module, "FRAGMENT_TIMEOUT", 0.05)
    controller = Channel.create("torn", 1 << 12)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 12, "torn")
    worker.outbox.write_tagged(b"first half", MORE)  # the writer "dies" here
    with pytest.raises(TransportError, match="stopped after 1 parts"):
        controller.recv(1)
    # The rest of that message could still arrive: it must never be taken for a message.
    worker.outbox.write_tagged(b"second half", LAST)
    with pytest.raises(TransportError, match="cut off") as info:
        controller.recv(1)
    assert info.value.reason == "torn"
    worker.close()
    controller.close()


def test_a_record_with_an_unknown_tag_is_reported():
    controller = Channel.create("tag", 1 << 12)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 12, "tag")
    worker.outbox.write_tagged(b"x", 3)
    with pytest.raises(TransportError, match="not a gym_fork tag") as info:
        controller.recv(1)
    assert info.value.reason == "tag"
    worker.close()
    controller.close()


def test_polling_channels_cross_processes_without_futexes():
    """poll=True (a peer in a VM, no shared kernel) carries messages both ways and
    times out like the futex mode."""
    from gym_fork.errors import RingTimeout
    from gym_fork.transport.channel import region_bytes

    controller = Channel.create("polled", 1 << 16, poll=True)
    assert controller.region.size == region_bytes(1 << 16)
    assert controller.region.size & (controller.region.size - 1) == 0
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            worker = Channel.attach(controller.region.fd, 1 << 16, "polled", poll=True)
            for _ in range(200):
                worker.send(["echo", worker.recv(5.0)])
            code = 0
        finally:
            os._exit(code)
    try:
        for k in range(200):
            payload = {"k": k, "data": b"x" * (k * 37)}
            controller.send(payload)
            assert controller.recv(5.0) == ["echo", payload]
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(RingTimeout):
        controller.recv(0.05)
    controller.close()


def test_a_copied_channel_continues_from_the_same_counters():
    """A VM clone resumes mid-read with its parent's ring positions in its registers;
    set_positions gives its new channel the same counters."""
    parent = Channel.create("parent", 1 << 12)
    worker_side = Channel.attach(os.dup(parent.region.fd), 1 << 12, "parent")
    for k in range(5):
        parent.send(k)
        assert worker_side.recv(1.0) == k
        worker_side.send(-k)
        assert parent.recv(1.0) == -k
    clone = Channel.create("clone", 1 << 12)
    clone.set_positions(parent.positions())
    clone_worker = Channel.attach(os.dup(clone.region.fd), 1 << 12, "clone")
    clone.send("after")
    assert clone_worker.recv(1.0) == "after"
    fresh = Channel.create("fresh", 1 << 12)
    fresh_worker = Channel.attach(os.dup(fresh.region.fd), 1 << 12, "fresh")
    fresh_worker.outbox.write_tagged(b"\x01", 0)  # a record with sequence number 1 ...
    parent_view = parent.positions()
    assert parent_view != fresh.positions()  # ... where the parent's ring is past 5
    for channel in (parent, worker_side, clone, clone_worker, fresh, fresh_worker):
        channel.close()
