"""Step throughput of vector envs and the round trip of a ring against a pipe."""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np

from gym_fork.progress import Task


def steps_per_second(make: Callable[[], Any], steps: int, num_envs: int) -> float:
    """Sub-env steps per second of ``make()`` (a vector env of CartPole-like envs with
    actions 0/1) over ``steps`` vector steps after 100 warm-up steps."""
    envs = make()
    try:
        envs.reset(seed=0)
        actions = np.random.default_rng(0).integers(0, 2, (steps, num_envs))
        for a in actions[:100]:
            envs.step(a)
        start = time.perf_counter()
        for a in actions:
            envs.step(a)
        return steps * num_envs / (time.perf_counter() - start)
    finally:
        envs.close()


def cartpole_makers(num_envs: int, per_worker: bool = True) -> dict[str, Callable[[], Any]]:
    """Vector envs of ``num_envs`` CartPole-v1 to compare, by name (``per_worker``: also
    ForkVectorEnv with one sandbox per sub-env)."""
    from gym_fork import ForkVectorEnv

    def fns() -> list[Callable[[], gym.Env]]:
        return [lambda: gym.make("CartPole-v1") for _ in range(num_envs)]

    makers: dict[str, Callable[[], Any]] = {
        "SyncVectorEnv": lambda: gym.vector.SyncVectorEnv(fns()),
        "AsyncVectorEnv": lambda: gym.vector.AsyncVectorEnv(fns()),
        "ForkVectorEnv (auto)": lambda: ForkVectorEnv(fns()),
    }
    if per_worker:
        makers["ForkVectorEnv (envs_per_worker=1)"] = lambda: ForkVectorEnv(
            fns(), envs_per_worker=1
        )
    return makers


def compare(
    makers: dict[str, Callable[[], Any]],
    steps: int,
    num_envs: int,
    repeats: int,
    bar: Task | None = None,
) -> dict[str, list[float]]:
    """Steps/s of every maker, ``repeats`` times each, interleaved so that drift on a
    shared machine hits every row alike."""
    results: dict[str, list[float]] = {name: [] for name in makers}
    for _ in range(repeats):
        for name, make in makers.items():
            results[name].append(steps_per_second(make, steps, num_envs))
            if bar is not None:
                bar.advance()
    return results


def medians(results: dict[str, list[float]]) -> dict[str, float]:
    """The median of each row."""
    return {name: statistics.median(values) for name, values in results.items()}


def ring_round_trip_us(count: int = 20000) -> float:
    """Mean round trip (us) of a 32-byte record through a gym_fork ring pair to a forked
    echo process and back."""
    from gym_fork.transport.channel import Channel

    controller = Channel.create("bench", 1 << 16)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 16, "bench")
    pid = os.fork()
    if pid == 0:
        try:
            for _ in range(count):
                worker.outbox.write(bytes(worker.inbox.read(5)))
        finally:
            os._exit(0)
    msg = b"x" * 32
    start = time.perf_counter()
    for _ in range(count):
        controller.outbox.write(msg)
        controller.inbox.read(5)
    elapsed = time.perf_counter() - start
    os.waitpid(pid, 0)
    worker.close()
    controller.close()
    return elapsed / count * 1e6


def _echo(conn: Any, count: int) -> None:
    for _ in range(count):
        conn.send_bytes(conn.recv_bytes())


def pipe_round_trip_us(count: int = 20000) -> float:
    """The same round trip through a multiprocessing Pipe."""
    ours, theirs = mp.Pipe()
    proc = mp.get_context("fork").Process(target=_echo, args=(theirs, count))
    proc.start()
    msg = b"x" * 32
    start = time.perf_counter()
    for _ in range(count):
        ours.send_bytes(msg)
        ours.recv_bytes()
    elapsed = time.perf_counter() - start
    proc.join()
    ours.close()
    theirs.close()
    return elapsed / count * 1e6
