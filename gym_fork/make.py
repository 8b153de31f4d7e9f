"""``gym_fork.make_vec``: ``gymnasium.make_vec`` with ForkVectorEnv as the vectorizer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym


class _EnvMaker:
    """A picklable ``gym.make(env_id, **kwargs)`` followed by wrappers."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], wrappers: Sequence[Callable]):
        self.env_id = env_id
        self.kwargs = kwargs
        self.wrappers = list(wrappers)

    def __call__(self) -> gym.Env:
        env = gym.make(self.env_id, **self.kwargs)
        for wrapper in self.wrappers:
            env = wrapper(env)
        return env


def make_vec(
    env_id: str,
    num_envs: int = 1,
    *,
    vector_kwargs: dict[str, Any] | None = None,
    wrappers: Sequence[Callable[[gym.Env], gym.Env]] | None = None,
    from_parent: bool = False,
    **kwargs: Any,
):
    """Like ``gym.make_vec(env_id, num_envs, vectorization_mode="async", ...)``, on gym_fork.

    ``kwargs`` go to ``gym.make``, ``wrappers`` wrap each sub-env, ``vector_kwargs`` go to
    :class:`ForkVectorEnv` (or to :meth:`ForkVectorEnv.from_parent` with
    ``from_parent=True``: one env is built and warmed once, then cloned).
    """
    from gym_fork.vector.fork_vector_env import ForkVectorEnv

    maker = _EnvMaker(env_id, kwargs, wrappers or ())
    vector_kwargs = dict(vector_kwargs or {})
    if from_parent:
        return ForkVectorEnv.from_parent(maker, num_envs, **vector_kwargs)
    return ForkVectorEnv([maker] * num_envs, **vector_kwargs)


class _VectorEntryPoint:
    """What :func:`vector_entry_point` returns: Gymnasium calls it with ``num_envs`` and
    the env's keyword arguments (its spec's, then ``make_vec``'s)."""

    def __init__(self, env_id: str, vector_kwargs: dict[str, Any]) -> None:
        self.env_id = env_id
        self.vector_kwargs = vector_kwargs

    def __call__(self, num_envs: int = 1, **kwargs: Any):
        # gym.make applies the spec's TimeLimit itself; Gymnasium passes it here only as
        # a default for a vector env that has to.
        spec = gym.spec(self.env_id)
        if kwargs.get("max_episode_steps") == spec.max_episode_steps:
            kwargs.pop("max_episode_steps")
        return make_vec(self.env_id, num_envs, vector_kwargs=self.vector_kwargs, **kwargs)

    def __repr__(self) -> str:
        return f"gym_fork.vector_entry_point({self.env_id!r})"


def vector_entry_point(env_id: str, **vector_kwargs: Any) -> Callable[..., Any]:
    """A ``vector_entry_point`` for ``gymnasium.register``: an env registered with it is
    vectorized by ForkVectorEnv when ``gymnasium.make_vec(env_id, num_envs)`` is called
    without a mode (or with ``vectorization_mode="vector_entry_point"``), with no change
    to the code that calls it; ``vector_kwargs`` go to :class:`ForkVectorEnv`::

        gym.register("MyEnv-v0", entry_point="my_pkg:MyEnv",
                     vector_entry_point=gym_fork.vector_entry_point("MyEnv-v0"))
        envs = gym.make_vec("MyEnv-v0", num_envs=8)  # a ForkVectorEnv

    ``vectorization_mode="sync"`` or ``"async"`` still give Gymnasium's own."""
    return _VectorEntryPoint(env_id, dict(vector_kwargs))
