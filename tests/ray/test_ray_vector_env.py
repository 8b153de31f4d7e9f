"""RayForkVectorEnv on a 3-node loopback cluster (1 CPU each): conformance with
SyncVectorEnv, exact forks on a remote shard, spread forks, loss of an actor and of a
node with recovery at reset(), and nothing listening or dialling off loopback."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'gym_fork[ray]')")

import gymnasium as gym  # noqa: E402
import numpy as np  # noqa: E402
from gymnasium import spaces  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402

from gym_fork.errors import SubEnvCrashed  # noqa: E402
from gym_fork.lineage import read_log  # noqa: E402
from gym_fork.ray import RayForkVectorEnv, ShardLost, loopback_cluster  # noqa: E402
from gym_fork.ray.cluster import is_loopback  # noqa: E402
from tests.helpers import (  # noqa: E402
    SpaceEnv,
    descendants,
    gym_fork_scratch_dirs,
    gym_fork_shm_files,
    wait_until,
)

# Ray's processes belong to the module's cluster, not to one test: each test checks its
# own actors are gone (shard_workers_gone) and the cluster fixture checks everything.
pytestmark = [pytest.mark.leaks_checked_inside, pytest.mark.timeout(180)]

OBS = spaces.Dict({"x": spaces.Box(-1.0, 1.0, (3,), np.float32), "k": spaces.Discrete(5)})


def space_env():
    return SpaceEnv(OBS, spaces.Discrete(3), max_len=6, trunc_prob=0.1)


@pytest.fixture(scope="module")
def cluster():
    procs_before = descendants()
    shm_before, scratch_before = gym_fork_shm_files(), gym_fork_scratch_dirs()
    with loopback_cluster(num_nodes=3, num_cpus=1) as handle:
        yield handle
        temp_dir = handle.temp_dir
    # loopback_cluster raised above if a process of the cluster outlived it.
    assert not os.path.exists(temp_dir), "the Ray session directory was left behind"
    assert not ray.is_initialized()
    assert wait_until(lambda: descendants() <= procs_before), (
        f"leaked processes: {descendants() - procs_before}"
    )
    assert gym_fork_shm_files() <= shm_before
    assert wait_until(lambda: gym_fork_scratch_dirs() <= scratch_before)
    left = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout
    assert not left.strip(), f"processes still name the session dir: {left}"


def shard_workers(cluster) -> set[int]:
    out = set()
    for pid in cluster.live_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::ShardWorker"):
                    out.add(pid)
        except OSError:
            pass
    return out


@pytest.fixture(autouse=True)
def shard_workers_gone(cluster):
    """Every test closes its vector envs: their shard actors (and sandboxes) end."""
    yield
    assert wait_until(lambda: not shard_workers(cluster), timeout=15), (
        f"shard actors left: {shard_workers(cluster)}"
    )


def assert_info_equal(a, b, path="info"):
    assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict):
            assert_info_equal(x, y, f"{path}[{key!r}]")
            continue
        assert len(x) == len(y), f"{path}[{key!r}]"
        assert np.asarray(x).dtype == np.asarray(y).dtype, f"{path}[{key!r}] dtype"
        for u, v in zip(x, y, strict=True):
            assert_obs_equal(u, v)


def assert_obs_equal(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_obs_equal(a[k], b[k])
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b)), (a, b)


def test_loopback_only(cluster):
    listeners = cluster.listeners()
    assert listeners, "ss saw no listening socket of the cluster: the check would be void"
    names = {name for _addr, name, _pid in listeners}
    assert {"gcs_server", "raylet"} <= names
    off = [row for row in listeners if not is_loopback(row[0])]
    assert not off, f"Ray listens off loopback: {off}"
    connections = cluster.connections()
    assert connections
    off = [row for row in connections if not is_loopback(row[0])]
    assert not off, f"Ray dials off loopback: {off}"


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_conformance_with_sync(cluster, mode):
    n = 7  # 3 + 2 + 2 over the three nodes
    envs = RayForkVectorEnv([space_env] * n, autoreset_mode=mode)
    sync = SyncVectorEnv([space_env] * n, autoreset_mode=mode)
    try:
        assert len({p["node_id"] for p in envs.placement}) == 3
        assert [len(p["indices"]) for p in envs.placement] == [3, 2, 2]
        # With shard actors and sandboxes running, still nothing off loopback.
        listeners = cluster.listeners()
        assert any(name.startswith("ray::ShardWork") for _a, name, _p in listeners)
        assert all(is_loopback(addr) for addr, _n, _p in listeners), listeners
        assert all(is_loopback(addr) for addr, _n, _p in cluster.connections())
        assert envs.single_observation_space == sync.single_observation_space
        assert envs.metadata["autoreset_mode"] == mode
        obs, info = envs.reset(seed=11)
        want_obs, want_info = sync.reset(seed=11)
        assert_obs_equal(obs, want_obs)
        assert_info_equal(info, want_info)
        rng = np.random.default_rng(5)
        dones = 0
        for _ in range(40):
            actions = rng.integers(0, 3, n)
            got = envs.step(actions)
            want = sync.step(actions)
            assert_obs_equal(got[0], want[0])
            for g, w in zip(got[1:4], want[1:4], strict=True):
                assert g.dtype == w.dtype
                assert np.array_equal(g, w)
            assert_info_equal(got[4], want[4])
            dones += int(np.sum(got[2] | got[3]))
        assert dones > 5, "episodes must end (autoreset paths exercised)"
        # A masked reset touches only the masked sub-envs.
        mask = np.array([True, False, False, False, True, False, True])
        got = envs.reset(seed=3, options={"reset_mask": mask})
        want = sync.reset(seed=3, options={"reset_mask": mask})
        if mode == AutoresetMode.NEXT_STEP:
            assert_obs_equal(got[0], want[0])
        assert_info_equal(got[1], want[1])
        # call / get_attr / set_attr in sub-env order.
        assert envs.get_attr("t") == sync.get_attr("t")
        envs.set_attr("marker", [f"m{i}" for i in range(n)])
        assert envs.get_attr("marker") == tuple(f"m{i}" for i in range(n))
        assert envs.call("add", 1, y=2) == sync.call("add", 1, y=2)
        # A sub-env's error names it by its global index.
        with pytest.raises(Exception) as raised:
            envs.call("no_such_method")
        assert "global sub-env" in "".join(getattr(raised.value, "__notes__", []))
        # still usable
        envs.step(np.zeros(n, dtype=np.int64))
    finally:
        envs.close()
        sync.close()
    assert envs.closed


def cartpole():
    return gym.make("CartPole-v1")


def test_fork_exact_replay_on_remote_shard(cluster, tmp_path):
    log = tmp_path / "lineage.jsonl"
    envs = RayForkVectorEnv([cartpole] * 6, lineage_log=log)
    try:
        head = cluster.head_node_id
        remote = [i for i, node in enumerate(envs.node_ids) if node != head]
        assert remote, "some sub-envs must live off the head node"
        source = remote[-1]
        node = envs.node_ids[source]
        envs.reset(seed=7)
        rng = np.random.default_rng(1)
        for _ in range(5):
            envs.step(rng.integers(0, 2, 6))
        branch = envs.fork("probe", indices=[source], copies=3)
        assert branch.num_envs == 3
        assert [p["node_id"] for p in branch.placement] == [node]
        assert branch.exact.all()
        envs.step(np.zeros(6, dtype=np.int64))  # the source moves on
        # Replay: the branch repeats what the source did after the fork point.
        twin = envs.fork("twin", indices=[source], copies=1)
        want, got = [], []
        actions = rng.integers(0, 2, 30)
        for a in actions:
            full = np.zeros(6, dtype=np.int64)
            full[source] = a
            o, r, te, tr, _ = envs.step(full)
            want.append((o[source].copy(), r[source], te[source], tr[source]))
            o, r, te, tr, _ = twin.step(np.array([a]))
            got.append((o[0].copy(), r[0], te[0], tr[0]))
        for w, g in zip(want, got, strict=True):
            assert np.array_equal(w[0], g[0]) and w[1:] == g[1:]
        # The three copies of the first branch stay identical to each other.
        for a in actions[:10]:
            o = branch.step(np.full(3, a))[0]
            assert np.array_equal(o[0], o[1]) and np.array_equal(o[1], o[2])
        # Reseeded copies diverge only through their RNG; nested forks work.
        nested = branch.fork("nested", indices=[2], copies=2)
        assert [p["node_id"] for p in nested.placement] == [node]
        assert nested.lineage.ancestors() == ["probe", envs.lineage.branch_id]
        envs.close()  # branches outlive their source
        nested.step(np.array([0, 1]))
        nested.close()
        twin.close()
        branch.close()
    finally:
        for e in (envs,):
            e.close()
    events = read_log(log)
    placed = {e["branch_id"]: e for e in events if e["event"] == "ray_placement" and "shards" in e}
    assert placed["probe"]["shards"][0]["node_id"] == node
    assert placed["nested"]["shards"][0]["node_id"] == node
    # Node-local trees stamp their node too.
    local = [e for e in events if e["event"] == "ray_placement" and "node_id" in e]
    assert any(e["ray_branch_id"] == "probe" and e["node_id"] == node for e in local)
    out = subprocess.run(
        [sys.executable, "-m", "gym_fork", "lineage", str(log)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "probe from [" in out and "nested from [2] x2" in out and "[closed]" in out


def test_spread_fork_places_fresh_copies_on_other_nodes(cluster):
    envs = RayForkVectorEnv([cartpole] * 3)
    try:
        envs.reset(seed=21)
        envs.step(np.array([1, 0, 1]))
        branch = envs.fork("wide", indices=[1], copies=3, spread=True)
        try:
            assert len({p["node_id"] for p in branch.placement}) == 3
            assert branch.exact.tolist() == [True, False, False]
            assert branch.node_ids[0] == envs.node_ids[1]
            # Fresh copies: a new episode from the source's reset seed (21 + 1).
            reference = gym.make("CartPole-v1")
            reference.reset(seed=22)
            obs = branch.step(np.array([0, 1, 1]))[0]
            want = reference.step(1)[0]
            assert np.array_equal(obs[1], want) and np.array_equal(obs[2], want)
            reference.close()
        finally:
            branch.close()
    finally:
        envs.close()


def test_tree_search_example_matches_local_beam_search(cluster):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import beam_search
        import ray_tree_search
    finally:
        sys.path.pop(0)
    best, nodes = ray_tree_search.ray_beam_search(beam_search.CStateWalk, 3, 4, 3)
    assert len(nodes) == 3, "the first expansion is spread over the three nodes"
    local = beam_search.beam_search(beam_search.CStateWalk, 3, 4, 3)
    assert [(n.actions, n.ret) for n in best] == [(n.actions, n.ret) for n in local]
    for node in best:
        want = beam_search.replay_return(beam_search.CStateWalk, 3, node.actions)
        assert node.ret == pytest.approx(want)


def test_from_parent_shards_and_spread_use_the_recipe(cluster):
    envs = RayForkVectorEnv.from_parent(cartpole, 3, seed=0)
    sync = SyncVectorEnv([cartpole] * 3)
    try:
        assert len(set(envs.node_ids)) == 3
        obs, _ = envs.reset(seed=5)
        assert np.array_equal(obs, sync.reset(seed=5)[0])
        wide = envs.fork("recipe", indices=[0], copies=3, spread=True)
        try:
            # Right after reset(seed), exact and fresh copies hold the same state.
            got = wide.step(np.ones(3, dtype=np.int64))[0]
            assert np.array_equal(got[0], got[1]) and np.array_equal(got[1], got[2])
            assert np.array_equal(got[0], sync.step(np.ones(3, dtype=np.int64))[0][0])
        finally:
            wide.close()
    finally:
        envs.close()
        sync.close()


def test_actor_killed_then_rebuilt_at_reset(cluster):
    envs = RayForkVectorEnv([cartpole] * 6)
    sync = SyncVectorEnv([cartpole] * 6)
    try:
        envs.reset(seed=2)
        victim = 1
        lost_indices = envs.placement[victim]["indices"]
        lost_node = envs.placement[victim]["node_id"]
        ray.kill(envs.actors[victim], no_restart=True)
        started = time.monotonic()
        with pytest.raises(ShardLost) as raised:
            for _ in range(100):
                envs.step(np.zeros(6, dtype=np.int64))
        assert time.monotonic() - started < 30
        assert isinstance(raised.value, SubEnvCrashed)
        assert raised.value.indices == lost_indices
        assert raised.value.node_id == lost_node
        with pytest.raises(ShardLost):
            envs.step(np.zeros(6, dtype=np.int64))
        obs, _ = envs.reset(seed=4)
        want, _ = sync.reset(seed=4)
        assert np.array_equal(obs, want)
        assert envs.placement[victim]["node_id"] == lost_node  # node still alive
        for a in np.random.default_rng(0).integers(0, 2, (10, 6)):
            assert np.array_equal(envs.step(a)[0], sync.step(a)[0])
    finally:
        envs.close()
        sync.close()


def test_node_lost_then_rebuilt_elsewhere(cluster):
    """Runs last: it removes a node from the module's cluster."""
    envs = RayForkVectorEnv([cartpole] * 6)
    sync = SyncVectorEnv([cartpole] * 6)
    try:
        envs.reset(seed=9)
        by_node = {p["node_id"]: p["indices"] for p in envs.placement}
        node = next(n for n in cluster.worker_nodes() if n.node_id in by_node)
        branch = envs.fork("on-doomed-node", indices=by_node[node.node_id][:1], copies=2)
        cluster.remove_node(node)
        started = time.monotonic()
        with pytest.raises(ShardLost) as raised:
            for _ in range(1000):
                envs.step(np.zeros(6, dtype=np.int64))
        detected = time.monotonic() - started
        assert detected < 30, detected
        assert raised.value.node_id == node.node_id
        assert raised.value.indices == by_node[node.node_id]
        with pytest.raises(ShardLost):
            branch.step(np.zeros(2, dtype=np.int64))
        obs, _ = envs.reset(seed=5)
        assert node.node_id not in envs.node_ids
        assert len(set(envs.node_ids)) == 2
        want, _ = sync.reset(seed=5)
        assert np.array_equal(obs, want)
        for a in np.random.default_rng(3).integers(0, 2, (10, 6)):
            assert np.array_equal(envs.step(a)[0], sync.step(a)[0])
        obs, _ = branch.reset(seed=[5, 6])  # the branch's sub-envs come back fresh
        assert node.node_id not in branch.node_ids
        branch.close()
    finally:
        envs.close()
        sync.close()
