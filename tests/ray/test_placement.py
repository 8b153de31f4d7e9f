"""gym_fork.ray.placement without a cluster: which node each shard and each fork copy
goes to (milliseconds)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="ray is not installed (pip install 'gym_fork[ray]')")

from gym_fork.ray.placement import fork_layout, shard_layout


def node(node_id: str, cpus: int = 1) -> dict:
    return {"NodeID": node_id, "Resources": {"CPU": cpus}}


NODES = [node("a", 4), node("b", 2), node("c", 1)]


def test_one_shard_per_node_in_even_contiguous_blocks():
    assert shard_layout(NODES, 7) == [("a", [0, 1, 2]), ("b", [3, 4]), ("c", [5, 6])]


def test_never_more_shards_than_sub_envs():
    assert shard_layout(NODES, 2) == [("a", [0]), ("b", [1])]


def test_cores_per_shard_and_num_shards():
    assert [n for n, _ in shard_layout(NODES, 8, cores_per_shard=2)] == ["a", "a", "b", "c"]
    assert [n for n, _ in shard_layout(NODES, 8, num_shards=5)] == ["a", "b", "c", "a", "b"]


def test_nodes_narrow_and_order_the_placement():
    assert shard_layout(NODES, 4, nodes=["c", "a"]) == [("c", [0, 1]), ("a", [2, 3])]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_shards": 0}, ValueError),
        ({"num_shards": True}, ValueError),
        ({"nodes": ["z"]}, RuntimeError),
    ],
)
def test_bad_placements_are_refused(kwargs, error):
    with pytest.raises(error):
        shard_layout(NODES, 4, **kwargs)


class S:
    """A shard stand-in: fork_layout only keys groups by identity."""


def test_a_fork_without_spread_stays_on_the_sources_nodes():
    s0, s1 = S(), S()
    owner = {0: (s0, "a", 0), 1: (s0, "a", 1), 2: (s1, "b", 0)}.__getitem__
    exact, fresh = fork_layout([2, 0], 2, owner)
    assert fresh == {}
    assert [(g.shard, g.local, g.per_index, g.positions) for g in exact] == [
        (s1, [0], 2, [0, 1]),
        (s0, [0], 2, [2, 3]),
    ]


def test_a_spread_fork_deals_copies_round_robin_from_the_home_node():
    s0 = S()
    exact, fresh = fork_layout([1], 5, {1: (s0, "b", 1)}.__getitem__, ["a", "b", "c"])
    # ring b, a, c: copies 0 and 3 stay home (exact), 1 and 4 go to a, 2 to c (fresh)
    assert [(g.local, g.per_index, g.positions) for g in exact] == [([1], 2, [0, 3])]
    assert fresh == {"a": [(1, 1), (4, 1)], "c": [(2, 1)]}
