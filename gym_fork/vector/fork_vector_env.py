"""ForkVectorEnv: a drop-in ``gymnasium.vector.AsyncVectorEnv`` on forked sandboxes.

The facade holds the Gymnasium contract and its async state machine; the work is done
one layer down (docs/architecture.md): ``config`` validates the options, ``lifecycle``
owns the sandboxes (warm parent, worker pool, slab), ``pool`` moves the records,
``faults`` turns what went wrong into exceptions, ``branching`` clones running
sub-envs, ``provenance`` records the lineage, ``spaces`` batches spaces and actions.
"""

from __future__ import annotations

import copy as copy_module
import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from gymnasium import Env, Space, logger
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import concatenate, create_empty_array

from gym_fork.errors import SandboxStartError
from gym_fork.hosts.base import PrepareRecipe
from gym_fork.lineage import Lineage
from gym_fork.system.isolation import SandboxLimits
from gym_fork.transport.channel import DEFAULT_RING_BYTES
from gym_fork.transport.slab import async_shares, slab_node
from gym_fork.transport.space_codec import SpaceRefused, mapping_from_data
from gym_fork.worker import protocol as P

from . import provenance
from .branching import clone_sandboxes, plan_fork
from .config import VectorConfig, auto_envs_per_worker
from .faults import WaitTimeout
from .lifecycle import Sandboxes
from .requests import reset_mask, seeds_per_env, values_per_env
from .spaces import ActionWriter, VectorSpaces, check_attached

__all__ = ["ForkVectorEnv", "auto_envs_per_worker"]


class ForkVectorEnv(VectorEnv):
    """Vectorized environment whose sub-envs run in forked, warm sandboxes.

    Accepts every argument of :class:`gymnasium.vector.AsyncVectorEnv` and behaves the
    same, with these documented differences (see docs/compatibility.md):

    - ``context`` and ``daemon`` are accepted and recorded but have no effect: sandboxes
      are forked from a clean warm parent process and always die with their controller.
    - A failing sub-env does not break the vector env: the error is raised (with the
      sub-env index and the worker's traceback attached as a note) and a later call
      works; ``reset()`` replaces sandboxes that died.
    - After a ``*_wait`` timeout the late replies are discarded, so the next call returns
      its own results.

    Besides AsyncVectorEnv's arguments (``env_fns``, ``shared_memory``, ``copy``,
    ``context``, ``daemon``, ``worker``, ``observation_mode``, ``autoreset_mode``,
    ``max_concurrency``), these keyword-only ones:

    Keyword Args:
        envs_per_worker: sub-envs hosted by one worker sandbox. ``"auto"`` (default) is
            one sandbox per sub-env while there are more CPU cores than sub-envs, else
            sub-envs spread evenly over one worker per core (fewer context switches;
            worker-mates share a process). The grouping is fixed for the env's life:
            :func:`gym_fork.autotune` measures the choices on an env and recommends one.
            ``1`` forces one sandbox per sub-env.
            Branches made by ``fork`` are always one sub-env per sandbox.
        ring_bytes: capacity of each direction of a worker's ring (a power of two).
        network: give sandboxes the host's network (default False: an empty network
            namespace, where the host allows one).
        limits: :class:`SandboxLimits` (memory, CPU seconds, open files, processes).
        namespaces: isolate sandboxes with Linux namespaces where the host allows it.
        gpu_fork_policy: what to do when a sandbox about to be forked holds a CUDA
            context (CUDA does not survive fork): ``"refuse"`` (default) raises
            :class:`gym_fork.gpu.ForkUnsafeError` naming the process and the evidence;
            ``"clean"`` builds each sandbox cold from the env_fn instead of cloning the
            warm parent (recorded in the lineage). A ``fork()`` of running sub-envs cannot
            be done cleanly: it always refuses.
        timeout: seconds any call (reset, step, call, set_attr) may take when no explicit
            ``*_wait(timeout)`` is given; past it the sandboxes that did not answer are
            killed and :class:`SubEnvTimeout` names them (default None: wait forever,
            as AsyncVectorEnv). ``reset()`` replaces them. It bounds construction too:
            building the sub-envs, and the warm parent's start and ``from_parent``
            preparation (given 10 s more for the interpreter to start and import).
        private_tmp: give each sandbox its own writable /tmp and an empty /dev/shm
            (default True). The host's /tmp stays readable (an overlay), but files an env
            writes there are invisible to the host and to other sandboxes and gone when
            the sandbox ends. A branch's clones start from a copy of their source's /tmp
            and /dev/shm at the fork and diverge privately. ``False``: the host's /tmp
            and /dev/shm, writable, as AsyncVectorEnv.
        writable_paths: host directories sandboxes may write (default none). Everything
            else of the host is read-only in a sandbox (with ``namespaces=True``); a
            write refused there names this option. Reported in ``isolation["writable"]``.
        tmpfs_bytes: size of each private tmpfs layer (/tmp and /dev/shm of a sandbox,
            and the tree's /tmp); default 1 GiB, or ``limits.memory_bytes`` if smaller.
        check_actions: reject actions outside the action space before they reach the
            sub-envs (default False, as AsyncVectorEnv passes them through). On the slab
            path only integer leaves (Discrete, MultiDiscrete, MultiBinary) are checked.
        host: ``"process"`` (default, or ``$GYM_FORK_HOST``: forked, namespaced
            processes), ``"microvm"`` (every sandbox is a QEMU virtual machine with its
            own kernel, cloned copy-on-write from a frozen warm parent VM; needs QEMU, a
            guest kernel and a guest image: docs/microvm.md) or ``"inline"`` (the worker
            loop in a thread of this process: no isolation, for debugging with
            breakpoints inside ``env.step`` and for unit tests; cannot ``fork``).
        trusted: whether the controller may unpickle what sandboxes send (unpickling
            runs code: an exception raised in a sub-env's ``step`` could run anything in
            this process). Default False on every host (``$GYM_FORK_TRUSTED=1`` makes it
            True). Untrusted, a sub-env's exception arrives as
            :class:`gym_fork.errors.SubEnvError` carrying its type name, message and
            traceback text, and is also an instance of the nearest builtin (or
            gym_fork / ``gymnasium.error``) class it derives from, so ``except
            ValueError`` still works; spaces (custom ones by reference to a class this
            process has imported) and metadata arrive as plain data; a call result or
            info that only travels pickled (a custom object, a bound method, a set)
            raises :class:`gym_fork.errors.PickleRefused`, which names ``trusted=True``.
            True: as AsyncVectorEnv, the original exception objects and any picklable
            value.
        vm_memory_mb: guest RAM of each microVM (default 256).
        vm_slab_mb: size of the batch slab each microVM maps (default 16; a power of two
            MiB). A vector env whose slab (observations, actions, rewards of all
            sub-envs) needs more is refused with an error that says so.
    """

    # Declared up front: everything a ForkVectorEnv holds (besides VectorEnv's own).
    config: VectorConfig
    sandboxes: Sandboxes | None
    spaces: VectorSpaces
    observations: Any
    _obs_in_slab: bool
    _actions: ActionWriter | None
    _lineage: Lineage | None
    _state: AsyncState

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
        timeout: float | None = None,
        gpu_fork_policy: str = "refuse",
        host: str | None = None,
        trusted: bool | None = None,
        vm_memory_mb: int = 256,
        vm_slab_mb: int = 16,
        _prepare: PrepareRecipe | None = None,
    ) -> None:
        self._empty()
        config = VectorConfig.from_arguments(
            env_fns,
            worker=worker,
            autoreset_mode=autoreset_mode,
            max_concurrency=max_concurrency,
            envs_per_worker=envs_per_worker,
            ring_bytes=ring_bytes,
            reset_mode=reset_mode,
            gpu_fork_policy=gpu_fork_policy,
            host=host,
            timeout=timeout,
            trusted=trusted,
            namespaces=namespaces,
            network=network,
            private_tmp=private_tmp,
            limits=limits,
            prepare=_prepare,
            writable_paths=writable_paths,
            tmpfs_bytes=tmpfs_bytes,
            shared_memory=shared_memory,
            copy=copy,
            context=context,
            daemon=daemon,
            observation_mode=observation_mode,
            check_actions=check_actions,
            vm_memory_mb=vm_memory_mb,
            vm_slab_mb=vm_slab_mb,
        )
        self._adopt_config(config)
        try:
            sandboxes, hellos = Sandboxes.start(config)
            self.sandboxes = sandboxes
            self._start(hellos)
            self._lineage = provenance.start_root_lineage(
                config,
                branch_id=branch_id,
                lineage_log=lineage_log,
                env_ids=[h.get("spec_id") for h in hellos],
                isolation=self.isolation,
                timings=sandboxes.timings,
                workers=sandboxes.pool.workers,
            )
            self._bind_lineage()
            provenance.warn_missing_isolation(config, self.isolation)
        except BaseException:
            self._teardown(terminate=True)
            raise

    def _empty(self) -> None:
        self.sandboxes = None
        self._lineage = None
        self._actions = None
        self._state = AsyncState.DEFAULT
        self.observations = None
        self.closed = False

    def _adopt_config(self, config: VectorConfig) -> None:
        """The AsyncVectorEnv attributes, from the config."""
        self.config = config
        self.env_fns = list(config.env_fns)
        self.num_envs = config.num_envs
        self.shared_memory = config.shared_memory
        self.copy = config.copy
        self.context = config.context
        self.daemon = config.daemon
        self.observation_mode = config.observation_mode
        self.autoreset_mode = config.autoreset_mode
        self.max_concurrency = config.max_concurrency
        self.envs_per_worker = config.envs_per_worker
        self.timeout = config.timeout
        self.ring_bytes = config.ring_bytes
        self.check_actions = config.check_actions
        self.reset_mode = config.reset_mode
        self.host_kind = config.host
        self.trusted = config.trusted
        self.isolation_config = config.isolation
        self.vm_memory_mb = config.vm_memory_mb
        self.vm_slab_mb = config.vm_slab_mb

    def _start(self, hellos: list[dict[str, Any]]) -> None:
        """Spaces and metadata from the workers' HELLOs, then the slab and ATTACH."""
        first = hellos[0]
        trusted = self.config.trusted
        try:
            self.metadata = mapping_from_data(first.get("metadata"), trusted=trusted)
        except SpaceRefused as exc:
            raise SandboxStartError(f"a sandbox reported malformed metadata: {exc}") from exc
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first.get("render_mode")
        self._adopt_spaces(VectorSpaces.from_hellos(self.observation_mode, hellos, trusted=trusted))
        single = self.single_observation_space
        if self.shared_memory and not async_shares(single):
            raise ValueError(
                "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable "
                "this feature with `shared_memory=False` however this is slower. "
                f"(ForkVectorEnv: {single} has no shared layout.)"
            )
        # Spaces Async shares but that have no fixed-size slab layout (OneOf) travel in
        # ring records: same results, one copy more.
        self._obs_in_slab = self.shared_memory and slab_node(single, 1) is not None
        slabs = self.sandboxes.open_slabs(self.spaces, self._obs_in_slab)
        self.observations = create_empty_array(single, n=self.num_envs, fn=np.zeros)
        self._actions = ActionWriter(self.spaces, slabs, self.config.check_actions)
        checks = self.sandboxes.attach_all(self.spaces, self._obs_in_slab)
        check_attached(checks, self.observation_mode, self.single_action_space)

    def _adopt_spaces(self, spaces: VectorSpaces) -> None:
        self.spaces = spaces
        self.single_observation_space = spaces.single_observation_space
        self.observation_space = spaces.observation_space
        self.single_action_space = spaces.single_action_space
        self.action_space = spaces.action_space

    def _bind_lineage(self) -> None:
        self.sandboxes.lineage = self._lineage
        self.sandboxes.pool.label = self._lineage.branch_id
        if self.sandboxes.clean_launch is not None:
            self._lineage.tree.event(
                self._lineage.branch_id, "clean_launch", **self.sandboxes.clean_launch
            )

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
        if kwargs.get("envs_per_worker", 1) != 1:
            raise ValueError("from_parent clones one sandbox per sub-env: envs_per_worker=1")
        if isinstance(num_envs, bool) or not isinstance(num_envs, int | np.integer):
            raise TypeError(f"num_envs must be an int, got {num_envs!r}")
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        from .config import check_sandbox_count

        check_sandbox_count(int(num_envs), "from_parent")
        kwargs["envs_per_worker"] = 1
        return cls(
            [env_fn] * int(num_envs),
            reset_mode=reset_mode,
            _prepare=PrepareRecipe(warmup, ready_check, seed),
            **kwargs,
        )

    # -- reports --------------------------------------------------------------------
    @property
    def np_random_seed(self) -> tuple[int, ...]:
        """Returns a tuple of np_random seeds for all the wrapped envs."""
        return self.get_attr("np_random_seed")

    @property
    def np_random(self) -> tuple[np.random.Generator, ...]:
        """Returns the tuple of the numpy random number generators for the wrapped envs."""
        return self.get_attr("np_random")

    @property
    def isolation(self) -> dict[str, Any]:
        """The isolation this vector env's sandboxes actually achieved (as they reported)."""
        return self.sandboxes.isolation() if self.sandboxes is not None else {}

    @property
    def lineage(self) -> Lineage:
        """Provenance of this vector env: branch id, parent, baseline id, events."""
        return self._lineage

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker sandboxes, in sub-env order of their first index."""
        return [w.pid for w in self.sandboxes.pool.workers] if self.sandboxes else []

    def stats(self) -> list[dict[str, Any]]:
        """Per sub-env: its sandbox's pid, RSS and PSS (bytes) and GPU memory (bytes, from
        NVML; None without a GPU or when the sandbox holds no CUDA context)."""
        return provenance.sandbox_stats(self.sandboxes.pool.workers)

    def sandbox_output(self, index: int, stream: str = "stderr") -> str:
        """The last output (at most 64 KiB) of the sandbox hosting sub-env ``index``."""
        for worker in self.sandboxes.pool.workers:
            if index in worker.indices:
                return worker.output_tail(stream)
        raise IndexError(f"no sub-env {index} in a vector env of {self.num_envs}")

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
        self._assert_is_running()
        seed = seeds_per_env(seed, self.num_envs)
        self._assert_idle("reset_async")
        options, mask = reset_mask(options, self.num_envs)
        self.sandboxes.replace_dead()
        if self.config.reset_mode == "clone":
            self.sandboxes.reset_by_clone(mask)
        workers = self.sandboxes.pool.workers
        args = [[[seed[i], options, bool(mask[i])] for i in w.indices] for w in workers]
        self.sandboxes.pool.send_each(P.RESET, args)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the resets sent by :meth:`reset_async` and return (obs, infos)."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_RESET:
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.",
                AsyncState.WAITING_RESET.value,
            )
        replies = self._collect(timeout, P.RESET, "reset_wait")
        infos: dict[str, Any] = {}
        observations = [] if not self._obs_in_slab else None
        for worker, (obs_list, info_list) in zip(self.sandboxes.pool.workers, replies, strict=True):
            for k, index in enumerate(worker.indices):
                infos = self._add_info(infos, info_list[k], index)
                if observations is not None:
                    observations.append(obs_list[k])
        if observations is not None:
            self.observations = concatenate(
                self.single_observation_space, observations, self.observations
            )
        return self._observations_out(), infos

    # -- step -----------------------------------------------------------------------
    def step(self, actions):
        """Step every sub-env with its action; returns batched (obs, rew, term, trunc, info)."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions) -> None:
        """Write the actions to the slab (or the requests) and wake the workers."""
        if self.closed:
            self._assert_is_running()
        if self._state is not AsyncState.DEFAULT:
            self._assert_idle("step_async", ".")
        pool = self.sandboxes.pool
        # A dead worker is noticed by the wait (every faults.LIVENESS_SLICE), not here: a
        # liveness syscall per worker per step would cost more than the step itself.
        # A worker still serving an abandoned step would read the slab's actions late:
        # until it has caught up, actions travel inside the requests (pool.py).
        if not pool.behind() and self._actions.write_slab(actions):
            pool.send_same(P.STEP, None)
        else:
            per_env = self._actions.per_sub_env(actions)
            pool.send_each(P.STEP, [[per_env[i] for i in w.indices] for w in pool.workers])
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Wait for the steps sent by :meth:`step_async` and return their batched results."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.",
                AsyncState.WAITING_STEP.value,
            )
        replies = self._collect(timeout, P.STEP, "step_wait")
        infos: dict[str, Any] = {}
        if self._obs_in_slab:
            # The hot path: every result is in the slabs; a worker's reply carries only
            # its infos, and only when one of its sub-envs returned a non-empty one.
            for worker, reply in zip(self.sandboxes.pool.workers, replies, strict=True):
                info_list = reply[1]
                if info_list is not None:
                    for k, index in enumerate(worker.indices):
                        infos = self._add_info(infos, info_list[k], index)
        else:
            observations = []
            for worker, (obs_list, info_list) in zip(
                self.sandboxes.pool.workers, replies, strict=True
            ):
                if info_list is not None:
                    for k, index in enumerate(worker.indices):
                        infos = self._add_info(infos, info_list[k], index)
                observations.extend(obs_list)
            self.observations = concatenate(
                self.single_observation_space, observations, self.observations
            )
        rewards, terminations, truncations = self.sandboxes.slabs.step_columns()
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
        self._assert_is_running()
        self._assert_idle("call_async", ".")
        self.sandboxes.pool.send_same(P.CALL, [name, args, kwargs])
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Wait for the calls sent by :meth:`call_async`; results in sub-env order."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_CALL:
            raise NoAsyncCallError(
                "Calling `call_wait` without any prior call to `call_async`.",
                AsyncState.WAITING_CALL.value,
            )
        replies = self._collect(timeout, P.CALL, "call_wait")
        return tuple(value for reply in replies for value in reply)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Get an attribute of every sub-env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set an attribute of every sub-env (one value each, or the same for all)."""
        self._assert_is_running()
        values = values_per_env(values, self.num_envs)
        self._assert_idle("set_attr", ".")
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
    ) -> ForkVectorEnv:
        """Branch running sub-envs: a new ForkVectorEnv continuing from their exact state.

        Each sub-env of the branch is a copy-on-write clone of the sandbox of one chosen
        sub-env (RNG, step counters, wrappers, everything in that process), taken now;
        the source keeps running untouched. ``indices=[3], copies=8`` fans sub-env 3 out
        to 8; the branch's sub-envs are ordered by source index, then copy. ``reseed``
        (an int: seed + j for branch sub-env j; or one seed per branch sub-env) gives
        clones their own randomness; without it a branch stepped with the source's actions
        replays the source exactly. Branches can be forked again, closed in any order,
        and outlive their source. ``branch_id`` must be new in this lineage tree.
        """
        self._assert_is_running()
        self._assert_idle("fork", ".")
        plan = plan_fork(branch_id, indices, copies, reseed, self.num_envs)
        self._lineage.tree.check_free(plan.branch_id)
        sandboxes, spaces, observations, elapsed = clone_sandboxes(
            self.sandboxes,
            self.spaces,
            self.observations,
            plan,
            self._obs_in_slab,
            self.observation_mode,
        )
        branch = ForkVectorEnv.__new__(ForkVectorEnv)
        branch._empty()
        branch._adopt_config(sandboxes.config)
        branch.sandboxes = sandboxes
        branch.metadata = self.metadata
        branch.render_mode = self.render_mode
        branch._adopt_spaces(spaces)
        branch._obs_in_slab = self._obs_in_slab
        branch.observations = observations
        branch._actions = ActionWriter(spaces, sandboxes.slabs, self.config.check_actions)
        try:
            branch._lineage = provenance.add_branch(
                self._lineage,
                plan.branch_id,
                indices=plan.indices,
                copies=plan.copies,
                seeds=plan.seeds,
                elapsed=elapsed,
                isolation=branch.isolation,
                workers=sandboxes.pool.workers,
            )
            branch._bind_lineage()
        except BaseException:
            branch._teardown(terminate=True)
            raise
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
        try:
            if self._state != AsyncState.DEFAULT:
                logger.warn(
                    f"Calling `close` while waiting for a pending call to "
                    f"`{self._state.value}` to complete."
                )
                function = getattr(self, f"{self._state.value}_wait")
                function(timeout)
        except multiprocessing.TimeoutError:
            terminate = True
        except Exception as exc:  # a pending call that failed must not stop the close
            logger.warn(f"Pending call failed while closing: {exc!r}")
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

    # -- plumbing -------------------------------------------------------------------
    def _collect(self, timeout: float | None, op: int, what: str) -> list[Any]:
        """Every worker's result; past ``timeout`` a multiprocessing.TimeoutError (late
        replies are dropped later), past the vector env's own ``timeout`` the sandboxes
        that did not answer are killed (SubEnvTimeout)."""
        own_deadline = timeout is None and self.timeout is not None
        pool = self.sandboxes.pool
        try:
            return pool.collect(op, self.timeout if own_deadline else timeout)
        except WaitTimeout:
            if own_deadline:
                raise pool.kill_unanswered(op, what, self.timeout) from None
            raise multiprocessing.TimeoutError(
                f"The call to `{what}` has timed out after {timeout} second(s)." + pool.tree_note()
            ) from None
        finally:
            self._state = AsyncState.DEFAULT

    def _observations_out(self) -> Any:
        if self._obs_in_slab:
            # Gathered from the workers' slabs: a new batch (copy=True), or into the
            # vector env's own buffer (copy=False, as AsyncVectorEnv's shared view).
            slabs = self.sandboxes.slabs
            if self.copy:
                self.observations = slabs.observations()
                return self.observations
            self.observations = slabs.observations(out=self.observations)
            return self.observations
        if not self.copy:
            return self.observations
        obs = self.observations
        return obs.copy() if type(obs) is np.ndarray else copy_module.deepcopy(obs)

    def _assert_idle(self, what: str, stop: str = "") -> None:
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `{what}` while waiting for a pending call to "
                f"`{self._state.value}` to complete{stop}",
                str(self._state.value),
            )

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def __repr__(self) -> str:
        """Same form as AsyncVectorEnv's repr."""
        return VectorEnv.__repr__(self)
