"""ForkVectorEnv: a drop-in ``gymnasium.vector.AsyncVectorEnv`` on forked sandboxes.

The facade holds the Gymnasium contract and its async state machine; the work is done
one layer down (docs/architecture.md): ``config`` validates the options, ``lifecycle``
owns the sandboxes (warm parent, worker pool, slab), ``pool`` moves the records,
``faults`` turns what went wrong into exceptions, ``branching`` clones running
sub-envs, ``provenance`` records the lineage, ``spaces`` batches spaces and actions.
Its reports (isolation, lineage, stats) are ``reports.Reports``; how replies become
batched results, ``results.Results``; batch mode's ``send``/``recv``, ``batches``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from gymnasium import Env, Space
from gymnasium.vector import AutoresetMode, VectorEnv

from gym_fork.hosts.base import PrepareRecipe
from gym_fork.lineage import Lineage
from gym_fork.system.isolation import SandboxLimits
from gym_fork.transport.channel import DEFAULT_RING_BYTES
from gym_fork.worker import protocol as P

from . import provenance
from .batches import Batches, BatchMode, check_free
from .branching import check_shared_memory_policy, clone_sandboxes, warn_shared_with_source
from .config import VectorConfig, auto_envs_per_worker, check_parent_count, check_sandbox_count
from .foreign_arguments import refuse_foreign
from .frontend import AsyncState
from .lifecycle import Sandboxes, live_sandboxes
from .opening import Opened, open_root
from .reports import Reports
from .results import Results
from .spaces import ActionWriter, VectorSpaces

__all__ = ["ForkVectorEnv", "auto_envs_per_worker"]


def _option(name: str) -> property:
    """A read-only attribute that is the config's field ``name``."""
    return property(attrgetter(f"config.{name}"), doc=f"The ``{name}`` option (read-only).")


# The reports override VectorEnv's single np_random with one per sub-env (AsyncVectorEnv's).
class ForkVectorEnv(Reports, Results, BatchMode, VectorEnv):  # type: ignore[misc]
    """Vectorized environment whose sub-envs run in forked, warm sandboxes.

    A drop-in :class:`gymnasium.vector.AsyncVectorEnv`: its arguments (then gym_fork's
    own, keyword-only), attributes and behaviour, with the deliberate differences of
    docs/compatibility.md (a failing sub-env does not break the env; late replies after a
    ``*_wait`` timeout are dropped). Each argument and its default: the API reference's
    parameter table (docs/guides/api.md, "ForkVectorEnv parameters"). Every option is a
    read-only attribute of the same name (``envs.timeout``), held by the frozen
    ``envs.config``.
    """

    config: VectorConfig
    sandboxes: Sandboxes
    spaces: VectorSpaces
    observations: Any
    _obs_in_slab: bool
    _actions: ActionWriter | None
    _lineage: Lineage | None

    # AsyncVectorEnv's attributes and gym_fork's options, read from the config.
    env_fns = _option("env_fns")
    num_envs = _option("num_envs")
    shared_memory = _option("shared_memory")
    copy = _option("copy")
    context = _option("context")
    daemon = _option("daemon")
    observation_mode = _option("observation_mode")
    autoreset_mode = _option("autoreset_mode")
    max_concurrency = _option("max_concurrency")
    envs_per_worker = _option("envs_per_worker")
    batch_size = _option("batch_size")
    ring_bytes = _option("ring_bytes")
    check_actions = _option("check_actions")
    reset_mode = _option("reset_mode")
    timeout = _option("timeout")
    gpu_fork_policy = _option("gpu_fork_policy")
    trusted = _option("trusted")
    vm_memory_mb = _option("vm_memory_mb")
    vm_slab_mb = _option("vm_slab_mb")
    worker = None  # AsyncVectorEnv's custom worker: never one here

    def __new__(cls, *args: Any, **kwargs: Any) -> ForkVectorEnv:
        # Before __init__'s signature refuses them with Python's bare TypeError.
        # (the signature is read only when a foreign name is there: not at every env)
        refuse_foreign(args, kwargs, lambda: inspect.signature(cls.__init__).parameters)
        return super().__new__(cls)

    def __init__(
        self,
        env_fns: Sequence[Callable[[], Env]],
        shared_memory: bool = True,
        copy: bool = True,
        context: str | None = None,
        daemon: bool = True,
        worker: Callable | None = None,
        observation_mode: str | Space | tuple[Space, Space] = "same",
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        max_concurrency: int | None = None,
        *,
        envs_per_worker: int | str = "auto",
        batch_size: int | None = None,
        ring_bytes: int = DEFAULT_RING_BYTES,
        check_actions: bool = False,
        reset_mode: str = "in_place",
        branch_id: str | None = None,
        lineage_log: str | os.PathLike | bool | None = True,
        network: bool = False,
        limits: SandboxLimits | None = None,
        namespaces: bool = True,
        private_tmp: bool = True,
        writable_paths: Sequence[str | os.PathLike] = (),
        tmpfs_bytes: int | None = None,
        sandbox_user: str = "auto",
        pass_env: Sequence[str] | bool = (),
        isolation: str = "report",
        timeout: float | None = None,
        gpu_fork_policy: str = "refuse",
        host: str | None = None,
        trusted: bool | None = None,
        vm_memory_mb: int = 256,
        vm_slab_mb: int = 16,
        _prepare: PrepareRecipe | None = None,
    ) -> None:
        # Every argument but the lineage's goes to the config as it came; from_arguments
        # checks each (tests/vector/test_config.py: each one arrives under its name).
        config = VectorConfig.from_arguments(
            env_fns=env_fns,
            shared_memory=shared_memory,
            copy=copy,
            context=context,
            daemon=daemon,
            worker=worker,
            observation_mode=observation_mode,
            autoreset_mode=autoreset_mode,
            max_concurrency=max_concurrency,
            envs_per_worker=envs_per_worker,
            batch_size=batch_size,
            ring_bytes=ring_bytes,
            check_actions=check_actions,
            reset_mode=reset_mode,
            network=network,
            limits=limits,
            namespaces=namespaces,
            private_tmp=private_tmp,
            writable_paths=writable_paths,
            tmpfs_bytes=tmpfs_bytes,
            sandbox_user=sandbox_user,
            pass_env=pass_env,
            isolation=isolation,
            timeout=timeout,
            gpu_fork_policy=gpu_fork_policy,
            host=host,
            trusted=trusted,
            vm_memory_mb=vm_memory_mb,
            vm_slab_mb=vm_slab_mb,
            prepare=_prepare,
        )
        opened = open_root(config)
        self._open(
            opened,
            lambda env: provenance.start_root_lineage(
                config,
                branch_id=branch_id,
                lineage_log=lineage_log,
                env_ids=opened.env_ids,
                isolation=env.isolation,
                timings=opened.sandboxes.timings,
                workers=opened.sandboxes.pool.workers,
            ),
        )
        self._enforce_isolation(self.isolation)
        provenance.warn_missing_isolation(config, self.isolation)

    def _open(self, opened: Opened, record: Callable[[ForkVectorEnv], Lineage]) -> None:
        """The one constructor of roots and branches: adopt started sandboxes, then
        record the env in its lineage tree (``record``); torn down if that fails."""
        sandboxes, spaces = opened.sandboxes, opened.spaces
        self.config = sandboxes.config
        self.sandboxes = sandboxes
        self._state = AsyncState.DEFAULT
        self.closed = False
        self.metadata = opened.metadata
        self.render_mode = opened.render_mode
        self.spaces = spaces
        self.single_observation_space = spaces.single_observation_space
        self.observation_space = spaces.observation_space
        self.single_action_space = spaces.single_action_space
        self.action_space = spaces.action_space
        self._obs_in_slab = opened.obs_in_slab
        self.observations = opened.observations
        self._actions = ActionWriter(spaces, sandboxes.slab_set(), self.config.check_actions)
        self._batches = Batches(self.config.batch_size) if self.config.batch_size else None
        self._lineage = None
        try:
            self._lineage = record(self)
            sandboxes.lineage = self._lineage
            sandboxes.pool.label = self._lineage.branch_id
            if sandboxes.clean_launch is not None:
                self._lineage.tree.event(
                    self._lineage.branch_id, "clean_launch", **sandboxes.clean_launch
                )
        except BaseException:
            self._teardown(terminate=True)
            raise

    @classmethod
    def from_parent(
        cls,
        env_fn: Callable[[], Env],
        num_envs: int,
        *,
        warmup: Callable[[Env], Any] | None = None,
        ready_check: Callable[[Env], Any] | None = None,
        seed: int | None = None,
        reset_mode: str = "clone",
        **kwargs: Any,
    ) -> ForkVectorEnv:
        """Prepare one env once in a warm parent and clone it ``num_envs`` times.

        The warm parent builds ``env_fn()``, calls ``env.reset(seed=seed)`` when a seed is
        given, then ``warmup(env)`` and ``ready_check(env)`` (False or an exception means
        not ready), and only then is marked ready. Every sub-env is a copy-on-write clone
        of that prepared process; with ``reset_mode="clone"`` (default) every ``reset()``
        starts the reset sub-envs from a fresh clone too. Other keyword arguments are
        those of the constructor.
        """
        num_envs = check_parent_count(num_envs, kwargs)
        check_sandbox_count(num_envs, "from_parent")
        return cls(
            [env_fn] * num_envs,
            reset_mode=reset_mode,
            _prepare=PrepareRecipe(warmup, ready_check, seed),
            **kwargs,
        )

    # -- reset ----------------------------------------------------------------------
    def reset(
        self,
        *,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset all (or the ``options['reset_mask']``) sub-envs; see AsyncVectorEnv."""
        self.reset_async(seed=seed, options=options)
        return self.reset_wait()

    def reset_async(
        self,
        seed: int | list[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """Send the reset requests; collect them with :meth:`reset_wait`."""
        seeds, options, mask = self._plan_reset(seed, options)
        self.sandboxes.replace_dead()
        if self.config.reset_mode == "clone":
            self.sandboxes.reset_by_clone(mask)
        workers = self.sandboxes.pool.workers
        args = [[[seeds[i], options, bool(mask[i])] for i in w.indices] for w in workers]
        self.sandboxes.pool.send_each(P.RESET, args)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the resets sent by :meth:`reset_async` and return (obs, infos)."""
        if self._state is not AsyncState.WAITING_RESET:
            self._not_waiting(AsyncState.WAITING_RESET)
        infos = self._gather(self._collect(timeout, P.RESET, "reset_wait"))
        return self._observations_out(), infos

    # -- step -----------------------------------------------------------------------
    def step(self, actions):
        """Step every sub-env with its action; returns batched (obs, rew, term, trunc, info)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions) -> None:
        """Write the actions to the slab (or the requests) and wake the workers."""
        if self.closed or self._state is not AsyncState.DEFAULT:
            self._begin("step_async")
        pool = self.sandboxes.pool
        writer = self._actions
        assert writer is not None  # set while open
        # A dead worker is noticed by the wait (ring.wait, every 0.1 s slice), not here: a
        # liveness syscall per worker per step would cost more than the step itself.
        # A worker still serving an abandoned step would read the slab's actions late:
        # until it has caught up, actions travel inside the requests (pool.py).
        if not pool.behind() and writer.write_slab(actions):
            pool.send_same(P.STEP, None)
        else:
            per_env = writer.per_sub_env(actions)
            pool.send_each(P.STEP, [[per_env[i] for i in w.indices] for w in pool.workers])
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Wait for the steps sent by :meth:`step_async` and return their batched results."""
        if self._state is not AsyncState.WAITING_STEP:
            self._not_waiting(AsyncState.WAITING_STEP)
        try:
            replies = self._collect(timeout, P.STEP, "step_wait")
        except AssertionError as exc:
            if not self.config.check_actions:  # most envs assert action_space.contains
                exc.add_note(
                    "(an assertion in a sub-env's step: if it checks its action, pass "
                    "check_actions=True to have every action checked against the action "
                    "space before it is sent, with the sub-env and the action named)"
                )
            raise
        infos = self._gather(replies)
        rewards, terminations, truncations = self.sandboxes.slab_set().step_columns()
        observations = self._observations_out()
        return observations, rewards, terminations, truncations, infos

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call a method (or read an attribute) of every sub-env; returns a tuple."""
        self.call_async(name, *args, **kwargs)
        return self.call_wait()

    def render(self) -> tuple[Any, ...] | None:
        """Returns a tuple of rendered frames from the environments."""
        return self.call("render")

    def call_async(self, name: str, /, *args: Any, **kwargs: Any) -> None:
        """Send a call of ``name`` to every sub-env; collect with :meth:`call_wait`."""
        self._begin("call_async")
        self.sandboxes.pool.send_same(P.CALL, [name, args, kwargs])
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Wait for the calls sent by :meth:`call_async`; results in sub-env order."""
        if self._state is not AsyncState.WAITING_CALL:
            self._not_waiting(AsyncState.WAITING_CALL)
        replies = self._collect(timeout, P.CALL, "call_wait")
        return tuple(value for reply in replies for value in reply)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Get an attribute of every sub-env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set an attribute of every sub-env (one value each, or the same for all)."""
        values = self._plan_set_attr(values)
        pool = self.sandboxes.pool
        pool.send_each(P.SETATTR, [[name, [values[i] for i in w.indices]] for w in pool.workers])
        self._state = AsyncState.WAITING_CALL
        self._collect(None, P.SETATTR, "set_attr")

    # -- branching ------------------------------------------------------------------
    def fork(
        self,
        branch_id: str,
        indices: Sequence[int] | None = None,
        copies: int = 1,
        reseed: int | Sequence[int | None] | None = None,
        shared_memory: str = "warn",
    ) -> ForkVectorEnv:
        """Branch running sub-envs: a new ForkVectorEnv continuing from their exact state.

        Each sub-env of the branch is a copy-on-write clone of the sandbox of one chosen
        sub-env (RNG, step counters, wrappers, everything in that process), taken now;
        the source keeps running untouched. ``indices=[3], copies=8`` fans sub-env 3 out
        to 8; the branch's sub-envs are ordered by source index, then copy. ``reseed``
        (an int: seed + j for branch sub-env j; or one seed per branch sub-env) gives
        clones their own randomness; without it a branch stepped with the source's actions
        replays the source exactly. Branches can be forked again, closed in any order,
        and outlive their source. ``branch_id`` must be new in this lineage tree. In batch
        mode the forked sub-envs must be free (others may be running a ``send``), and the
        branch is in batch mode too.

        An env's MAP_SHARED memory (``mmap.mmap(-1, n)``, RawArray, Value) is not copied:
        a branch shares it with its source. ``shared_memory="warn"`` (default) forks and
        warns (``isolation["missing"]["shared_with_source"]`` names it); ``"refuse"``
        raises ForkUnsafeError, naming it, before any clone is made.
        """
        check_shared_memory_policy(shared_memory)
        batches = self._batches
        plan = self._plan_fork(
            branch_id, indices, copies, reseed, held=live_sandboxes(), beside_sends=bool(batches)
        )
        if batches is not None:  # batch mode: other sub-envs may be running a send
            check_free(batches, plan.indices, "forking them")
        source = Opened(
            self.sandboxes,
            self.spaces,
            self.metadata,
            self.render_mode,
            self._obs_in_slab,
            self.observations,
        )
        opened, elapsed = clone_sandboxes(source, plan, shared_memory)
        branch = ForkVectorEnv.__new__(ForkVectorEnv)
        measured: list[dict[str, Any]] = []  # the branch's isolation, measured once

        def record(env: ForkVectorEnv) -> Lineage:
            measured.append(env.isolation)
            return provenance.add_branch(
                self.lineage,
                plan.branch_id,
                indices=plan.indices,
                copies=plan.copies,
                seeds=plan.seeds,
                elapsed=elapsed,
                isolation=measured[0],
                workers=opened.sandboxes.pool.workers,
            )

        branch._open(opened, record)  # which calls record: measured[0] is there
        branch._enforce_isolation(measured[0])
        provenance.warn_branch_lost_isolation(lambda: self.isolation, measured[0], plan.branch_id)
        warn_shared_with_source(opened.sandboxes.pool.workers, plan.branch_id)
        return branch

    # -- close ----------------------------------------------------------------------
    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        """Close the sub-envs, then the sandboxes, rings and slab.

        Args:
            timeout: Seconds to wait for a pending call and for the sub-envs' ``close``;
                past it the sandboxes are killed.
            terminate: Kill the sandboxes without closing the sub-envs.
        """
        timeout = 0 if terminate else timeout
        terminate = self._drain_batches(timeout) or terminate
        terminate = self._finish_pending(timeout) or terminate
        self._teardown(terminate=terminate, timeout=timeout)

    def _teardown(self, *, terminate: bool, timeout: float | None = None) -> None:
        self._state = AsyncState.DEFAULT
        self.closed = True
        self.observations = None
        self._actions = None
        if self.sandboxes is not None:
            self.sandboxes.teardown(terminate=terminate, timeout=timeout)

    def __del__(self) -> None:
        """On deleting the object, checks that the vector environment is closed."""
        if not getattr(self, "closed", True) and getattr(self, "sandboxes", None) is not None:
            self.close(terminate=True)

    def __repr__(self) -> str:
        """Same form as AsyncVectorEnv's repr."""
        return VectorEnv.__repr__(self)
