"""The shards of one Ray vector env (a root or a branch): building them on their actors,
one request per actor and its replies, a lost actor turned into ShardLost and rebuilt,
closing. The Gymnasium API over them is :mod:`gym_fork.ray.vector_env`."""

from __future__ import annotations

import itertools
import multiprocessing
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gym_fork.errors import SubEnvCrashed
from gym_fork.lineage.tree import LineageTree
from gym_fork.ray import batch as B
from gym_fork.ray.errors import ShardLost
from gym_fork.ray.pool import ActorEntry, ActorPool, actor_error, alive_nodes
from gym_fork.vector.config import VectorConfig


@dataclass(eq=False)
class Shard:
    """One handle of a vector env: the sub-envs at ``sel`` live in ``entry``'s actor."""

    entry: ActorEntry
    handle: str
    sel: B.Selector
    pos: np.ndarray
    local_branch_id: str | None = None
    lost: bool = False


@dataclass
class Family:
    """What a root and its branches share: actors, recipes, config, lineage tree."""

    pool: ActorPool
    config: VectorConfig
    from_parent: dict[str, Any] | None
    kwargs: dict[str, Any]  # the node-local ForkVectorEnvs' arguments
    tree: LineageTree | None = None
    counter: Any = field(default_factory=itertools.count)

    def new_handle(self, branch_id: str) -> tuple[str, str]:
        """(handle id unique among the family's actors, node-local branch id)."""
        n = next(self.counter)
        return f"{branch_id}#{n}", f"{branch_id}@{n}"

    def create_args(self, origins: list[int]) -> tuple[list | None, dict | None]:
        """(env_fns, from_parent arguments) that build sub-envs of these origins."""
        if self.from_parent is not None:
            return None, {**self.from_parent, "num_envs": len(origins)}
        return [self.config.env_fns[o] for o in origins], None


def _first(shard: Shard) -> int:
    """A shard's first sub-env (shards are kept in this order)."""
    return int(shard.pos.min())


def selector(pos: np.ndarray) -> B.Selector:
    """A slice for contiguous positions (cheaper to index with), else the positions."""
    if len(pos) and np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos))):
        return slice(int(pos[0]), int(pos[0]) + len(pos))
    return pos


class ShardSet:
    """The shards of one vector env, in order of their first sub-env."""

    def __init__(self, family: Family, branch_id: str, origins: list[int]) -> None:
        self.family = family
        self.branch_id = branch_id
        self.origins = origins  # per sub-env: the env_fn it is built from
        self.shards: list[Shard] = []
        self.pending: list[tuple[ActorEntry, list[Shard], Any]] = []

    def create(self, plan: list[tuple[ActorEntry, np.ndarray]]) -> list[dict[str, Any]]:
        """Build one node-local ForkVectorEnv per (actor, global positions)."""
        family = self.family
        refs, shards = [], []
        for k, (entry, pos) in enumerate(plan):
            handle, local_id = family.new_handle(self.branch_id)
            env_fns, from_parent = family.create_args([self.origins[i] for i in pos])
            kwargs = {**family.kwargs, "branch_id": local_id}
            info = {"ray_branch_id": self.branch_id, "shard": k, "indices": pos.tolist()}
            refs.append(entry.actor.create.remote(handle, env_fns, kwargs, info, from_parent))
            shards.append(Shard(entry, handle, selector(pos), pos))
        return self.adopt(refs, shards, "building shards")

    def adopt(self, refs: list[Any], shards: list[Shard], what: str) -> list[Any]:
        """ray.get every ref and adopt the shards; a dead actor becomes ShardLost (after
        closing what the other refs built)."""
        import ray

        out, lost = [], []
        for ref, shard in zip(refs, shards, strict=True):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                lost.append(shard)
                out.append(None)
            except ray.exceptions.RayTaskError as err:
                self.close([s for s, o in zip(shards, out, strict=False) if o])
                raise actor_error(err) from None
        if lost:
            self.close([s for s, o in zip(shards, out, strict=True) if o])
            for s in lost:
                self.family.pool.lost(s.entry)
            raise self.lost(lost, what)
        for shard, desc in zip(shards, out, strict=True):
            shard.local_branch_id = desc["local_branch_id"]
            shard.entry.handles.add(shard.handle)
        self.shards = sorted(self.shards + shards, key=_first)
        order = sorted(range(len(shards)), key=lambda k: _first(shards[k]))
        return [out[k] for k in order]

    def record_placement(self, why: str, **extra: Any) -> None:
        self.family.tree.event(
            self.branch_id, "ray_placement", why=why, shards=self.placement, **extra
        )

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Per shard: Ray node id, actor pid, global sub-env indices, node-local branch id."""
        return [
            {
                "node_id": s.entry.node_id,
                "pid": s.entry.pid,
                "indices": s.pos.tolist(),
                "local_branch_id": s.local_branch_id,
                "lost": s.lost,
            }
            for s in self.shards
        ]

    def lost(self, shards: list[Shard], what: str) -> ShardLost:
        lost = []
        for shard in shards:
            shard.lost = True
            lost.append((shard.entry.node_id, shard.pos.tolist()))
        indices = sorted(i for _node, idx in lost for i in idx)
        nodes = ", ".join(sorted({node for node, _ in lost}))
        tree = self.family.tree
        if tree is not None and self.branch_id in tree.branches:
            tree.event(self.branch_id, "shard_lost", lost=lost, during=what)
        return ShardLost(
            f"shard actor(s) lost while {what}: sub-envs {indices} on node(s) {nodes}; "
            "reset() rebuilds them",
            indices=indices,
            node_id=lost[0][0],
            lost=lost,
            pid=shards[0].entry.pid,
        )

    def check(self, what: str) -> None:
        dead = [s for s in self.shards if s.lost or not s.entry.alive]
        if dead:
            raise self.lost(dead, what)

    def rebuild_lost(self) -> None:
        """Replace lost shards: same node when alive, else the least loaded alive node."""
        dead = [s for s in self.shards if s.lost or not s.entry.alive]
        if not dead:
            return
        alive = [n["NodeID"] for n in alive_nodes()]
        if not alive:
            raise RuntimeError("no alive Ray node to rebuild lost shards on")
        pool = self.family.pool
        plan = []
        for shard in dead:
            self.shards.remove(shard)
            shard.entry.handles.discard(shard.handle)
            if shard.entry.alive:
                pool.lost(shard.entry)
            node = shard.entry.node_id
            if node not in alive:
                load = {n: 0 for n in alive}
                for s in self.shards:
                    if s.entry.node_id in load:
                        load[s.entry.node_id] += len(s.pos)
                node = min(alive, key=lambda n: load[n])
            plan.append((pool.for_node(node), shard.pos))
        self.create(plan)
        self.record_placement("rebuild")

    def send(self, op: str, items: dict[int, tuple[tuple, dict[str, Any]]]) -> None:
        """One ``run`` request per actor for the shards in ``items`` (shard no -> args)."""
        by_actor: dict[int, tuple[ActorEntry, list[Shard], list[tuple]]] = {}
        for k, (args, kwargs) in items.items():
            shard = self.shards[k]
            group = by_actor.setdefault(id(shard.entry), (shard.entry, [], []))
            group[1].append(shard)
            group[2].append((shard.handle, args, kwargs))
        self.pending = [
            (entry, shards, entry.actor.run.remote(op, calls))
            for entry, shards, calls in by_actor.values()
        ]

    def receive(self, timeout: float | None, call: str, what: str) -> list[tuple[Shard, Any]]:
        """(shard, result) of every shard of the pending request (``call``: the API
        method, ``what``: what the shards were doing); raises the first error (sub-env
        indices made global) or ShardLost for dead actors."""
        import ray

        pending, self.pending = self.pending, []
        refs = [ref for _e, _s, ref in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            raise multiprocessing.TimeoutError(
                f"The call to `{call}` has timed out after {timeout} second(s); late "
                "results are discarded."
            )
        results: list[tuple[Shard, Any]] = []
        lost: list[Shard] = []
        error: BaseException | None = None
        for entry, shards, ref in pending:
            try:
                replies = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.family.pool.lost(entry)
                lost.extend(shards)
                continue
            except ray.exceptions.RayTaskError as err:
                error = error or actor_error(err)
                continue
            for shard, (ok, value) in zip(shards, replies, strict=True):
                if ok:
                    results.append((shard, value))
                elif error is None:
                    error = self.globalize(shard, value)
        if lost:
            raise self.lost(lost, what)
        if error is not None:
            raise error
        return results

    def globalize(self, shard: Shard, exc: BaseException) -> BaseException:
        """Name global sub-env indices in an error from a node-local vector env."""
        if isinstance(exc, SubEnvCrashed):
            exc.indices = [int(shard.pos[i]) for i in exc.indices]
        exc.add_note(
            f"(on Ray node {shard.entry.node_id}, shard actor pid {shard.entry.pid}: local "
            f"sub-env j of that shard is global sub-env {shard.pos.tolist()}[j])"
        )
        return exc

    def close(self, shards: list[Shard], timeout=None, terminate=False) -> None:
        import ray

        by_actor: dict[int, tuple[ActorEntry, list[Shard]]] = {}
        for shard in shards:
            by_actor.setdefault(id(shard.entry), (shard.entry, []))[1].append(shard)
        refs = []
        for entry, group in by_actor.values():
            if not entry.alive:
                for shard in group:
                    entry.handles.discard(shard.handle)
                continue
            handles = [s.handle for s in group]
            refs.append((entry, group, entry.actor.close.remote(handles, timeout, terminate)))
        for entry, group, ref in refs:
            try:
                # bounded even without a timeout: a hung shard must not hang close()
                ray.get(ref, timeout=60 if timeout is None else timeout + 5)
            except Exception:
                self.family.pool.lost(entry)  # a shard that cannot close is ended
            for shard in group:
                self.family.pool.release(entry, shard.handle)
