"""Round trip of one small record: gym_fork ring vs a multiprocessing pipe (two processes).

.venv/bin/python -m pytest benchmarks/test_ring_latency.py --benchmark-only
"""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from gym_fork.transport.channel import Channel

ROUND_TRIPS = 2000


def _ring_echo(channel: Channel, count: int) -> None:
    for _ in range(count):
        channel.outbox.write(bytes(channel.inbox.read(5)))


@pytest.fixture
def ring_pair():
    controller = Channel.create("bench", 1 << 16)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 16, "bench")
    yield controller, worker
    worker.close()
    controller.close()


def test_ring_round_trip(benchmark, ring_pair):
    controller, worker = ring_pair
    rounds = 10
    pid = os.fork()
    if pid == 0:
        try:
            _ring_echo(worker, ROUND_TRIPS * (rounds + 1))
        finally:
            os._exit(0)
    msg = b"x" * 32

    def run():
        for _ in range(ROUND_TRIPS):
            controller.outbox.write(msg)
            controller.inbox.read(5)

    benchmark.group = f"small-record round trip x{ROUND_TRIPS}"
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    os.waitpid(pid, 0)


def _pipe_echo(conn, count):
    for _ in range(count):
        conn.send_bytes(conn.recv_bytes())


def test_pipe_round_trip(benchmark):
    ours, theirs = mp.Pipe()
    rounds = 10
    proc = mp.get_context("fork").Process(
        target=_pipe_echo, args=(theirs, ROUND_TRIPS * (rounds + 1))
    )
    proc.start()
    msg = b"x" * 32

    def run():
        for _ in range(ROUND_TRIPS):
            ours.send_bytes(msg)
            ours.recv_bytes()

    benchmark.group = f"small-record round trip x{ROUND_TRIPS}"
    benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    proc.join()
