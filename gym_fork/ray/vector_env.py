"""RayForkVectorEnv: sub-envs sharded over Ray actors, each owning a node-local
ForkVectorEnv; the Gymnasium vector API and ``fork()`` unchanged."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import multiprocessing
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from gym_fork.errors import BadActionError, SubEnvCrashed
from gym_fork.lineage import (
    Lineage,
    LineageLog,
    LineageTree,
    baseline_id,
    baseline_inputs,
    default_log_path,
)
from gym_fork.lineage.tree import BranchRecord
from gym_fork.ray import batch as B
from gym_fork.ray.actor import remote_class
from gym_fork.ray.errors import ShardLost


@dataclass(eq=False)
class ActorEntry:
    """One shard actor: where it runs and the handles (vector envs) it holds."""

    actor: Any
    node_id: str
    pid: int
    handles: set[str] = field(default_factory=set)
    alive: bool = True


class ActorPool:
    """The actors of one lineage tree (a root and all its branches share them)."""

    def __init__(self, actor_options: dict[str, Any]) -> None:
        self.actor_options = actor_options
        self.entries: list[ActorEntry] = []
        self.lock = threading.Lock()

    def spawn(self, node_ids: list[str]) -> list[ActorEntry]:
        """Start one actor on each of ``node_ids`` (hard node affinity), in parallel."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = {"num_cpus": 0, **self.actor_options}
        actors = [
            remote_class()
            .options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                **options,
            )
            .remote()
            for node_id in node_ids
        ]
        where = ray.get([a.where.remote() for a in actors])
        entries = [ActorEntry(a, node, pid) for a, (node, pid) in zip(actors, where, strict=True)]
        with self.lock:
            self.entries.extend(entries)
        return entries

    def for_node(self, node_id: str) -> ActorEntry:
        """A live actor on ``node_id`` (the least loaded), started if there is none."""
        with self.lock:
            live = [e for e in self.entries if e.alive and e.node_id == node_id]
        if live:
            return min(live, key=lambda e: len(e.handles))
        return self.spawn([node_id])[0]

    def lost(self, entry: ActorEntry) -> None:
        """Forget a dead actor (and make sure it is dead: no half-alive shard)."""
        import ray

        entry.alive = False
        with self.lock:
            if entry in self.entries:
                self.entries.remove(entry)
        with contextlib.suppress(Exception):
            ray.kill(entry.actor, no_restart=True)

    def release(self, entry: ActorEntry, handle: str) -> None:
        """A handle closed; an actor left with none is ended."""
        entry.handles.discard(handle)
        if not entry.handles and entry.alive:
            self.lost(entry)


@dataclass
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
    """What a root and its branches share: actors, recipes, lineage tree, options."""

    pool: ActorPool
    env_fns: list[Callable[[], Any]]
    parent: dict[str, Any] | None
    kwargs: dict[str, Any]
    tree: LineageTree
    counter: Any = field(default_factory=itertools.count)

    def new_handle(self, branch_id: str) -> str:
        """A handle id unique among the family's actors."""
        return f"{branch_id}#{next(self.counter)}"

    def create_args(self, origins: list[int]) -> tuple[list | None, dict | None]:
        """(env_fns, from_parent arguments) that build sub-envs of these origins."""
        if self.parent is not None:
            return None, {**self.parent, "num_envs": len(origins)}
        return [self.env_fns[o] for o in origins], None


def _selector(pos: np.ndarray) -> B.Selector:
    if len(pos) and np.array_equal(pos, np.arange(pos[0], pos[0] + len(pos))):
        return slice(int(pos[0]), int(pos[0]) + len(pos))
    return pos


def _alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


class RayForkVectorEnv(VectorEnv):
    """A Gymnasium vector env whose sub-envs are sharded over Ray actors.

    Each shard actor runs on one node (hard node affinity) and owns a node-local
    :class:`gym_fork.ForkVectorEnv` of its sub-envs; ``step`` sends one request per actor
    and gets one batch back; ``fork`` runs on the actor that holds the source sub-envs,
    so its copy-on-write clones stay on that node.

    Args:
        env_fns: one callable per sub-env, as for ForkVectorEnv (pickled to the actors).
        num_shards: number of shard actors; ``None`` is one per alive node with CPUs
            (or ``cores_per_shard``), an int spreads that many round-robin over the nodes.
        cores_per_shard: with ``num_shards=None``, one shard per this many CPUs of each
            node (at least one per node).
        nodes: Ray node ids to place shards on (default: every alive node with CPUs).
        address: Ray address to connect to when this process is not connected yet
            (``None``: what ``ray.init()`` does: ``RAY_ADDRESS``, else a new local Ray).
        init_kwargs: more ``ray.init`` arguments for that case.
        actor_options: ``.options()`` of the shard actors (default ``num_cpus=0``: the
            placement is explicit and the sandboxes are outside Ray's CPU accounting).
        branch_id: id of this root in the lineage tree.
        lineage_log: as ForkVectorEnv; the path is resolved here and handed to every
            actor, so on one machine all nodes append to the same file.
        **kwargs: every other ForkVectorEnv argument, given to each node-local one.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Any]],
        *,
        num_shards: int | None = None,
        cores_per_shard: int | None = None,
        nodes: Sequence[str] | None = None,
        address: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
        actor_options: dict[str, Any] | None = None,
        branch_id: str | None = None,
        lineage_log: Any = True,
        _parent: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        env_fns = list(env_fns)
        if not env_fns:
            raise ValueError("RayForkVectorEnv needs at least one env_fn")
        if "copy" in kwargs:
            kwargs.pop("copy")  # results are always fresh arrays here
        self.num_envs = len(env_fns)
        self.closed = False
        self._state = "default"
        self._pending: list[tuple[ActorEntry, list[Shard], Any]] = []
        self._shards: list[Shard] = []
        log_path = (
            default_log_path()
            if lineage_log is True or lineage_log is None
            else (lineage_log or None)
        )
        kwargs["lineage_log"] = str(log_path) if log_path else False
        placement = self._plan(num_shards, cores_per_shard, nodes)
        pool = ActorPool(dict(actor_options or {}))
        branch_id = branch_id or LineageTree.new_root_id()
        tree = LineageTree(LineageLog(log_path), "", {})
        family = Family(pool, env_fns, _parent, kwargs, tree)
        self._family = family
        self.branch_id = branch_id
        self._origins = list(range(self.num_envs)) if _parent is None else [0] * self.num_envs
        self._episode_seeds: list[int | None] = [None] * self.num_envs
        self.exact = np.ones(self.num_envs, dtype=np.bool_)
        started = time.perf_counter()
        entries = pool.spawn([node for node, _ in placement])
        try:
            descriptions = self._create_shards(
                [(e, np.asarray(idx)) for e, (_node, idx) in zip(entries, placement, strict=True)]
            )
        except BaseException:
            for entry in entries:
                pool.lost(entry)
            raise
        self._setup_spaces(descriptions[0])
        inputs = baseline_inputs(
            env_identity=_identity(env_fns if _parent is None else _parent),
            env_ids=[getattr(d["spec"], "id", None) for d in descriptions[:1]],
            config={"shards": [len(s.pos) for s in self._shards], **_jsonable(kwargs)},
            seed=(_parent or {}).get("seed"),
            host="ray",
            isolation=descriptions[0]["isolation"],
        )
        tree.baseline_id = baseline_id(inputs)
        tree.inputs = inputs
        tree.add(
            BranchRecord(
                branch_id,
                None,
                tree.baseline_id,
                self.num_envs,
                timings={"build_s": time.perf_counter() - started},
                isolation=descriptions[0]["isolation"],
            )
        )
        self._lineage = Lineage(tree, branch_id)
        self._record_placement("create")

    @classmethod
    def from_parent(
        cls,
        env_fn: Callable[[], Any],
        num_envs: int,
        *,
        warmup: Callable[[Any], Any] | None = None,
        ready_check: Callable[[Any], Any] | None = None,
        seed: int | None = None,
        reset_mode: str = "clone",
        **kwargs: Any,
    ) -> RayForkVectorEnv:
        """As ``ForkVectorEnv.from_parent``: each shard builds and warms one env on its
        node and clones it for each of its sub-envs."""
        parent = {"env_fn": env_fn, "warmup": warmup, "ready_check": ready_check, "seed": seed}
        return cls([env_fn] * num_envs, reset_mode=reset_mode, _parent=parent, **kwargs)

    # -- placement ------------------------------------------------------------------
    def _plan(
        self, num_shards: int | None, cores_per_shard: int | None, nodes: Sequence[str] | None
    ) -> list[tuple[str, list[int]]]:
        """(node id, global sub-env indices) of each shard."""
        alive = _alive_nodes()
        if nodes is not None:
            wanted = list(nodes)
            alive = [n for n in alive if n["NodeID"] in wanted]
            alive.sort(key=lambda n: wanted.index(n["NodeID"]))
        if not alive:
            raise RuntimeError("no alive Ray node with CPUs to place shards on")
        if num_shards is None:
            slots = []
            for node in alive:
                cpus = int(node["Resources"].get("CPU", 1))
                count = max(1, cpus // cores_per_shard) if cores_per_shard else 1
                slots.extend([node["NodeID"]] * count)
        else:
            if num_shards < 1:
                raise ValueError(f"num_shards must be >= 1, got {num_shards}")
            slots = [alive[k % len(alive)]["NodeID"] for k in range(num_shards)]
        slots = slots[: self.num_envs]
        blocks = np.array_split(np.arange(self.num_envs), len(slots))
        return [(node, [int(i) for i in block]) for node, block in zip(slots, blocks, strict=True)]

    def _create_shards(self, plan: list[tuple[ActorEntry, np.ndarray]]) -> list[dict[str, Any]]:
        """Build one node-local ForkVectorEnv per (actor, global positions)."""
        family = self._family
        refs, shards = [], []
        for k, (entry, pos) in enumerate(plan):
            handle = family.new_handle(self.branch_id)
            env_fns, parent = family.create_args([self._origins[i] for i in pos])
            kwargs = {**family.kwargs, "branch_id": f"{self.branch_id}@{handle.split('#')[1]}"}
            info = {"ray_branch_id": self.branch_id, "shard": k, "indices": pos.tolist()}
            refs.append(entry.actor.create.remote(handle, env_fns, kwargs, info, parent))
            shards.append(Shard(entry, handle, _selector(pos), pos))
        descriptions = self._get_all(refs, shards, "building shards")
        for shard, desc in zip(shards, descriptions, strict=True):
            shard.local_branch_id = desc["local_branch_id"]
            shard.entry.handles.add(shard.handle)
        self._shards.extend(shards)
        return descriptions

    def _get_all(self, refs: list[Any], shards: list[Shard], what: str) -> list[Any]:
        """ray.get every ref; a dead actor becomes ShardLost (after closing what the other
        refs built)."""
        import ray

        out, lost = [], []
        for ref, shard in zip(refs, shards, strict=True):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError:
                lost.append(shard)
                out.append(None)
            except ray.exceptions.RayTaskError as err:
                for s, o in zip(shards, out, strict=False):
                    if o is not None:
                        self._close_handles([s])
                raise _cause(err) from None
        if lost:
            for s, o in zip(shards, out, strict=True):
                if o is not None:
                    self._close_handles([s])
            for s in lost:
                self._family.pool.lost(s.entry)
            raise self._shard_lost(lost, what)
        return out

    def _setup_spaces(self, desc: dict[str, Any]) -> None:
        self.single_observation_space = desc["single_observation_space"]
        self.single_action_space = desc["single_action_space"]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = dict(desc["metadata"])
        mode = self.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        self.autoreset_mode = mode if isinstance(mode, AutoresetMode) else AutoresetMode(mode)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = desc["render_mode"]
        self.spec = desc["spec"]
        self._obs = B.assemble(
            self.single_observation_space,
            self.num_envs,
            [(slice(0, self.num_envs), self.observation_space.sample())],
        )

    def _record_placement(self, why: str, **extra: Any) -> None:
        self._family.tree.event(
            self.branch_id,
            "ray_placement",
            why=why,
            shards=self.placement,
            **extra,
        )

    # -- reports --------------------------------------------------------------------
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
            for s in self._shards
        ]

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handle of each shard (in ``placement`` order)."""
        return [s.entry.actor for s in self._shards]

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each sub-env."""
        out = [""] * self.num_envs
        for s in self._shards:
            for i in s.pos:
                out[int(i)] = s.entry.node_id
        return out

    @property
    def lineage(self) -> Lineage:
        """Provenance of this vector env (the Ray-level tree; ``ray_placement`` events
        carry the node id of every shard)."""
        return self._lineage

    # -- faults ---------------------------------------------------------------------
    def _shard_lost(self, shards: list[Shard], what: str) -> ShardLost:
        lost = []
        for shard in shards:
            shard.lost = True
            lost.append((shard.entry.node_id, shard.pos.tolist()))
        indices = sorted(i for _node, idx in lost for i in idx)
        nodes = ", ".join(sorted({node for node, _ in lost}))
        if self.branch_id in self._family.tree.branches:
            self._family.tree.event(self.branch_id, "shard_lost", lost=lost, during=what)
        return ShardLost(
            f"shard actor(s) lost while {what}: sub-envs {indices} on node(s) {nodes}; "
            "reset() rebuilds them",
            indices=indices,
            node_id=lost[0][0],
            lost=lost,
            pid=shards[0].entry.pid,
        )

    def _check_shards(self, what: str) -> None:
        dead = [s for s in self._shards if s.lost or not s.entry.alive]
        if dead:
            raise self._shard_lost(dead, what)

    def _rebuild_lost(self) -> None:
        """Replace lost shards: same node when alive, else the least loaded alive node."""
        dead = [s for s in self._shards if s.lost or not s.entry.alive]
        if not dead:
            return
        alive = [n["NodeID"] for n in _alive_nodes()]
        if not alive:
            raise RuntimeError("no alive Ray node to rebuild lost shards on")
        pool = self._family.pool
        plan = []
        for shard in dead:
            self._shards.remove(shard)
            shard.entry.handles.discard(shard.handle)
            if shard.entry.alive:
                pool.lost(shard.entry)
            node = shard.entry.node_id
            if node not in alive:
                load = {n: 0 for n in alive}
                for s in self._shards:
                    if s.entry.node_id in load:
                        load[s.entry.node_id] += len(s.pos)
                node = min(alive, key=lambda n: load[n])
            plan.append((pool.for_node(node), shard.pos))
        self._create_shards(plan)
        self._shards.sort(key=lambda s: int(s.pos.min()))
        self._record_placement("rebuild")

    # -- the batched request/response -------------------------------------------------
    def _send(self, op: str, items: dict[int, tuple[tuple, dict[str, Any]]]) -> None:
        """One ``run`` request per actor for the shards in ``items`` (shard no -> args)."""
        by_actor: dict[int, tuple[ActorEntry, list[Shard], list[tuple]]] = {}
        for k, (args, kwargs) in items.items():
            shard = self._shards[k]
            entry = shard.entry
            group = by_actor.setdefault(id(entry), (entry, [], []))
            group[1].append(shard)
            group[2].append((shard.handle, args, kwargs))
        self._pending = [
            (entry, shards, entry.actor.run.remote(op, calls))
            for entry, shards, calls in by_actor.values()
        ]

    def _receive(self, timeout: float | None, what: str) -> list[tuple[Shard, Any]]:
        """(shard, result) of every shard of the pending request; raises the first error
        (sub-env indices made global) or ShardLost for dead actors."""
        import ray

        pending, self._pending = self._pending, []
        refs = [ref for _e, _s, ref in pending]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if len(ready) < len(refs):
            raise multiprocessing.TimeoutError(
                f"the vector env did not answer {what} within {timeout} s; late results "
                "are discarded"
            )
        results: list[tuple[Shard, Any]] = []
        lost: list[Shard] = []
        error: BaseException | None = None
        for entry, shards, ref in pending:
            try:
                replies = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._family.pool.lost(entry)
                lost.extend(shards)
                continue
            except ray.exceptions.RayTaskError as err:
                error = error or _cause(err)
                continue
            for shard, (ok, value) in zip(shards, replies, strict=True):
                if ok:
                    results.append((shard, value))
                elif error is None:
                    error = self._globalize(shard, value)
        if lost:
            raise self._shard_lost(lost, what)
        if error is not None:
            raise error
        return results

    def _globalize(self, shard: Shard, exc: BaseException) -> BaseException:
        """Name global sub-env indices in an error from a node-local vector env."""
        if isinstance(exc, SubEnvCrashed):
            exc.indices = [int(shard.pos[i]) for i in exc.indices]
        exc.add_note(
            f"(on Ray node {shard.entry.node_id}, shard actor pid {shard.entry.pid}: local "
            f"sub-env j of that shard is global sub-env {shard.pos.tolist()}[j])"
        )
        return exc

    # -- the VectorEnv API ------------------------------------------------------------
    def _assert_running(self, call: str) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )
        if self._state != "default":
            raise AlreadyPendingCallError(
                f"Calling `{call}` while waiting for a pending call to `{self._state}` to "
                "complete.",
                self._state,
            )

    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all (or ``options['reset_mask']``) sub-envs; lost shards are rebuilt first."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> None:
        """Send the resets; collect them with :meth:`reset_wait`."""
        self._assert_running("reset_async")
        n = self.num_envs
        if seed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(seed, int | np.integer):
            seeds = [int(seed) + i for i in range(n)]
        else:
            seeds = list(seed)
            if len(seeds) != n:
                raise ValueError(
                    "If seeds are passed as a list the length must match "
                    f"num_envs={n} but got length={len(seeds)}."
                )
        mask = np.ones(n, dtype=np.bool_)
        options = dict(options) if options is not None else None
        if options is not None and "reset_mask" in options:
            mask = options.pop("reset_mask")
            if not isinstance(mask, np.ndarray) or mask.shape != (n,) or mask.dtype != np.bool_:
                raise ValueError(f"`options['reset_mask']` must be a bool array of shape ({n},)")
            if not mask.any():
                raise ValueError("`options['reset_mask']` must contain at least one True value")
        self._rebuild_lost()
        items = {}
        for k, shard in enumerate(self._shards):
            local_mask = mask[shard.pos]
            if not local_mask.any():
                continue
            local_options = dict(options) if options is not None else None
            if not local_mask.all():
                local_options = {**(local_options or {}), "reset_mask": local_mask}
            items[k] = ((), {"seed": [seeds[i] for i in shard.pos], "options": local_options})
        for i in np.flatnonzero(mask):
            self._episode_seeds[int(i)] = seeds[int(i)]
        self._send("reset", items)
        self._state = "reset"

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the resets sent by :meth:`reset_async`: (observations, infos)."""
        if self._state != "reset":
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.", "reset"
            )
        self._state = "default"
        results = self._receive(timeout, "resetting")
        parts = [(s.sel, obs) for s, (obs, _info) in results]
        done = {id(s) for s, _ in results}
        parts += [
            (s.sel, B.take(self.single_observation_space, self._obs, s.sel))
            for s in self._shards
            if id(s) not in done
        ]
        self._obs = B.assemble(self.single_observation_space, self.num_envs, parts)
        infos = B.merge_infos(self.num_envs, [(s.pos, info) for s, (_obs, info) in results])
        return self._copy_obs(), infos

    def _copy_obs(self) -> Any:
        return B.assemble(
            self.single_observation_space, self.num_envs, [(slice(0, self.num_envs), self._obs)]
        )

    def step(self, actions: Any):
        """Step every sub-env: batched (obs, rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send each shard actor its slice of the actions (one request per actor)."""
        self._assert_running("step_async")
        self._check_shards("stepping")
        try:
            items = {
                k: ((B.take(self.single_action_space, actions, s.sel),), {})
                for k, s in enumerate(self._shards)
            }
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise BadActionError(
                f"actions do not fit a batch of {self.num_envs} of {self.single_action_space}: "
                f"{exc}"
            ) from exc
        self._send("step", items)
        self._state = "step"

    def step_wait(self, timeout: float | None = None):
        """Gather every actor's batch and merge them (infos with their ``_key`` masks)."""
        if self._state != "step":
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.", "step"
            )
        self._state = "default"
        results = self._receive(timeout, "stepping")
        n = self.num_envs
        self._obs = B.assemble(
            self.single_observation_space, n, [(s.sel, r[0]) for s, r in results]
        )
        rewards = B.scalars(n, np.float64, [(s.sel, r[1]) for s, r in results])
        terminations = B.scalars(n, np.bool_, [(s.sel, r[2]) for s, r in results])
        truncations = B.scalars(n, np.bool_, [(s.sel, r[3]) for s, r in results])
        infos = B.merge_infos(n, [(s.pos, r[4]) for s, r in results])
        return self._copy_obs(), rewards, terminations, truncations, infos

    def call_async(self, name: str, /, *args: Any, **kwargs: Any) -> None:
        """Send ``env.<name>(*args, **kwargs)`` (or an attribute read) to every sub-env."""
        self._assert_running("call_async")
        self._check_shards("calling")
        self._send("call", {k: ((name, *args), kwargs) for k in range(len(self._shards))})
        self._state = "call"

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of :meth:`call_async`, in sub-env order."""
        if self._state != "call":
            raise NoAsyncCallError(
                "Calling `call_wait` without any prior call to `call_async`.", "call"
            )
        self._state = "default"
        return self._in_order(self._receive(timeout, "calling"))

    def _in_order(self, results: list[tuple[Shard, Any]]) -> tuple[Any, ...]:
        out: list[Any] = [None] * self.num_envs
        for shard, values in results:
            for i, value in zip(shard.pos, values, strict=True):
                out[int(i)] = value
        return tuple(out)

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``env.<name>(*args, **kwargs)`` on every sub-env, results in sub-env order."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def render(self) -> tuple[Any, ...] | None:
        """``env.render()`` of every sub-env."""
        return self.call("render")

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """The attribute ``name`` of every sub-env."""
        self._assert_running("get_attr")
        self._check_shards("getting an attribute")
        self._send("get_attr", {k: ((name,), {}) for k in range(len(self._shards))})
        return self._in_order(self._receive(None, "getting an attribute"))

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set ``name`` on every sub-env (one value each, or the same value for all)."""
        self._assert_running("set_attr")
        self._check_shards("setting an attribute")
        if not isinstance(values, list | tuple):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for {self.num_envs} environments."
            )
        self._send(
            "set_attr",
            {k: ((name, [values[i] for i in s.pos]), {}) for k, s in enumerate(self._shards)},
        )
        self._receive(None, "setting an attribute")

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """The ``np_random_seed`` of every sub-env."""
        return self.get_attr("np_random_seed")

    # -- fork -----------------------------------------------------------------------
    def fork(
        self,
        branch_id: str,
        indices: Sequence[int] | None = None,
        copies: int = 1,
        reseed: int | Sequence[int | None] | None = None,
        *,
        spread: bool = False,
    ) -> RayForkVectorEnv:
        """Branch running sub-envs, as ``ForkVectorEnv.fork``: each source's node forks it
        locally (exact continuation, copy-on-write on that node).

        ``spread=True`` deals each source's copies round-robin over the alive nodes,
        starting with its own: the copies on the source's node are exact forks, the
        others are *fresh* sub-envs built on their node and reset with the seed of the
        source's last ``reset`` (or their ``reseed``): a new episode from the same seed,
        not a continuation. ``branch.exact`` says which is which.
        """
        self._assert_running("fork")
        self._check_shards("forking")
        self._family.tree.check_free(branch_id)
        n = self.num_envs
        indices = list(range(n)) if indices is None else [int(i) for i in indices]
        if not indices or any(not 0 <= i < n for i in indices):
            raise ValueError(f"fork indices must be in [0, {n}), got {indices}")
        if not isinstance(copies, int) or copies < 1:
            raise ValueError(f"copies must be an int >= 1, got {copies!r}")
        sources = [i for i in indices for _ in range(copies)]
        m = len(sources)
        if reseed is None:
            seeds: list[int | None] = [None] * m
        elif isinstance(reseed, int | np.integer):
            seeds = [int(reseed) + j for j in range(m)]
        else:
            seeds = list(reseed)
            if len(seeds) != m:
                raise ValueError(
                    f"reseed needs one seed per branch sub-env ({m}), got {len(seeds)}"
                )
        owner = {int(i): s for s in self._shards for i in s.pos}
        local = {int(i): j for s in self._shards for j, i in enumerate(s.pos)}
        nodes = [nd["NodeID"] for nd in _alive_nodes()] if spread else []
        started = time.perf_counter()

        # exact: source shard -> (shard, local indices, copies of each, branch positions);
        # fresh: node -> [(branch position, source index)]
        exact: dict[int, tuple[Shard, list[int], int, list[int]]] = {}
        fresh: dict[str, list[tuple[int, int]]] = {}
        for t, i in enumerate(indices):
            shard = owner[i]
            ring = [shard.entry.node_id] + [x for x in nodes if x != shard.entry.node_id]
            here = len(range(0, copies, len(ring)))
            group = exact.setdefault(id(shard), (shard, [], here, []))
            group[1].append(local[i])
            for c in range(copies):
                node = ring[c % len(ring)]
                if node == shard.entry.node_id:
                    group[3].append(t * copies + c)
                else:
                    fresh.setdefault(node, []).append((t * copies + c, i))

        branch = RayForkVectorEnv.__new__(RayForkVectorEnv)
        branch._init_branch(self, branch_id, m)
        family = self._family
        refs, shards = [], []
        for shard, local_indices, per_index, pos in exact.values():
            handle = family.new_handle(branch_id)
            local_seeds = None if reseed is None else [seeds[p] for p in pos]
            info = {"ray_branch_id": branch_id, "source": self.branch_id, "exact": True}
            refs.append(
                shard.entry.actor.fork.remote(
                    shard.handle,
                    handle,
                    f"{branch_id}@{handle.split('#')[1]}",
                    local_indices,
                    per_index,
                    local_seeds,
                    {**info, "indices": pos},
                )
            )
            shards.append(Shard(shard.entry, handle, _selector(np.asarray(pos)), np.asarray(pos)))
        fresh_nodes = list(fresh)
        entries = {node: family.pool.for_node(node) for node in fresh_nodes}
        for node in fresh_nodes:
            pos = [p for p, _i in fresh[node]]
            srcs = [i for _p, i in fresh[node]]
            handle = family.new_handle(branch_id)
            env_fns, parent = family.create_args([self._origins[i] for i in srcs])
            reset_seeds = [
                seeds[p] if reseed is not None else self._episode_seeds[i] for p, i in fresh[node]
            ]
            kwargs = {**family.kwargs, "branch_id": f"{branch_id}@{handle.split('#')[1]}"}
            info = {"ray_branch_id": branch_id, "source": self.branch_id, "exact": False}
            refs.append(
                entries[node].actor.create.remote(
                    handle, env_fns, kwargs, {**info, "indices": pos}, parent, reset_seeds
                )
            )
            shards.append(Shard(entries[node], handle, _selector(np.asarray(pos)), np.asarray(pos)))
        descriptions = self._get_all(refs, shards, f"forking {branch_id!r}")
        parts = []
        for shard, desc in zip(shards, descriptions, strict=True):
            shard.local_branch_id = desc["local_branch_id"]
            shard.entry.handles.add(shard.handle)
            if "reset" in desc:
                parts.append((shard.sel, desc["reset"][0]))
                branch.exact[shard.pos] = False
            else:
                src = np.asarray(sources)[shard.pos]
                parts.append((shard.sel, B.take(self.single_observation_space, self._obs, src)))
        branch._shards = sorted(shards, key=lambda s: int(s.pos.min()))
        branch._obs = B.assemble(branch.single_observation_space, m, parts)
        branch._origins = [self._origins[i] for i in sources]
        branch._episode_seeds = [
            seeds[j] if reseed is not None and not branch.exact[j] else self._episode_seeds[i]
            for j, i in enumerate(sources)
        ]
        tree = family.tree
        tree.add(
            BranchRecord(
                branch_id,
                self.branch_id,
                tree.baseline_id,
                m,
                source_indices=indices,
                copies=copies,
                seeds=seeds,
                timings={"fork_s": time.perf_counter() - started},
            )
        )
        branch._lineage = Lineage(tree, branch_id)
        branch._record_placement("fork", spread=spread, exact=branch.exact.tolist())
        return branch

    def _init_branch(self, source: RayForkVectorEnv, branch_id: str, num_envs: int) -> None:
        self.num_envs = num_envs
        self.closed = False
        self._state = "default"
        self._pending = []
        self._shards = []
        self._family = source._family
        self.branch_id = branch_id
        self.exact = np.ones(num_envs, dtype=np.bool_)
        self.single_observation_space = source.single_observation_space
        self.single_action_space = source.single_action_space
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self.metadata = dict(source.metadata)
        self.autoreset_mode = source.autoreset_mode
        self.render_mode = source.render_mode
        self.spec = source.spec

    # -- close ----------------------------------------------------------------------
    def _close_handles(self, shards: list[Shard], timeout=None, terminate=False) -> None:
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
                self._family.pool.lost(entry)  # a shard that cannot close is ended
            for shard in group:
                self._family.pool.release(entry, shard.handle)

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close this vector env's node-local envs; an actor left with none is ended.
        Branches and the source close independently."""
        import ray

        if not ray.is_initialized():
            return
        self._pending = []
        self._state = "default"
        self._close_handles(self._shards, timeout, terminate)
        lineage = getattr(self, "_lineage", None)
        if lineage is not None:
            self._family.tree.close(self.branch_id, "terminated" if terminate else "closed")

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and hasattr(self, "_family"):
            with contextlib.suppress(Exception):
                self.close(terminate=True)

    def __repr__(self) -> str:
        nodes = len({s.entry.node_id for s in getattr(self, "_shards", [])})
        return (
            f"RayForkVectorEnv(num_envs={self.num_envs}, shards={len(self._shards)}, "
            f"nodes={nodes}, branch_id={self.branch_id!r})"
        )


def _cause(err: Any) -> BaseException:
    """The exception an actor method raised, with the actor-side traceback as a note."""
    cause = getattr(err, "cause", None)
    if not isinstance(cause, BaseException):
        return err
    remote = getattr(err, "traceback_str", None)
    if remote:
        cause.add_note(f"raised in a shard actor:\n{remote}")
    return cause


def _identity(obj: Any) -> str:
    try:
        return hashlib.sha256(cloudpickle.dumps(obj)).hexdigest()[:16]
    except Exception:
        return repr(obj)


def _jsonable(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, str | int | float | bool | None) else repr(v)
        for k, v in kwargs.items()
    }
