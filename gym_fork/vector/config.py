"""Every option of a ForkVectorEnv, validated once, before anything starts."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from gymnasium import Space
from gymnasium.vector import AutoresetMode

from gym_fork import knobs
from gym_fork.hosts.base import (
    DEFAULT_VM_MEMORY_MB,
    DEFAULT_VM_SLAB_MB,
    HOST_KINDS,
    HostConfig,
    PrepareRecipe,
)
from gym_fork.system import environment, identity
from gym_fork.system import paths as no_follow
from gym_fork.system.isolation import IsolationConfig, SandboxLimits
from gym_fork.transport.channel import DEFAULT_RING_BYTES

# Sandboxes one controller may hold at once (all its vector envs and branches), unless
# GYM_FORK_MAX_SANDBOXES says otherwise: a typo such as copies=10**9 is refused before
# anything is allocated.
DEFAULT_MAX_SANDBOXES = int(knobs.BY_NAME["GYM_FORK_MAX_SANDBOXES"].default)

# Seconds a warm parent may take to start (interpreter, imports) on top of ``timeout``.
STARTUP_ALLOWANCE = 10.0


def max_sandboxes() -> int:
    """The ceiling on sandboxes per controller (GYM_FORK_MAX_SANDBOXES)."""
    return int(knobs.read("GYM_FORK_MAX_SANDBOXES") or DEFAULT_MAX_SANDBOXES)


def trusted_from_environment() -> bool:
    """``trusted``'s default: False unless GYM_FORK_TRUSTED says 1/true/yes/on."""
    value = knobs.read("GYM_FORK_TRUSTED").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"GYM_FORK_TRUSTED must be 1/true/yes/on or 0/false/no/off, got {value!r}")


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) or 1


def auto_envs_per_worker(num_envs: int, reset_mode: str = "in_place") -> int:
    """Sub-envs per worker for ``envs_per_worker="auto"``.

    More sub-envs than cores: one worker per core, sub-envs spread evenly; otherwise one
    per worker. ``reset_mode="clone"`` needs one per worker. The grouping never changes
    while the env runs: ``gym_fork.autotune`` measures the alternatives for a given env
    and recommends one.
    """
    if reset_mode == "clone":
        return 1
    return max(1, math.ceil(num_envs / available_cores()))


ISOLATION_POLICIES = ("report", "strict")


@dataclass(frozen=True)
class VectorConfig:
    """The options of one vector env (a branch gets ``for_branch``'s copy)."""

    env_fns: tuple[Callable, ...]
    num_envs: int
    shared_memory: bool = True
    copy: bool = True
    context: str | None = None
    daemon: bool = True
    observation_mode: str | Space | tuple[Space, Space] = "same"
    autoreset_mode: AutoresetMode = AutoresetMode.NEXT_STEP
    max_concurrency: int | None = None
    envs_per_worker: int = 1
    batch_size: int | None = None  # send/recv: sub-envs per recv (EnvPool's batch mode)
    ring_bytes: int = DEFAULT_RING_BYTES
    check_actions: bool = False
    reset_mode: str = "in_place"
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    timeout: float | None = None
    gpu_fork_policy: str = "refuse"
    host: str = "process"
    vm_memory_mb: int = DEFAULT_VM_MEMORY_MB
    vm_slab_mb: int = DEFAULT_VM_SLAB_MB
    trusted: bool = False
    prepare: PrepareRecipe | None = None
    origins: tuple[int, ...] = ()  # per sub-env: the env_fn it is built from
    # "strict": a sandbox missing an isolation layer is refused (IsolationMissing).
    isolation_policy: str = "report"

    @classmethod
    def from_arguments(
        cls,
        env_fns: Sequence[Callable],
        *,
        worker: Callable | None = None,
        autoreset_mode: str | AutoresetMode = AutoresetMode.NEXT_STEP,
        max_concurrency: int | None = None,
        envs_per_worker: int | str = "auto",
        batch_size: int | None = None,
        ring_bytes: int = DEFAULT_RING_BYTES,
        reset_mode: str = "in_place",
        gpu_fork_policy: str = "refuse",
        host: str | None = None,
        timeout: float | None = None,
        trusted: bool | None = None,
        namespaces: bool = True,
        network: bool = False,
        private_tmp: bool = True,
        limits: SandboxLimits | None = None,
        prepare: PrepareRecipe | None = None,
        writable_paths: Sequence[str | os.PathLike] = (),
        tmpfs_bytes: int | None = None,
        sandbox_user: str = "auto",
        pass_env: Sequence[str] | bool = (),
        isolation: str = "report",
        **plain: Any,
    ) -> VectorConfig:
        """Check every constructor argument; raise ValueError/TypeError naming the bad one.
        The defaults are ForkVectorEnv's; ``plain`` are the fields taken as they are
        (shared_memory, copy, context, daemon, observation_mode, check_actions, vm_*).
        The sandbox ceiling is checked where sandboxes are made (``Sandboxes.start``)."""
        unknown = set(plain) - _PLAIN_FIELDS
        if unknown:
            raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        if worker is not None:
            raise ValueError(
                "ForkVectorEnv does not run custom pipe-based `worker` functions: its workers "
                "speak over shared-memory rings. Use gymnasium.vector.AsyncVectorEnv for a "
                "custom worker."
            )
        check_env_fns(env_fns)
        num_envs = len(env_fns)
        if max_concurrency is not None:
            if not isinstance(max_concurrency, int | np.integer):
                raise ValueError(
                    f"`max_concurrency` must be an integer or None, got {type(max_concurrency)}."
                )
            if max_concurrency < 1:
                raise ValueError(
                    f"`max_concurrency` must be a positive or None, got {max_concurrency}."
                )
        host = host or knobs.read("GYM_FORK_HOST") or "process"
        if batch_size is not None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer):
                raise TypeError(f"`batch_size` must be an int or None, got {batch_size!r}")
            if not 1 <= batch_size <= num_envs:
                raise ValueError(
                    f"`batch_size` must be in 1..{num_envs} (the number of sub-envs), "
                    f"got {batch_size}"
                )
            batch_size = int(batch_size)
            if envs_per_worker not in ("auto", 1):
                raise ValueError(
                    "batch_size (send/recv) needs one sandbox per sub-env: leave "
                    f"envs_per_worker at 'auto' or 1, got {envs_per_worker!r}"
                )
            envs_per_worker = 1
        if envs_per_worker == "auto":
            envs_per_worker = auto_envs_per_worker(num_envs, reset_mode)
        if (
            isinstance(envs_per_worker, bool)
            or not isinstance(envs_per_worker, int)
            or envs_per_worker < 1
        ):
            raise ValueError(
                f"`envs_per_worker` must be 'auto' or an int >= 1, got {envs_per_worker!r}"
            )
        if not isinstance(ring_bytes, int) or ring_bytes < 4096 or ring_bytes & (ring_bytes - 1):
            raise ValueError(f"`ring_bytes` must be a power of two >= 4096, got {ring_bytes}")
        if reset_mode not in ("in_place", "clone"):
            raise ValueError(f"`reset_mode` must be 'in_place' or 'clone', got {reset_mode!r}")
        if reset_mode == "clone" and envs_per_worker != 1:
            raise ValueError("reset_mode='clone' needs one sandbox per sub-env: envs_per_worker=1")
        if gpu_fork_policy not in ("refuse", "clean"):
            raise ValueError(
                f"gpu_fork_policy must be 'refuse' or 'clean', got {gpu_fork_policy!r}"
            )
        if host not in HOST_KINDS:
            raise ValueError(f"`host` must be one of {sorted(HOST_KINDS)}, got {host!r}")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0
        ):
            raise ValueError(f"`timeout` must be a positive number of seconds, got {timeout!r}")
        if sandbox_user not in identity.CHOICES:
            raise ValueError(
                f"`sandbox_user` must be one of {identity.CHOICES}, got {sandbox_user!r}"
            )
        if isolation not in ISOLATION_POLICIES:
            raise ValueError(
                f"`isolation` must be 'report' (warn about a missing layer) or 'strict' "
                f"(refuse to run without every layer), got {isolation!r}"
            )
        if trusted is None:
            # Nothing a sandbox sends is unpickled unless the user says so (on every host):
            # unpickling runs code, e.g. an exception raised in a sub-env's step.
            trusted = trusted_from_environment()
        return cls(
            env_fns=tuple(env_fns),
            num_envs=num_envs,
            autoreset_mode=autoreset_mode
            if isinstance(autoreset_mode, AutoresetMode)
            else AutoresetMode(autoreset_mode),
            max_concurrency=max_concurrency,
            envs_per_worker=envs_per_worker,
            batch_size=batch_size,
            ring_bytes=ring_bytes,
            reset_mode=reset_mode,
            gpu_fork_policy=gpu_fork_policy,
            host=host,
            timeout=timeout,
            trusted=bool(trusted),
            isolation=IsolationConfig(
                namespaces=namespaces,
                network=network,
                private_tmp=private_tmp,
                limits=limits or SandboxLimits(),
                writable_paths=checked_writable_paths(writable_paths),
                tmpfs_bytes=checked_tmpfs_bytes(tmpfs_bytes),
                sandbox_user=sandbox_user,
                pass_env=environment.check_pass_env(pass_env),
            ),
            isolation_policy=isolation,
            prepare=prepare,
            origins=tuple(range(num_envs)) if prepare is None else (0,) * num_envs,
            **plain,
        )

    def for_branch(self, sources: Sequence[int]) -> VectorConfig:
        """The config of a branch whose sub-env j continues this env's ``sources[j]``."""
        return replace(
            self,
            num_envs=len(sources),
            envs_per_worker=1,
            batch_size=None if self.batch_size is None else min(self.batch_size, len(sources)),
            origins=tuple(self.origins[i] for i in sources),
        )

    def host_config(self, *, clean_launch: bool = False) -> HostConfig:
        """What the host needs to start this vector env's warm parent."""
        return HostConfig(
            kind=self.host,
            env_fns=self.env_fns[:1] if self.prepare else self.env_fns,
            prepare=self.prepare,
            clean_launch=clean_launch,
            isolation=self.isolation,
            ring_capacity=self.ring_bytes,
            vm_memory_mb=self.vm_memory_mb,
            vm_slab_mb=self.vm_slab_mb,
            # A warm parent first starts an interpreter and imports what the env_fns
            # need: the vector env's timeout bounds the user's code, plus this allowance.
            start_timeout=None if self.timeout is None else self.timeout + STARTUP_ALLOWANCE,
            trusted=self.trusted,
        )

    def worker_groups(self) -> list[list[int]]:
        """The sub-env indices of each worker sandbox."""
        step = self.envs_per_worker
        return [
            list(range(start, min(start + step, self.num_envs)))
            for start in range(0, self.num_envs, step)
        ]


def check_parent_count(num_envs: Any, kwargs: dict[str, Any]) -> int:
    """``from_parent``'s ``num_envs`` as an int >= 1; one sandbox per sub-env."""
    if kwargs.get("envs_per_worker", 1) != 1:
        raise ValueError("from_parent clones one sandbox per sub-env: envs_per_worker=1")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int | np.integer):
        raise TypeError(f"num_envs must be an int, got {num_envs!r}")
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    kwargs["envs_per_worker"] = 1
    return int(num_envs)


def check_sandbox_count(count: int, what: str) -> None:
    """Refuse more sandboxes than the per-controller ceiling allows, before allocating."""
    ceiling = max_sandboxes()
    if count > ceiling:
        raise ValueError(
            f"{what} asks for {count} sandboxes; the ceiling is {ceiling} per controller "
            "(set GYM_FORK_MAX_SANDBOXES to raise it)"
        )


def checked_writable_paths(paths: Sequence[str | os.PathLike]) -> tuple[str, ...]:
    """``writable_paths`` as absolute, existing directories, made absolute against the
    caller's working directory and reached through no symlink, by the rule the warm
    parent binds them by (a sandbox never chooses where a writable bind goes: a symlink
    in the path may be one it planted)."""
    if isinstance(paths, str | bytes | os.PathLike):
        raise TypeError(f"`writable_paths` must be a list of directories, got {paths!r}")
    checked = []
    for path in paths:
        if not isinstance(path, str | os.PathLike):
            raise TypeError(f"`writable_paths` entries must be paths, got {path!r}")
        absolute = no_follow.absolute(path)
        if absolute == "/":
            raise ValueError("`writable_paths` cannot hold '/': use namespaces=False instead")
        try:
            os.close(no_follow.open_directory(absolute))
        except no_follow.SymlinkInPath as exc:
            raise ValueError(f"`writable_paths`: {exc}") from None
        except OSError:
            raise ValueError(
                f"`writable_paths`: {os.fspath(path)!r} is not an existing directory"
            ) from None
        checked.append(absolute)
    return tuple(checked)


def checked_tmpfs_bytes(size: int | None) -> int | None:
    """``tmpfs_bytes``: None (the default size) or a positive int."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 << 20:
        raise ValueError(f"`tmpfs_bytes` must be an int of at least 1 MiB, got {size!r}")
    return size


def check_env_fns(env_fns: Sequence[Callable]) -> None:
    """At least one env_fn, each a callable that builds an env (not an env already
    built)."""
    if isinstance(env_fns, str | bytes) or not isinstance(env_fns, Sequence):
        raise TypeError(f"env_fns must be a list of functions that build envs, got {env_fns!r}")
    if len(env_fns) == 0:
        raise ValueError("a vector env needs at least one env_fn")
    for i, env_fn in enumerate(env_fns):
        built = not isinstance(env_fn, type) and hasattr(env_fn, "step")
        if callable(env_fn) and not built:
            continue
        what = type(env_fn).__name__
        hint = " (an env already built)" if built else ""
        raise TypeError(
            f"env_fns[{i}] is a {what}{hint}, not a function that builds an env: pass "
            f"e.g. `lambda: gym.make(...)` instead of `gym.make(...)`"
        )


# The fields from_arguments takes as they are (its ``**plain``).
_PLAIN_FIELDS = frozenset(
    {
        "shared_memory",
        "copy",
        "context",
        "daemon",
        "observation_mode",
        "check_actions",
        "vm_memory_mb",
        "vm_slab_mb",
    }
)
