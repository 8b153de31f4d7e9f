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
