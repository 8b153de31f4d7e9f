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
    worker.outbox.write_tagged(b"x", 3)
    with pytest.raises(TransportError, match="not a gym_fork tag"):
        controller.recv(1)
    assert LAST == 2
    worker.close()
    controller.close()
