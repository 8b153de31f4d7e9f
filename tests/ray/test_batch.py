"""gym_fork.ray.batch without a cluster: splitting batches over shards and putting them
back, infos merged exactly as VectorEnv._add_info builds them (milliseconds)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'gym_fork[ray]')")

from gymnasium import spaces
from gymnasium.vector import VectorEnv

from gym_fork.ray import batch as B

SPACE = spaces.Dict(
    {
        "x": spaces.Box(-1.0, 1.0, (2,), np.float32),
        "t": spaces.Tuple((spaces.Discrete(4), spaces.Text(5))),
    }
)
SHARDS = [slice(0, 2), np.array([2, 4]), np.array([3])]  # a slice and index arrays


def batch(n: int = 5):
    return {
        "x": np.arange(2 * n, dtype=np.float32).reshape(n, 2),
        "t": (np.arange(n) % 4, tuple(f"s{i}" for i in range(n))),
    }


def test_take_then_assemble_gives_the_batch_back():
    full = batch()
    parts = [(sel, B.take(SPACE, full, sel)) for sel in SHARDS]
    assert parts[1][1]["x"].tolist() == [[4.0, 5.0], [8.0, 9.0]]
    assert parts[1][1]["t"][1] == ("s2", "s4")
    again = B.assemble(SPACE, 5, parts)
    assert np.array_equal(again["x"], full["x"]) and again["x"].dtype == np.float32
    assert np.array_equal(again["t"][0], full["t"][0])
    assert again["t"][1] == full["t"][1]


def test_assemble_makes_a_new_batch():
    full = batch(2)
    again = B.assemble(SPACE, 2, [(slice(0, 2), full)])
    again["x"][0, 0] = 99.0
    assert full["x"][0, 0] == 0.0


def test_positions_and_scalars():
    assert B.positions(slice(1, 3), 5).tolist() == [1, 2]
    assert B.positions(np.array([4, 0]), 5).tolist() == [4, 0]
    rewards = B.scalars(
        4,
        np.float64,
        [(slice(0, 2), np.array([1.0, 2.0])), (np.array([3, 2]), np.array([4.0, 3.0]))],
    )
    assert rewards.tolist() == [1.0, 2.0, 3.0, 4.0] and rewards.dtype == np.float64


def sub_env_infos():
    """Per sub-env infos, with keys set by some sub-envs only, mixed types, nesting."""
    return [
        {"a": 1, "nested": {"k": 0.5}},
        {},
        {"a": 2, "name": "two"},
        {"b": True, "nested": {"k": 1.5, "j": 3}},
        {"a": 4, "name": None},
    ]


def reference(infos):
    env = VectorEnv()
    env.num_envs = len(infos)
    out: dict = {}
    for i, info in enumerate(infos):
        out = env._add_info(out, info, i)
    return out


def shard_info(infos, pos):
    env = VectorEnv()
    env.num_envs = len(pos)
    out: dict = {}
    for j, i in enumerate(pos):
        out = env._add_info(out, infos[i], j)
    return out


def assert_same(a, b, path="info"):
    assert set(a) == set(b), path
    for key in a:
        if isinstance(a[key], dict):
            assert_same(a[key], b[key], f"{path}[{key!r}]")
            continue
        assert a[key].dtype == b[key].dtype, f"{path}[{key!r}]"
        assert a[key].tolist() == b[key].tolist(), f"{path}[{key!r}]"


@pytest.mark.parametrize("layout", [[[0, 1, 2, 3, 4]], [[0, 1], [2, 3, 4]], [[3, 1], [4, 0, 2]]])
def test_merge_infos_equals_add_info(layout):
    infos = sub_env_infos()
    parts = [(np.array(pos), shard_info(infos, pos)) for pos in layout]
    assert_same(B.merge_infos(5, parts), reference(infos))


def test_merge_infos_of_empty_shards():
    assert B.merge_infos(3, [(np.array([0, 1]), {}), (np.array([2]), {})]) == {}
