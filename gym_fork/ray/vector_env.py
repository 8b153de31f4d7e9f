"""RayForkVectorEnv: sub-envs sharded over Ray actors, each owning a node-local
ForkVectorEnv; the Gymnasium vector API and ``fork()`` unchanged.

The state machine, the argument checks and the root's lineage record are the local
env's (:mod:`gym_fork.vector.frontend`, :mod:`gym_fork.vector.provenance`): the same
misuse raises the same error on both.

(Over ~450 lines as one job: each method of the Gymnasium vector API and ``fork()`` once,
fanned out to the shards and gathered back; shards, placement and batching are their own
modules.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium.vector import VectorEnv
from gymnasium.vector.utils import batch_space

from gym_fork.errors import BadActionError
from gym_fork.hosts.base import PrepareRecipe
from gym_fork.lineage import Lineage, default_log_path
from gym_fork.lineage.tree import BranchRecord, LineageTree
from gym_fork.ray import batch as B
from gym_fork.ray.placement import fork_layout, shard_layout
from gym_fork.ray.pool import ActorPool, alive_nodes
from gym_fork.ray.shards import Family, Shard, ShardSet, selector
from gym_fork.vector import provenance
from gym_fork.vector.config import VectorConfig, check_env_fns, check_parent_count
from gym_fork.vector.frontend import AsyncFrontEnd, AsyncState


class RayForkVectorEnv(AsyncFrontEnd, VectorEnv):
    """A Gymnasium vector env whose sub-envs are sharded over Ray actors.

    Each shard actor runs on one node (hard node affinity) and owns a node-local
    :class:`gym_fork.ForkVectorEnv` of its sub-envs; ``step`` sends one request per actor
    and gets one batch back; ``fork`` runs on the actor that holds the source sub-envs,
    so its copy-on-write clones stay on that node. The options are checked here, before
    any actor starts (``writable_paths`` on each node).

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
        **kwargs: every other ForkVectorEnv argument, given to each node-local one
            (``copy`` is ignored: results are always fresh arrays).
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
        _from_parent: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_env_fns(env_fns)
        kwargs.pop("copy", None)
        prepare = None if _from_parent is None else _preparation(_from_parent)
        # writable_paths name directories of the nodes, checked by each node-local env.
        checked = {k: v for k, v in kwargs.items() if k != "writable_paths"}
        config = VectorConfig.from_arguments(list(env_fns), prepare=prepare, **checked)
        import ray

        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        log_path = default_log_path() if lineage_log is True else (lineage_log or None)
        kwargs["lineage_log"] = str(log_path) if log_path else False
        family = Family(ActorPool(dict(actor_options or {})), config, _from_parent, kwargs)
        branch_id = branch_id or LineageTree.new_root_id()
        self._setup(family, branch_id, config.num_envs, list(config.origins))
        placement = shard_layout(alive_nodes(), self.num_envs, num_shards, cores_per_shard, nodes)
        started = time.perf_counter()
        entries = family.pool.spawn([node for node, _ in placement])
        try:
            descriptions = self._set.create(
                [(e, np.asarray(idx)) for e, (_node, idx) in zip(entries, placement, strict=True)]
            )
        except BaseException:
            for entry in entries:
                family.pool.lost(entry)
            raise
        first = descriptions[0]
        self._adopt_spaces(
            first["single_observation_space"],
            first["single_action_space"],
            dict(first["metadata"]),
            first["render_mode"],
            first["spec"],
        )
        self._obs = self._empty_batch()
        spec_ids = [getattr(d["spec"], "id", None) for d in descriptions]
        self._lineage = provenance.start_root_lineage(
            config,
            branch_id=branch_id,
            lineage_log=log_path,
            env_ids=[spec_ids[k] for k, s in enumerate(self._set.shards) for _ in s.pos],
            isolation=first["isolation"],
            timings={"build_s": time.perf_counter() - started},
            workers=[],
        )
        family.tree = self._lineage.tree
        self._set.record_placement("create")

    def _setup(self, family: Family, branch_id: str, num_envs: int, origins: list[int]) -> None:
        """The one constructor of roots and branches: the state before any shard."""
        self.num_envs = num_envs
        self.closed = False
        self._state = AsyncState.DEFAULT
        self._set = ShardSet(family, branch_id, origins)
        self._lineage: Lineage | None = None
        self.branch_id = branch_id
        self._episode_seeds: list[int | None] = [None] * num_envs
        self.exact = np.ones(num_envs, dtype=np.bool_)
        self.autoreset_mode = family.config.autoreset_mode

    def _adopt_spaces(self, observation, action, metadata, render_mode, spec) -> None:
        self.single_observation_space = observation
        self.single_action_space = action
        self.observation_space = batch_space(observation, self.num_envs)
        self.action_space = batch_space(action, self.num_envs)
        self.metadata = dict(metadata, autoreset_mode=self.autoreset_mode)
        self.render_mode = render_mode
        self.spec = spec

    def _empty_batch(self) -> Any:
        n = self.num_envs
        return B.assemble(
            self.single_observation_space, n, [(slice(0, n), self.observation_space.sample())]
        )

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
        num_envs = check_parent_count(num_envs, kwargs)
        args = {"env_fn": env_fn, "warmup": warmup, "ready_check": ready_check, "seed": seed}
        return cls([env_fn] * num_envs, reset_mode=reset_mode, _from_parent=args, **kwargs)

    # -- placement ------------------------------------------------------------------
    # -- reports --------------------------------------------------------------------
    @property
    def placement(self) -> list[dict[str, Any]]:
        """Per shard: Ray node id, actor pid, global sub-env indices, node-local branch id."""
        return self._set.placement

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handle of each shard (in ``placement`` order)."""
        return [s.entry.actor for s in self._set.shards]

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each sub-env."""
        out = [""] * self.num_envs
        for s in self._set.shards:
            for i in s.pos:
                out[int(i)] = s.entry.node_id
        return out

    @property
    def lineage(self) -> Lineage:
        """Provenance of this vector env (the Ray-level tree; ``ray_placement`` events
        carry the node id of every shard)."""
        return self._lineage

    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """The ``np_random_seed`` of every sub-env."""
        return self.get_attr("np_random_seed")

    # -- the VectorEnv API ------------------------------------------------------------
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
        seeds, options, mask = self._plan_reset(seed, options)
        self._set.rebuild_lost()
        items = {}
        for k, shard in enumerate(self._set.shards):
            local_mask = mask[shard.pos]
            if not local_mask.any():
                continue
            local_options = dict(options) if options is not None else None
            if not local_mask.all():
                local_options = {**(local_options or {}), "reset_mask": local_mask}
            items[k] = ((), {"seed": [seeds[i] for i in shard.pos], "options": local_options})
        for i in np.flatnonzero(mask):
            self._episode_seeds[int(i)] = seeds[int(i)]
        self._set.send("reset", items)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the resets sent by :meth:`reset_async`: (observations, infos)."""
        if self._state is not AsyncState.WAITING_RESET:
            self._not_waiting(AsyncState.WAITING_RESET)
        self._state = AsyncState.DEFAULT  # whatever the replies hold
        results = self._set.receive(timeout, "reset_wait", "resetting")
        parts = [(s.sel, obs) for s, (obs, _info) in results]
        done = {id(s) for s, _ in results}
        parts += [
            (s.sel, B.take(self.single_observation_space, self._obs, s.sel))
            for s in self._set.shards
            if id(s) not in done
        ]
        self._obs = B.assemble(self.single_observation_space, self.num_envs, parts)
        infos = B.merge_infos(self.num_envs, [(s.pos, info) for s, (_obs, info) in results])
        return self._copy_obs(), infos

    def _copy_obs(self) -> Any:
        n = self.num_envs
        return B.assemble(self.single_observation_space, n, [(slice(0, n), self._obs)])

    def step(self, actions: Any):
        """Step every sub-env: batched (obs, rewards, terminations, truncations, infos)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send each shard actor its slice of the actions (one request per actor)."""
        self._begin("step_async")
        self._set.check("stepping")
        try:
            items = {
                k: ((B.take(self.single_action_space, actions, s.sel),), {})
                for k, s in enumerate(self._set.shards)
            }
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise BadActionError(
                f"actions do not fit a batch of {self.num_envs} of {self.single_action_space}: "
                f"{exc}"
            ) from exc
        self._set.send("step", items)
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Gather every actor's batch and merge them (infos with their ``_key`` masks)."""
        if self._state is not AsyncState.WAITING_STEP:
            self._not_waiting(AsyncState.WAITING_STEP)
        self._state = AsyncState.DEFAULT  # whatever the replies hold
        results = self._set.receive(timeout, "step_wait", "stepping")
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
        self._begin("call_async")
        self._set.check("calling")
        self._set.send("call", {k: ((name, *args), kwargs) for k in range(len(self._set.shards))})
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """The results of :meth:`call_async`, in sub-env order."""
        if self._state is not AsyncState.WAITING_CALL:
            self._not_waiting(AsyncState.WAITING_CALL)
        self._state = AsyncState.DEFAULT  # whatever the replies hold
        out: list[Any] = [None] * self.num_envs
        for shard, values in self._set.receive(timeout, "call_wait", "calling"):
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
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set ``name`` on every sub-env (one value each, or the same value for all)."""
        values = self._plan_set_attr(values)
        self._set.check("setting an attribute")
        self._set.send(
            "set_attr",
            {k: ((name, [values[i] for i in s.pos]), {}) for k, s in enumerate(self._set.shards)},
        )
        self._set.receive(None, "set_attr", "setting an attribute")

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
        plan = self._plan_fork(branch_id, indices, copies, reseed)
        self._set.check("forking")
        started = time.perf_counter()
        where = {
            int(i): (s, s.entry.node_id, j) for s in self._set.shards for j, i in enumerate(s.pos)
        }
        nodes = [n["NodeID"] for n in alive_nodes()] if spread else []
        exact, fresh = fork_layout(plan.indices, plan.copies, where.__getitem__, nodes)
        family = self._set.family
        branch = RayForkVectorEnv.__new__(RayForkVectorEnv)
        branch._setup(
            family, plan.branch_id, len(plan.sources), [self._set.origins[i] for i in plan.sources]
        )
        branch._adopt_spaces(
            self.single_observation_space,
            self.single_action_space,
            self.metadata,
            self.render_mode,
            self.spec,
        )
        info = {"ray_branch_id": plan.branch_id, "source": self.branch_id}
        refs, shards = [], []
        for group in exact:
            handle, local_id = family.new_handle(plan.branch_id)
            seeds = [plan.seeds[p] for p in group.positions] if plan.reseeded else None
            placement = {**info, "exact": True, "indices": group.positions}
            refs.append(
                group.shard.entry.actor.fork.remote(
                    group.shard.handle,
                    handle,
                    local_id,
                    group.local,
                    group.per_index,
                    seeds,
                    placement,
                )
            )
            pos = np.asarray(group.positions)
            shards.append(Shard(group.shard.entry, handle, selector(pos), pos))
        for node, copies_here in fresh.items():
            entry = family.pool.for_node(node)
            handle, local_id = family.new_handle(plan.branch_id)
            positions = [p for p, _i in copies_here]
            env_fns, from_parent = family.create_args(
                [self._set.origins[i] for _p, i in copies_here]
            )
            seeds = [
                plan.seeds[p] if plan.reseeded else self._episode_seeds[i] for p, i in copies_here
            ]
            kwargs = {**family.kwargs, "branch_id": local_id}
            placement = {**info, "exact": False, "indices": positions}
            refs.append(
                entry.actor.create.remote(handle, env_fns, kwargs, placement, from_parent, seeds)
            )
            pos = np.asarray(positions)
            shards.append(Shard(entry, handle, selector(pos), pos))
        descriptions = branch._set.adopt(refs, shards, f"forking {plan.branch_id!r}")
        parts = []
        for shard, desc in zip(branch._set.shards, descriptions, strict=True):
            if "reset" in desc:
                parts.append((shard.sel, desc["reset"][0]))
                branch.exact[shard.pos] = False
            else:
                src = np.asarray(plan.sources)[shard.pos]
                parts.append((shard.sel, B.take(self.single_observation_space, self._obs, src)))
        branch._obs = B.assemble(branch.single_observation_space, branch.num_envs, parts)
        branch._episode_seeds = [
            plan.seeds[j] if plan.reseeded and not branch.exact[j] else self._episode_seeds[i]
            for j, i in enumerate(plan.sources)
        ]
        # provenance.add_branch reads local sandboxes (pids, GPU memory): not here.
        family.tree.add(
            BranchRecord(
                plan.branch_id,
                self.branch_id,
                family.tree.baseline_id,
                branch.num_envs,
                source_indices=plan.indices,
                copies=plan.copies,
                seeds=plan.seeds,
                timings={"fork_s": time.perf_counter() - started},
            )
        )
        branch._lineage = Lineage(family.tree, plan.branch_id)
        branch._set.record_placement("fork", spread=spread, exact=branch.exact.tolist())
        return branch

    # -- close ----------------------------------------------------------------------
    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close this vector env's node-local envs (after a pending call, as
        ForkVectorEnv); an actor left with none is ended. Branches and the source close
        independently."""
        import ray

        if not ray.is_initialized():
            return
        terminate = self._finish_pending(0 if terminate else timeout) or terminate
        self._set.pending = []
        self._state = AsyncState.DEFAULT
        self._set.close(self._set.shards, timeout, terminate)
        if self._lineage is not None:
            self._set.family.tree.close(self.branch_id, "terminated" if terminate else "closed")

    def __del__(self) -> None:
        if not getattr(self, "closed", True) and hasattr(self, "_family"):
            with contextlib.suppress(Exception):  # at exit Ray may be half torn down
                self.close(terminate=True)

    def __repr__(self) -> str:
        nodes = len({s.entry.node_id for s in getattr(self, "_shards", [])})
        return (
            f"RayForkVectorEnv(num_envs={self.num_envs}, shards={len(self._set.shards)}, "
            f"nodes={nodes}, branch_id={self.branch_id!r})"
        )


def _preparation(args: dict[str, Any]) -> PrepareRecipe:
    """The preparation that ``from_parent``'s arguments ``args`` ask for."""
    return PrepareRecipe(args["warmup"], args["ready_check"], args["seed"])
