"""Arguments users bring from other vector-env libraries (EnvPool, Stable-Baselines3's
SubprocVecEnv, PufferLib, Gymnasium's ``make_vec``), refused with gym_fork's equivalent
named instead of Python's bare "unexpected keyword argument"."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

# name: (where users bring it from, what to write instead)
EQUIVALENTS: dict[str, tuple[str, str]] = {
    "num_workers": (
        "PufferLib / a worker pool",
        "gym_fork makes one sandbox per envs_per_worker sub-envs: pass envs_per_worker= "
        "(sub-envs per sandbox), or leave the default 'auto'",
    ),
    "num_threads": (
        "EnvPool",
        "sandboxes are processes, not threads: envs_per_worker= groups sub-envs per "
        "sandbox, and batch_size= is EnvPool's batch_size (send/recv batch mode)",
    ),
    "start_method": (
        "Stable-Baselines3's SubprocVecEnv",
        "sandboxes are always forked from a warm parent; AsyncVectorEnv's context= is "
        "accepted (and changes nothing)",
    ),
    "num_envs": (
        "EnvPool's make() / gym.make_vec",
        "pass one env_fn per sub-env (ForkVectorEnv([make_env] * n)), or use "
        "gym_fork.make_vec(env_id, num_envs=n) or ForkVectorEnv.from_parent(make_env, n)",
    ),
    "seed": (
        "EnvPool's make()",
        "seed at reset, as Gymnasium does: envs.reset(seed=0) seeds sub-env i with 0 + i",
    ),
    "env_kwargs": (
        "Stable-Baselines3's make_vec_env",
        "bind them into the env_fns: [functools.partial(MyEnv, **kwargs)] * n, or "
        "gym_fork.make_vec(env_id, num_envs=n, **kwargs)",
    ),
}


def refuse_foreign(
    args: tuple[Any, ...], kwargs: dict[str, Any], known: Callable[[], Collection[str]]
) -> None:
    """Raise TypeError naming gym_fork's equivalent for an argument of another library
    (``known()``: the constructor's own names), or for an env id given as env_fns."""
    for name in kwargs:
        if name in EQUIVALENTS and name not in known():
            origin, instead = EQUIVALENTS[name]
            raise TypeError(
                f"ForkVectorEnv() got an unexpected keyword argument {name!r} (an argument "
                f"of {origin}): {instead}"
            )
    env_fns = args[0] if args else kwargs.get("env_fns")
    if isinstance(env_fns, str):
        raise TypeError(
            f"ForkVectorEnv takes env_fns, a list of functions that build envs, not the env "
            f"id {env_fns!r}: use gym_fork.make_vec({env_fns!r}, num_envs=n), or "
            f"ForkVectorEnv([lambda: gym.make({env_fns!r})] * n)"
        )
