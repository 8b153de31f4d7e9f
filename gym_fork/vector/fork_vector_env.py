"""ForkVectorEnv: a drop-in ``gymnasium.vector.AsyncVectorEnv`` on forked sandboxes.

Sub-envs run in worker sandboxes forked from a warm parent (see ``gym_fork.hosts``);
requests and replies cross shared-memory rings, and observations, actions, rewards and
done flags live in a shared batch slab, so a step moves no array through a pipe.
"""

from __future__ import annotations

import atexit
import contextlib
import copy as copy_module
import hashlib
import math
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import numpy as np
from gymnasium import Env, Space, logger
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import (
    batch_differing_spaces,
    batch_space,
    concatenate,
    create_empty_array,
    iterate,
)

from gym_fork.errors import (
    BadActionError,
    RingTimeout,
    SubEnvCrashed,
    SubEnvTimeout,
    TransportError,
)
from gym_fork.gpu import ForkUnsafeError, cuda_evidence, host_pid
from gym_fork.gpu import probe as gpu_probe
from gym_fork.hosts.process.host import (
    SPAWN_BATCH,
    ProcessHost,
    SandboxEnds,
    WorkerHandle,
    WorkerSpec,
    hand_over,
)
from gym_fork.lineage import (
    Lineage,
    LineageLog,
    LineageTree,
    baseline_id,
    baseline_inputs,
    default_log_path,
)
from gym_fork.lineage.tree import BranchRecord
from gym_fork.system.isolation import IsolationConfig, SandboxLimits
from gym_fork.system.linux import describe_status
from gym_fork.transport.channel import DEFAULT_RING_BYTES
from gym_fork.transport.codec import pack
from gym_fork.transport.control import send_message
from gym_fork.transport.slab import Slab, async_shares, slab_node
from gym_fork.transport.slab import leaves as slab_leaves
from gym_fork.worker import protocol as P

__all__ = ["ForkVectorEnv"]

# Every open ForkVectorEnv, so that interpreter exit without close() still cleans up.
_OPEN: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    for envs in list(_OPEN):
        with contextlib.suppress(Exception):
            envs.close(terminate=True)


# Lines of a dead sandbox's stderr quoted in SubEnvCrashed.
STDERR_LINES = 10

# Sets of missing isolation layers already warned about (once per process each).
_WARNED_MISSING: set[tuple[str, ...]] = set()

# How often a wait checks that the worker it waits on is still alive.
_LIVENESS_SLICE = 0.1


class _Deadline:
    def __init__(self, timeout: float | None) -> None:
        self.end = None if timeout is None else time.perf_counter() + timeout

    def slice(self) -> float | None:
        """Seconds to wait before the next liveness check; 0 when past the deadline."""
        if self.end is None:
            return _LIVENESS_SLICE
        return max(0.0, min(_LIVENESS_SLICE, self.end - time.perf_counter()))

    def expired(self) -> bool:
        return self.end is not None and time.perf_counter() >= self.end


class _WaitTimeout(Exception):
    pass


HOSTS = ("process", "microvm")


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

    Extra keyword arguments:
        envs_per_worker: sub-envs hosted by one worker sandbox. ``"auto"`` (default) is
            one sandbox per sub-env while there are at least as many CPU cores as
            sub-envs, else sub-envs spread evenly over one worker per core (fewer
            context switches; worker-mates share a process). ``1`` forces one sandbox
            per sub-env. Branches made by ``fork`` are always one sub-env per sandbox.
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
            as AsyncVectorEnv). ``reset()`` replaces them.
        private_tmp: give each sandbox its own /tmp and /dev/shm (default False, as with
            AsyncVectorEnv). When True, files an env writes there are invisible to the host
            and to other sandboxes and gone when the sandbox ends, and the host's /tmp is
            hidden (refused, and reported, when the code or cwd lives under /tmp).
        check_actions: reject actions outside the action space before they reach the
            sub-envs (default False, as AsyncVectorEnv passes them through). On the slab
            path only integer leaves (Discrete, MultiDiscrete, MultiBinary) are checked.
        host: ``"process"`` (default, or ``$GYM_FORK_HOST``: forked, namespaced
            processes) or ``"microvm"``:
            every sandbox is a QEMU virtual machine with its own kernel, cloned
            copy-on-write from a frozen warm parent VM (docs/microvm.md). Needs QEMU, a
            guest kernel and a guest image (``gym-fork image build``).
        vm_memory_mb: guest RAM of each microVM (default 256).
        vm_slab_mb: size of the batch slab each microVM maps (default 16; a power of two
            MiB). A vector env whose slab (observations, actions, rewards of all
            sub-envs) needs more is refused with an error that says so.
    """

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
        private_tmp: bool = False,
        timeout: float | None = None,
        gpu_fork_policy: str = "refuse",
        host: str | None = None,
        vm_memory_mb: int = 256,
        vm_slab_mb: int = 16,
        _prepare: tuple | None = None,
    ) -> None:
        self.env_fns = env_fns
        self.shared_memory = shared_memory
        self.copy = copy
        self.context = context
        self.daemon = daemon
        self.worker = worker
        self.observation_mode = observation_mode
        self.autoreset_mode = (
            autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode)
        )
        if max_concurrency is not None:
            if not isinstance(max_concurrency, int | np.integer):
                raise ValueError(
                    f"`max_concurrency` must be an integer or None, got {type(max_concurrency)}."
                )
            if max_concurrency < 1:
                raise ValueError(
                    f"`max_concurrency` must be a positive or None, got {max_concurrency}."
                )
        self.max_concurrency = max_concurrency
        if worker is not None:
            raise ValueError(
                "ForkVectorEnv does not run custom pipe-based `worker` functions: its workers "
                "speak over shared-memory rings. Use gymnasium.vector.AsyncVectorEnv for a "
                "custom worker."
            )
        if envs_per_worker == "auto":
            envs_per_worker = auto_envs_per_worker(len(env_fns))
        if not isinstance(envs_per_worker, int) or envs_per_worker < 1:
            raise ValueError(
                f"`envs_per_worker` must be 'auto' or an int >= 1, got {envs_per_worker!r}"
            )
        if ring_bytes < 4096 or ring_bytes & (ring_bytes - 1):
            raise ValueError(f"`ring_bytes` must be a power of two >= 4096, got {ring_bytes}")

        self.num_envs = len(env_fns)
        if self.num_envs == 0:
            raise ValueError("ForkVectorEnv needs at least one env_fn")
        if reset_mode not in ("in_place", "clone"):
            raise ValueError(f"`reset_mode` must be 'in_place' or 'clone', got {reset_mode!r}")
        if reset_mode == "clone" and envs_per_worker != 1:
            raise ValueError("reset_mode='clone' needs one sandbox per sub-env: envs_per_worker=1")
        self.envs_per_worker = envs_per_worker
        self.ring_bytes = ring_bytes
        self.check_actions = check_actions
        self.reset_mode = reset_mode
        self.timeout = timeout
        if gpu_fork_policy not in ("refuse", "clean"):
            raise ValueError(
                f"gpu_fork_policy must be 'refuse' or 'clean', got {gpu_fork_policy!r}"
            )
        self.gpu_fork_policy = gpu_fork_policy
        host = host or os.environ.get("GYM_FORK_HOST") or "process"
        if host not in HOSTS:
            raise ValueError(f"`host` must be one of {sorted(HOSTS)}, got {host!r}")
        self.host_kind = host
        self.vm_memory_mb = vm_memory_mb
        self.vm_slab_mb = vm_slab_mb
        self.isolation_config = IsolationConfig(
            namespaces=namespaces,
            network=network,
            private_tmp=private_tmp,
            limits=limits or SandboxLimits(),
        )
        self._prepare = _prepare
        self._origins = list(range(self.num_envs)) if _prepare is None else [0] * self.num_envs
        self._init_plumbing()
        try:
            self._start()
            self._start_lineage(branch_id, lineage_log)
            self._warn_missing_isolation()
            _OPEN.add(self)
        except BaseException:
            self._teardown(terminate=True)
            self.closed = True
            raise

    # -- construction ---------------------------------------------------------------
    def _init_plumbing(self) -> None:
        self._state = AsyncState.DEFAULT
        self._seq = 0
        self._workers: list[WorkerHandle] = []
        self._slab: Slab | None = None
        self._host: ProcessHost | None = None
        self._slab_fd = -1
        self._lineage: Lineage | None = None
        self._replacement_attach: bytes | None = None
        self._clean_launch: dict[str, Any] | None = None
        self._held: list[tuple[WorkerHandle, bytes]] = []
        self.closed = False

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
        kwargs["envs_per_worker"] = 1
        return cls(
            [env_fn] * num_envs,
            reset_mode=reset_mode,
            _prepare=(warmup, ready_check, seed),
            **kwargs,
        )

    def _new_host(self, prepare_in_sandbox: bool = False):
        """A warm parent of this vector env's host kind for its env_fns."""
        env_fns = self.env_fns[:1] if self._prepare else self.env_fns
        if self.host_kind == "microvm":
            from gym_fork.hosts.microvm.host import MicroVMHost

            return MicroVMHost(
                env_fns,
                prepare=self._prepare,
                prepare_in_sandbox=prepare_in_sandbox,
                isolation=self.isolation_config,
                ring_capacity=self.ring_bytes,
                memory_mb=self.vm_memory_mb,
                slab_mb=self.vm_slab_mb,
            )
        return ProcessHost(
            env_fns,
            prepare=self._prepare,
            prepare_in_sandbox=prepare_in_sandbox,
            isolation=self.isolation_config,
        )

    def _start(self) -> None:
        started = time.perf_counter()
        self._host = self._new_host()
        self._timings = {"parent_ready_s": time.perf_counter() - started}
        self._check_warm_parent_gpu()
        self._slab_fd = os.memfd_create("gym_fork-slab", os.MFD_CLOEXEC)
        groups = [
            list(range(start, min(start + self.envs_per_worker, self.num_envs)))
            for start in range(0, self.num_envs, self.envs_per_worker)
        ]
        cloned = time.perf_counter()
        self._workers = self._spawn([self._spec(indices) for indices in groups])
        hellos = [self._receive_hello(w) for w in self._workers]
        self._timings["sandboxes_ready_s"] = time.perf_counter() - cloned
        self._hellos = hellos

        first = hellos[0]
        metadata = cloudpickle.loads(first["metadata"])
        self.metadata = dict(metadata)
        self.metadata["autoreset_mode"] = self.autoreset_mode
        self.render_mode = first["render_mode"]
        obs_spaces = [s for h in hellos for s in cloudpickle.loads(h["observation_spaces"])]
        self._single_obs_spaces = obs_spaces
        act_spaces = [s for h in hellos for s in cloudpickle.loads(h["action_spaces"])]
        self.single_action_space = act_spaces[0]
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        mode = self.observation_mode
        if isinstance(mode, tuple) and len(mode) == 2:
            if not isinstance(mode[0], Space) or not isinstance(mode[1], Space):
                raise TypeError(
                    "Expected both elements of observation_mode to be Spaces, got "
                    f"{type(mode[0])} and {type(mode[1])}"
                )
            self.observation_space, self.single_observation_space = mode
            check_mode = "custom"
        elif mode == "same":
            self.single_observation_space = obs_spaces[0]
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
            check_mode = "same"
        elif mode == "different":
            self.single_observation_space = obs_spaces[0]
            self.observation_space = batch_differing_spaces(obs_spaces)
            check_mode = "different"
        else:
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
                f"and batch observation space, actual got {mode}"
            )

        if self.shared_memory and not async_shares(self.single_observation_space):
            raise ValueError(
                "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable "
                "this feature with `shared_memory=False` however this is slower. "
                f"(ForkVectorEnv: {self.single_observation_space} has no shared layout.)"
            )
        # Spaces Async shares but that have no fixed-size slab layout (OneOf) travel in
        # ring records: same results, one copy more.
        self._obs_in_slab = (
            self.shared_memory and slab_node(self.single_observation_space, 1) is not None
        )
        self._slab = Slab(
            self.single_observation_space,
            self.single_action_space,
            self.num_envs,
            use_observations=self._obs_in_slab,
            region_fd=self._slab_fd,
            owner=True,
        )
        self._slab_fd = -1  # owned by the slab's region now
        if hasattr(self._host, "check_slab"):
            self._host.check_slab(self._slab.nbytes)
        if self._obs_in_slab:
            self.observations = self._slab.observations.batch()
        else:
            self.observations = create_empty_array(
                self.single_observation_space, n=self.num_envs, fn=np.zeros
            )
        self._step_ints = self._integer_action_leaves() if self.check_actions else []
        checks = self._attach_all(check_mode)
        same_obs = [c[0] for c in checks]
        same_act = [c[1] for c in checks]
        if not all(same_obs):
            if mode == "same":
                raise RuntimeError(
                    "AsyncVectorEnv(..., observation_mode='same') however some of the "
                    "sub-environments observation spaces are not equivalent. If this is "
                    "intentional, use `observation_mode='different'` instead."
                )
            raise RuntimeError(
                "AsyncVectorEnv(..., observation_mode='different' or custom space) however the "
                "sub-environment's observation spaces do not share a common shape and dtype."
            )
        if not all(same_act):
            raise RuntimeError(
                f"Some environments have an action space different from "
                f"`{self.single_action_space}`. In order to batch actions, the action spaces "
                "from all environments must be equal."
            )

    def _spec(self, indices: list[int]) -> WorkerSpec:
        name = f"sub-env {indices[0]}" if len(indices) == 1 else f"sub-envs {indices}"
        return WorkerSpec(name, indices, [self._origins[i] for i in indices])

    def _spawn(self, specs: list[WorkerSpec], attach: bytes | None = None) -> list[WorkerHandle]:
        fd = self._slab_fd if self._slab is None else self._slab.region.fd
        return self._host.spawn(specs, fd, self.ring_bytes, attach)

    def _start_lineage(self, branch_id: str | None, lineage_log) -> None:
        if lineage_log is True:
            lineage_log = default_log_path()
        env_ids = [h.get("spec_id") for h in self._hellos]
        try:
            identity = hashlib.sha256(cloudpickle.dumps(list(self.env_fns))).hexdigest()[:16]
        except Exception:
            identity = "unpicklable"
        config = {
            "num_envs": self.num_envs,
            "autoreset_mode": self.autoreset_mode.value,
            "shared_memory": self.shared_memory,
            "observation_mode": str(self.observation_mode),
            "envs_per_worker": self.envs_per_worker,
            "reset_mode": self.reset_mode,
            "from_parent": self._prepare is not None,
        }
        seed = self._prepare[2] if self._prepare else None
        inputs = baseline_inputs(
            gpu=gpu_probe().provenance(),
            env_identity=identity,
            env_ids=env_ids,
            config=config,
            seed=seed,
            host=self._host.kind,
            isolation=self.isolation,
        )
        tree = LineageTree(LineageLog(lineage_log or None), baseline_id(inputs), inputs)
        branch_id = branch_id or LineageTree.new_root_id()
        tree.check_free(branch_id)
        tree.add(
            BranchRecord(
                branch_id,
                None,
                tree.baseline_id,
                self.num_envs,
                timings=dict(self._timings),
                isolation=self.isolation,
                pids=self.worker_pids,
                gpu_memory_created=self._gpu_memory(),
            )
        )
        self._lineage = Lineage(tree, branch_id)
        if self._clean_launch is not None:
            tree.event(branch_id, "clean_launch", **self._clean_launch)

    def _gpu_memory(self) -> int | None:
        """GPU bytes held by this vector env's sandboxes (NVML), None without NVML."""
        report = gpu_probe()
        if not report.nvml:
            return None
        by_pid = report.processes_by_pid()
        return sum(
            p.used_memory or 0 for w in self._workers for _, p in by_pid.get(host_pid(w.pid), [])
        )

    def stats(self) -> list[dict[str, Any]]:
        """Per sub-env: its sandbox's pid, RSS and PSS (bytes) and GPU memory (bytes, from
        NVML; None without a GPU or when the sandbox holds no CUDA context)."""
        report = gpu_probe()
        by_pid = report.processes_by_pid() if report.nvml else {}
        rows = []
        for worker in self._workers:
            memory = _smaps_rollup(worker.pid)
            gpu = by_pid.get(host_pid(worker.pid))
            gpu_bytes = sum(p.used_memory or 0 for _, p in gpu) if gpu else None
            for index in worker.indices:
                rows.append(
                    {
                        "index": index,
                        "pid": worker.pid,
                        "rss": memory.get("Rss"),
                        "pss": memory.get("Pss"),
                        "gpu_memory": gpu_bytes,
                        "shares_sandbox_with": [i for i in worker.indices if i != index],
                    }
                )
        return sorted(rows, key=lambda r: r["index"])

    @property
    def lineage(self) -> Lineage:
        """Provenance of this vector env: branch id, parent, baseline id, events."""
        return self._lineage

    def _receive_hello(self, worker: WorkerHandle) -> dict[str, Any]:
        _op, _seq, info, errors = self._receive(worker, _Deadline(None), P.HELLO)
        if errors:
            self._raise_errors(errors, building=True)
        worker.info = info
        return info

    def _attach_arg(self, check_mode: str) -> dict[str, Any]:
        return {
            "observation_space": cloudpickle.dumps(self.single_observation_space),
            "action_space": cloudpickle.dumps(self.single_action_space),
            "observation_mode": check_mode,
            "autoreset_mode": self.autoreset_mode.value,
            "num_envs": self.num_envs,
            "shared_memory": self._obs_in_slab,
        }

    def _attach_all(self, check_mode: str) -> list[list[bool]]:
        self._send_same(P.ATTACH, self._attach_arg(check_mode))
        replies = self._collect(None, P.ATTACH)
        return [check for reply in replies for check in reply]

    def _integer_action_leaves(self) -> list[tuple[Any, Any, Any, Any]]:
        """(space, low, high, leaf) of the integer action leaves, for check_actions."""
        from gymnasium import spaces

        out = []
        for leaf in slab_leaves(self._slab.actions):
            space = leaf.space
            if type(space) is spaces.Discrete:
                out.append((space, space.start, space.start + space.n - 1, leaf))
            elif type(space) is spaces.MultiDiscrete:
                out.append((space, space.start, space.start + space.nvec - 1, leaf))
            elif type(space) is spaces.MultiBinary:
                out.append((space, 0, 1, leaf))
        return out

    # -- properties -----------------------------------------------------------------
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
        if self._host is None:
            return {}
        report = self._workers[0].info.get("isolation") if self._workers else None
        achieved = self._host.isolation(report)
        achieved["sub_envs_per_sandbox"] = self.envs_per_worker
        return achieved

    def _warn_missing_isolation(self) -> None:
        """Warn once about layers the host could not give; not about the caller's choices
        (network=True, private_tmp=False, namespaces=False) or the by-design pid layer."""
        config = self.isolation_config
        chosen = {"pid"}
        if config.network:
            chosen.add("net")
        if not config.private_tmp:
            chosen.add("private_tmp")
        if not config.namespaces:
            chosen.add("namespaces")
        missing = {k: v for k, v in self.isolation.get("missing", {}).items() if k not in chosen}
        key = tuple(sorted(missing))
        if key and key not in _WARNED_MISSING:
            _WARNED_MISSING.add(key)
            logger.warn(
                "gym_fork sandboxes run without: "
                + "; ".join(f"{layer} ({why})" for layer, why in sorted(missing.items()))
            )

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker sandboxes, in sub-env order of their first index."""
        return [w.pid for w in self._workers]

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
        if seed is None:
            seed = [None for _ in range(self.num_envs)]
        elif isinstance(seed, int):
            seed = [seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(
                "If seeds are passed as a list the length must match "
                f"num_envs={self.num_envs} but got length={len(seed)}."
            )
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `reset_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete",
                str(self._state.value),
            )
        mask = np.ones(self.num_envs, dtype=np.bool_)
        if options is not None and "reset_mask" in options:
            options = dict(options)
            reset_mask = options.pop("reset_mask")
            if not isinstance(reset_mask, np.ndarray):
                raise TypeError(
                    f"`options['reset_mask']` must be a numpy array, got {type(reset_mask)}"
                )
            if reset_mask.shape != (self.num_envs,):
                raise ValueError(
                    f"`options['reset_mask']` must have shape `({self.num_envs},)`, "
                    f"got {reset_mask.shape}"
                )
            if reset_mask.dtype != np.bool_:
                raise TypeError(
                    f"`options['reset_mask']` must have `dtype=np.bool_`, got {reset_mask.dtype}"
                )
            if not np.any(reset_mask):
                raise ValueError(
                    "`options['reset_mask']` must contain a boolean array with at least one "
                    f"True value, got reset_mask={reset_mask}"
                )
            mask = reset_mask
        self._replace_dead_workers()
        if self.reset_mode == "clone":
            self._replace_workers(
                [k for k, w in enumerate(self._workers) if all(mask[i] for i in w.indices)],
                "reset_by_clone",
            )
        args = [[[seed[i], options, bool(mask[i])] for i in w.indices] for w in self._workers]
        self._send_all(P.RESET, args)
        self._state = AsyncState.WAITING_RESET

    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Wait for the resets sent by :meth:`reset_async` and return (obs, infos)."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_RESET:
            raise NoAsyncCallError(
                "Calling `reset_wait` without any prior call to `reset_async`.",
                AsyncState.WAITING_RESET.value,
            )
        replies = self._collect_or_timeout(timeout, P.RESET, "reset_wait")
        infos: dict[str, Any] = {}
        observations = [] if not self._obs_in_slab else None
        for worker, (obs_list, info_list) in zip(self._workers, replies, strict=True):
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
        """Write the actions to the slab and wake the workers."""
        self._assert_is_running()
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `step_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        # A dead worker is noticed by the wait (every _LIVENESS_SLICE), not here: a
        # liveness syscall per worker per step would cost more than the step itself.
        slab_actions = self._slab.actions
        if slab_actions is not None and slab_actions.accepts(actions):
            # Fast path: an exact batch goes into the slab. Anything else (lists, other
            # dtypes) travels per sub-env, so each env sees what AsyncVectorEnv would pass.
            slab_actions.write_batch(actions)
            for space, low, high, leaf in self._step_ints:
                values = leaf.array
                if np.any(values < low) or np.any(values > high):
                    bad = np.flatnonzero(
                        np.any((values < low) | (values > high), axis=tuple(range(1, values.ndim)))
                    )
                    raise BadActionError(
                        f"actions for sub-envs {bad.tolist()} are outside {space}: "
                        f"{values[bad].tolist()}"
                    )
            self._send_same(P.STEP, None)
        else:
            expected = self.action_space.shape
            if (
                isinstance(actions, np.ndarray)
                and expected is not None
                and (actions.ndim != len(expected) or actions.shape[:1] != (self.num_envs,))
            ):
                raise BadActionError(
                    f"expected a batch of actions of shape {expected} for "
                    f"{self.action_space}, got an array of shape {actions.shape}"
                )
            try:
                per_env = list(iterate(self.action_space, actions))
            except (TypeError, ValueError, KeyError) as exc:
                raise BadActionError(
                    f"actions do not fit the batched action space {self.action_space}: {exc}"
                ) from exc
            if len(per_env) != self.num_envs:
                raise BadActionError(
                    f"expected {self.num_envs} actions (one per sub-env), got {len(per_env)}"
                )
            if self.check_actions:
                for i, action in enumerate(per_env):
                    if not self.single_action_space.contains(action):
                        raise BadActionError(
                            f"action for sub-env {i} is outside {self.single_action_space}: "
                            f"{action!r}"
                        )
            self._send_all(P.STEP, [[per_env[i] for i in w.indices] for w in self._workers])
        self._state = AsyncState.WAITING_STEP

    def step_wait(self, timeout: float | None = None):
        """Wait for the steps sent by :meth:`step_async` and return their batched results."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "Calling `step_wait` without any prior call to `step_async`.",
                AsyncState.WAITING_STEP.value,
            )
        replies = self._collect_or_timeout(timeout, P.STEP, "step_wait")
        infos: dict[str, Any] = {}
        observations = [] if not self._obs_in_slab else None
        for worker, (obs_list, info_list) in zip(self._workers, replies, strict=True):
            if info_list is not None:
                for k, index in enumerate(worker.indices):
                    infos = self._add_info(infos, info_list[k], index)
            if observations is not None:
                observations.extend(obs_list)
        if observations is not None:
            self.observations = concatenate(
                self.single_observation_space, observations, self.observations
            )
        slab = self._slab
        return (
            self._observations_out(),
            slab.rewards.copy(),
            slab.terminations.copy(),
            slab.truncations.copy(),
            infos,
        )

    # -- call / attributes ----------------------------------------------------------
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
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `call_async` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._send_same(P.CALL, [name, args, kwargs])
        self._state = AsyncState.WAITING_CALL

    def call_wait(self, timeout: float | None = None) -> tuple[Any, ...]:
        """Wait for the calls sent by :meth:`call_async`; results in sub-env order."""
        self._assert_is_running()
        if self._state != AsyncState.WAITING_CALL:
            raise NoAsyncCallError(
                "Calling `call_wait` without any prior call to `call_async`.",
                AsyncState.WAITING_CALL.value,
            )
        replies = self._collect_or_timeout(timeout, P.CALL, "call_wait")
        return tuple(value for reply in replies for value in reply)

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Get an attribute of every sub-env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | object) -> None:
        """Set an attribute of every sub-env (one value each, or the same for all)."""
        self._assert_is_running()
        if not isinstance(values, list | tuple):
            values = [values for _ in range(self.num_envs)]
        if len(values) != self.num_envs:
            raise ValueError(
                "Values must be a list or tuple with length equal to the number of "
                f"environments. Got `{len(values)}` values for {self.num_envs} environments."
            )
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `set_attr` while waiting for a pending call to "
                f"`{self._state.value}` to complete.",
                str(self._state.value),
            )
        self._send_all(P.SETATTR, [[name, [values[i] for i in w.indices]] for w in self._workers])
        self._state = AsyncState.WAITING_CALL
        self._collect_or_timeout(None, P.SETATTR, "set_attr")

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
        gpu_at_close = self._gpu_memory() if self._lineage is not None else None
        workers, self._workers = self._workers, []
        if not terminate:
            live = [w for w in workers if w.alive()]
            try:
                for w in live:
                    self._send(w, P.CLOSE, None)
                deadline = _Deadline(timeout)
                for w in live:
                    self._receive(w, deadline, P.CLOSE)
            except (multiprocessing.TimeoutError, _WaitTimeout, SubEnvCrashed, OSError):
                pass
            except Exception as exc:
                logger.warn(f"Error while closing the sub-envs: {exc!r}")
        for w in workers:
            w.watch.kill()
            w.watch.wait_dead(1.0)
            w.release()
        if self._host is not None:
            self._host.release()  # the last user of the warm parent closes it
            self._host = None
        if self._slab is not None:
            self.observations = None
            self._slab.close()
            self._slab = None
        if self._slab_fd >= 0:
            os.close(self._slab_fd)
            self._slab_fd = -1
        if self._lineage is not None:
            self._lineage.tree.close(
                self._lineage.branch_id,
                "terminated" if terminate else "closed",
                gpu_memory=gpu_at_close,
            )

    def __del__(self) -> None:
        """On deleting the object, checks that the vector environment is closed."""
        if not getattr(self, "closed", True) and hasattr(self, "_state"):
            self.close(terminate=True)

    # -- plumbing -------------------------------------------------------------------
    def _observations_out(self) -> Any:
        if self._obs_in_slab:
            node = self._slab.observations
            self.observations = node.batch()
        if not self.copy:
            return self.observations
        obs = self.observations
        return obs.copy() if type(obs) is np.ndarray else copy_module.deepcopy(obs)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _send(self, worker: WorkerHandle, op: int, arg: Any) -> None:
        seq = self._next_seq()
        worker.channel.send([op, seq, arg])
        worker.awaiting = seq

    def _send_same(self, op: int, arg: Any) -> None:
        seq = self._next_seq()
        record = pack([op, seq, arg])
        self._dispatch(op, seq, [record] * len(self._workers))

    def _send_all(self, op: int, args: list[Any]) -> None:
        seq = self._next_seq()
        self._dispatch(op, seq, [pack([op, seq, arg]) for arg in args])

    def _dispatch(self, op: int, seq: int, records: list[bytes]) -> None:
        """Send one record per worker; with ``max_concurrency``, resets and steps beyond
        the limit wait in ``_held`` and go out as earlier sub-envs answer (_collect)."""
        self._held = []
        budget = None
        if self.max_concurrency is not None and op in (P.RESET, P.STEP):
            budget = self.max_concurrency
        running = 0
        for worker, record in zip(self._workers, records, strict=True):
            worker.awaiting = seq
            if budget is None or running == 0 or running + len(worker.indices) <= budget:
                worker.channel.send_raw(record)
                running += len(worker.indices)
            else:
                self._held.append((worker, record))

    def _release_held(self) -> None:
        if self._held:
            worker, record = self._held.pop(0)
            worker.channel.send_raw(record)

    def _receive(self, worker: WorkerHandle, deadline: _Deadline, op: int) -> list[Any]:
        """The reply ``worker`` owes for ``op``; earlier, abandoned replies are dropped."""
        inbox = worker.channel
        while True:
            try:
                reply = inbox.recv(deadline.slice())
            except RingTimeout:
                if not worker.alive():
                    raise self._crashed(worker, f"during {P.NAMES[op]}") from None
                if deadline.expired():
                    raise _WaitTimeout from None
                continue
            except TransportError as exc:
                raise self._corrupted(worker, exc) from exc
            if not (type(reply) is list and len(reply) == 4 and type(reply[1]) is int):
                raise self._corrupted(
                    worker, TransportError(f"malformed reply {reply!r:.80}", reason="shape")
                )
            if op == P.HELLO or reply[1] == worker.awaiting:
                worker.awaiting = 0
                return reply

    def _corrupted(self, worker: WorkerHandle, exc: TransportError) -> TransportError:
        """A sandbox wrote bytes that are not a valid reply: it cannot be trusted any
        more; kill it (reset() replaces it) and name it."""
        worker.watch.kill()
        worker.dead = True
        error = TransportError(
            f"sub-env(s) {worker.indices} (pid {worker.pid}) sent a corrupt record and were "
            f"killed; call reset() to replace them. {exc}",
            worker=worker.name,
            reason=getattr(exc, "reason", ""),
        )
        error.indices = worker.indices
        return error

    def _collect(self, timeout: float | None, op: int) -> list[Any]:
        deadline = _Deadline(timeout)
        results, errors = [], []
        for worker in self._workers:
            try:
                _op, _seq, result, worker_errors = self._receive(worker, deadline, op)
            except BaseException:
                for held, _record in self._held:  # never sent: nothing to wait for
                    held.awaiting = 0
                self._held = []
                raise
            self._release_held()
            results.append(result)
            if worker_errors:
                errors.extend(worker_errors)
        if errors:
            self._raise_errors(errors)
        return results

    def _collect_or_timeout(self, timeout: float | None, op: int, what: str) -> list[Any]:
        sandbox_deadline = timeout is None and self.timeout is not None
        try:
            return self._collect(self.timeout if sandbox_deadline else timeout, op)
        except _WaitTimeout:
            if sandbox_deadline:
                raise self._kill_hung(op, what) from None
            raise multiprocessing.TimeoutError(
                f"The call to `{what}` has timed out after {timeout} second(s)."
            ) from None
        finally:
            self._state = AsyncState.DEFAULT

    def _kill_hung(self, op: int, what: str) -> SubEnvTimeout:
        """The vector env's own ``timeout`` passed: kill the sandboxes that did not answer."""
        hung = []
        for worker in self._workers:
            if not worker.awaiting:
                continue
            try:
                self._receive(worker, _Deadline(0), op)  # answered just now?
            except (_WaitTimeout, SubEnvCrashed):
                hung.append(worker)
        for worker in hung:
            worker.watch.kill()
        details = []
        for worker in hung:
            worker.watch.wait_dead(1.0)
            details.append(self._crashed(worker, f"during {what}").args[0])
        return SubEnvTimeout(
            f"{what} took longer than timeout={self.timeout} s; the sandboxes that did not "
            f"answer were killed:\n" + "\n".join(details),
            indices=[i for w in hung for i in w.indices],
            pid=hung[0].pid if hung else None,
            exitcode=-signal.SIGKILL,
        )

    def _crashed(self, worker: WorkerHandle, when: str) -> SubEnvCrashed:
        worker.dead = True
        code = self._host.exit_code(worker.pid) if self._host is not None else None
        branch = self._lineage.branch_id if self._lineage is not None else "?"
        tail = worker.output_tail("stderr").rstrip().splitlines()[-STDERR_LINES:]
        stderr = "\n".join("    " + line for line in tail) if tail else "    (nothing)"
        error = SubEnvCrashed(
            f"the sandbox of sub-env(s) {worker.indices} of branch {branch!r} "
            f"(pid {worker.pid}) died {when}: {describe_status(code)}. Call reset() to "
            f"replace it with a fresh sandbox. Its last stderr lines:\n{stderr}",
            indices=worker.indices,
            pid=worker.pid,
            exitcode=code,
        )
        error.stderr_tail = "\n".join(tail)
        return error

    def sandbox_output(self, index: int, stream: str = "stderr") -> str:
        """The last output (at most 64 KiB) of the sandbox hosting sub-env ``index``."""
        for worker in self._workers:
            if index in worker.indices:
                return worker.output_tail(stream)
        raise IndexError(f"no sub-env {index} in a vector env of {self.num_envs}")

    def _replace_workers(self, positions: list[int], why: str) -> None:
        """Fork fresh sandboxes from the warm parent for the workers at ``positions``."""
        if not positions:
            return
        old = [self._workers[k] for k in positions]
        for worker in old:
            worker.watch.kill()
        old_host = self._ensure_warm_parent()
        if getattr(self, "_replacement_attach", None) is None:
            # Pickled once: the warm parent unpickles it once too, then shares it.
            self._replacement_attach = cloudpickle.dumps(self._attach_arg("custom"))
        fresh = self._spawn([self._spec(w.indices) for w in old], self._replacement_attach)
        for k, worker in zip(positions, fresh, strict=True):
            self._workers[k] = worker
        for worker in old:
            worker.watch.wait_dead(1.0)
            worker.release()
        if old_host is not None:
            old_host.release()
        for worker in fresh:
            self._receive_hello(worker)
        if self._lineage is not None and why != "reset_by_clone":  # resets would flood the log
            self._lineage.tree.event(
                self._lineage.branch_id,
                why,
                indices=[i for w in old for i in w.indices],
                old_pids=[w.pid for w in old],
                new_pids=[w.pid for w in fresh],
            )

    def _check_warm_parent_gpu(self) -> None:
        """Before cloning the warm parent: does it hold a CUDA context? (Checked once per
        warm parent: it only forks after it is ready, so its state does not change.)
        A microVM has no GPU: nothing to check."""
        if self._host.kind != "process":
            return
        evidence = cuda_evidence(self._host.pid, gpu_probe())
        if not evidence:
            return
        if self.gpu_fork_policy == "refuse":
            raise ForkUnsafeError(
                f"the warm parent (pid {self._host.pid}) holds a CUDA context, which does not "
                f"survive fork: {'; '.join(evidence)}. Keep CUDA out of env_fn/warmup (build "
                "on CPU, or initialise the GPU after the fork), keep GPU work in the "
                "controller, or pass gpu_fork_policy='clean' to build each sandbox cold.",
                pid=self._host.pid,
                evidence=evidence,
            )
        # "clean": a warm parent that only imports; every sandbox builds (and warms) its
        # own env from the env_fn, i.e. a cold start that keeps the reset promise.
        tainted = self._host
        self._host = self._new_host(prepare_in_sandbox=True)
        tainted.release()
        self._clean_launch = {"reason": "warm parent holds CUDA", "evidence": evidence}

    def _ensure_warm_parent(self) -> ProcessHost | None:
        """Health check: a dead warm parent is replaced by a cold launch of the env_fns
        (the prepared state is rebuilt from scratch), recorded in the lineage. Returns
        the dead host, for the caller to release once its sandboxes are released."""
        if self._host.alive():
            return None
        old = self._host
        self._host = self._new_host()
        self._replacement_attach = None
        if self._lineage is not None:
            self._lineage.tree.event(
                self._lineage.branch_id,
                "replaced_warm_parent",
                old_pid=old.pid,
                new_pid=self._host.pid,
            )
        return old

    def _replace_dead_workers(self) -> None:
        dead = [k for k, w in enumerate(self._workers) if not w.alive()]
        self._replace_workers(dead, "replaced_dead_sandbox")

    def _send_to(self, workers: list[WorkerHandle], op: int, arg: Any) -> None:
        seq = self._next_seq()
        record = pack([op, seq, arg])
        for worker in workers:
            worker.channel.send_raw(record)
            worker.awaiting = seq

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
        if self._state != AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"Calling `fork` while waiting for a pending call to `{self._state.value}` "
                "to complete.",
                str(self._state.value),
            )
        self._lineage.tree.check_free(branch_id)
        indices = list(range(self.num_envs)) if indices is None else [int(i) for i in indices]
        if not indices or any(not 0 <= i < self.num_envs for i in indices):
            raise ValueError(f"fork indices must be in [0, {self.num_envs}), got {indices}")
        if not isinstance(copies, int) or copies < 1:
            raise ValueError(f"copies must be an int >= 1, got {copies!r}")
        sources = [i for i in indices for _ in range(copies)]
        n = len(sources)
        if reseed is None:
            seeds: list[int | None] = [None] * n
        elif isinstance(reseed, int | np.integer):
            seeds = [int(reseed) + j for j in range(n)]
        else:
            seeds = list(reseed)
            if len(seeds) != n:
                raise ValueError(
                    f"reseed needs one seed per branch sub-env ({n}), got {len(seeds)}"
                )
        involved = [w for w in self._workers if any(i in w.indices for i in indices)]
        dead = [w for w in involved if not w.alive()]
        if dead:
            raise self._crashed(dead[0], "before fork")
        report = gpu_probe()
        for worker in involved:
            evidence = cuda_evidence(worker.pid, report)
            if evidence:
                raise ForkUnsafeError(
                    f"sub-env(s) {worker.indices} (pid {worker.pid}) hold a CUDA context, "
                    f"which does not survive fork: {'; '.join(evidence)}. A live fork of "
                    "mid-episode state cannot fall back to a clean launch.",
                    pid=worker.pid,
                    evidence=evidence,
                )
        started = time.perf_counter()
        branch = ForkVectorEnv.__new__(ForkVectorEnv)
        branch._init_branch(self, sources)
        try:
            branch._clone_from(self, sources, seeds, branch_id)
        except BaseException:
            branch._teardown(terminate=True)
            branch.closed = True
            raise
        elapsed = time.perf_counter() - started
        tree = self._lineage.tree
        tree.add(
            BranchRecord(
                branch_id,
                self._lineage.branch_id,
                tree.baseline_id,
                n,
                source_indices=indices,
                copies=copies,
                seeds=seeds,
                timings={"fork_s": elapsed},
                isolation=branch.isolation,
                pids=branch.worker_pids,
                gpu_memory_created=branch._gpu_memory(),
            )
        )
        branch._lineage = Lineage(tree, branch_id)
        _OPEN.add(branch)
        return branch

    def _init_branch(self, source: ForkVectorEnv, sources: list[int]) -> None:
        for name in (
            "env_fns",
            "shared_memory",
            "copy",
            "context",
            "daemon",
            "worker",
            "observation_mode",
            "autoreset_mode",
            "max_concurrency",
            "ring_bytes",
            "check_actions",
            "reset_mode",
            "isolation_config",
            "timeout",
            "gpu_fork_policy",
            "host_kind",
            "vm_memory_mb",
            "vm_slab_mb",
            "metadata",
            "render_mode",
            "single_action_space",
            "single_observation_space",
            "_prepare",
            "_obs_in_slab",
        ):
            setattr(self, name, getattr(source, name))
        self._init_plumbing()
        self.num_envs = len(sources)
        self.envs_per_worker = 1
        self._origins = [source._origins[i] for i in sources]
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._single_obs_spaces = [source._single_obs_spaces[i] for i in sources]
        if self.observation_mode == "different":
            self.observation_space = batch_differing_spaces(self._single_obs_spaces)
        elif isinstance(self.observation_mode, tuple):
            self.observation_space = source.observation_space  # custom: as given
        else:
            self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self._host = source._host.acquire()
        self._slab = Slab(
            self.single_observation_space,
            self.single_action_space,
            self.num_envs,
            use_observations=self._obs_in_slab,
            region_fd=os.memfd_create("gym_fork-slab", os.MFD_CLOEXEC),
            owner=True,
        )
        self._step_ints = self._integer_action_leaves() if self.check_actions else []
        # The branch starts where its sources are: their last results, row by row.
        theirs, mine = source._slab, self._slab
        for j, i in enumerate(sources):
            mine.rewards[j] = theirs.rewards[i]
            mine.terminations[j] = theirs.terminations[i]
            mine.truncations[j] = theirs.truncations[i]
            if self._obs_in_slab:
                mine.observations.write(j, theirs.observations.read(i))
        if self._obs_in_slab:
            self.observations = mine.observations.batch()
        else:
            rows = list(iterate(source.observation_space, source.observations))
            self.observations = concatenate(
                self.single_observation_space,
                [rows[i] for i in sources],
                create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros),
            )

    def _clone_from(
        self, source: ForkVectorEnv, sources: list[int], seeds: list[int | None], branch_id: str
    ) -> None:
        plan: dict[int, list[int]] = {}  # source worker position -> branch indices
        where = {i: k for k, w in enumerate(source._workers) for i in w.indices}
        for j, i in enumerate(sources):
            plan.setdefault(where[i], []).append(j)
        handles: dict[int, WorkerHandle] = {}
        for k, branch_indices in plan.items():
            for start in range(0, len(branch_indices), SPAWN_BATCH):
                chunk = branch_indices[start : start + SPAWN_BATCH]
                for j, handle in zip(
                    chunk,
                    self._fork_chunk(source, k, chunk, sources, seeds, branch_id),
                    strict=True,
                ):
                    handles[j] = handle
        self._workers = [handles[j] for j in range(self.num_envs)]
        for worker in self._workers:
            worker.info = self._receive(worker, _Deadline(None), P.HELLO)[2]

    def _fork_chunk(self, source, position, branch_indices, sources, seeds, branch_id):
        """Ask one source worker (a process host) or the host (a VM) for the clones."""
        worker = source._workers[position]
        specs = [
            WorkerSpec(f"{branch_id} sub-env {j}", [j], [self._origins[j]]) for j in branch_indices
        ]
        if self._host.kind == "microvm":
            self._host.check_slab(self._slab.nbytes)
            return self._host.fork(
                worker,
                [
                    (spec, sources[j], j, seeds[j])
                    for spec, j in zip(specs, branch_indices, strict=True)
                ],
                self.num_envs,
                self._slab.region.fd,
                self.ring_bytes,
            )
        ends = [SandboxEnds(spec, self.ring_bytes, self._host.output) for spec in specs]
        fds = [self._slab.region.fd]
        for end in ends:
            fds += end.fds()
        clones = [
            [sources[j], j, seeds[j], spec.name]
            for j, spec in zip(branch_indices, specs, strict=True)
        ]

        def exchange() -> list[Any]:
            send_message(worker.sock, {"op": "fork"}, fds=tuple(fds))
            source._send(
                worker,
                P.FORK,
                {"clones": clones, "num_envs": self.num_envs, "ring_capacity": self.ring_bytes},
            )
            return source._receive(worker, _Deadline(None), P.FORK)

        _op, _seq, pids, errors = hand_over(ends, exchange)
        if errors:
            for end in ends:
                end.abort()
            source._raise_errors(errors)
        return [end.handle(pid) for end, pid in zip(ends, pids, strict=True)]

    def _raise_errors(self, errors: list[list[Any]], building: bool = False) -> None:
        errors = sorted(errors, key=lambda e: e[0])
        self._state = AsyncState.DEFAULT
        exc: BaseException | None = None
        for index, pickled, type_name, message, trace in errors:
            logger.error(f"Received the following error from Worker-{index} - Shutting it down")
            logger.error(f"{trace}")
            exc = None
            if pickled is not None:
                try:
                    exc = cloudpickle.loads(pickled)
                except Exception:
                    exc = None
            if not isinstance(exc, BaseException):
                exc = RuntimeError(f"{type_name}: {message}")
            what = "while building" if building else "in"
            exc.add_note(
                f"[gym_fork] raised {what} sub-env {index}; the worker's traceback:\n{trace}"
            )
            exc.gym_fork_index = index
        logger.error("Raising the last exception back to the main process.")
        raise exc

    def _assert_is_running(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError(
                f"Trying to operate on `{type(self).__name__}`, after a call to `close()`."
            )

    def __repr__(self) -> str:
        """Same form as AsyncVectorEnv's repr."""
        return VectorEnv.__repr__(self)


def _smaps_rollup(pid: int) -> dict[str, int]:
    """Rss/Pss/... of a process in bytes (empty if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def auto_envs_per_worker(num_envs: int) -> int:
    """1 while cores suffice, else one worker per core with sub-envs spread evenly."""
    cores = len(os.sched_getaffinity(0)) or 1
    return max(1, math.ceil(num_envs / cores))
