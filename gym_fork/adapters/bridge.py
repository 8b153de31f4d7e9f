"""The sandbox side of the SB3 adapter: a transparent wrapper around each sub-env.

Gymnasium's vector API reaches every sub-env at once and resolves attributes through the
wrapper chain; SB3's ``VecEnv`` wants calls on chosen indices, raw attribute values and
``isinstance`` checks of the wrapper chain. :class:`SubEnvBridge` gives the sub-env the
few methods that do this, so the adapter can use ForkVectorEnv's public ``call`` and
``set_attr``. This module imports only gymnasium: sandboxes load it to unpickle env_fns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym


class SubEnvBridge(gym.Wrapper):
    """Outermost wrapper of each SB3 sub-env; invisible to the env's own behaviour."""

    gym_fork_sb3_bridge = True
    # Set per sub-env with ForkVectorEnv.set_attr right before a call on some indices.
    gym_fork_sb3_selected = True

    @property
    def spec(self):
        """The wrapped env's spec, without this wrapper added to it."""
        return self.env.spec

    def _chosen(self, only_selected: bool) -> bool:
        chosen = self.gym_fork_sb3_selected or not only_selected
        self.gym_fork_sb3_selected = True
        return chosen

    def gym_fork_sb3_get(self, name: str, only_selected: bool = False) -> Any:
        """The attribute as SB3 sees it: found down the wrapper chain, never called
        (None for an unselected sub-env)."""
        if not self._chosen(only_selected):
            return None
        return self.env.get_wrapper_attr(name)

    def gym_fork_sb3_has(self, name: str) -> bool:
        """Whether the attribute is found down the wrapper chain."""
        try:
            self.env.get_wrapper_attr(name)
        except AttributeError:
            return False
        return True

    def gym_fork_sb3_set(self, name: str, value: Any, only_selected: bool = False) -> None:
        """``setattr`` on the user's outermost env, as SB3's ``DummyVecEnv`` does."""
        if self._chosen(only_selected):
            setattr(self.env, name, value)

    def gym_fork_sb3_call(
        self, name: str, args: tuple, kwargs: dict[str, Any], only_selected: bool = False
    ) -> Any:
        """Call a method found down the wrapper chain (None for an unselected sub-env)."""
        if not self._chosen(only_selected):
            return None
        return self.env.get_wrapper_attr(name)(*args, **kwargs)

    def gym_fork_sb3_is_wrapped(self, wrapper_class: type) -> bool:
        """Whether any wrapper below this one is an instance of ``wrapper_class``."""
        env = self.env
        while isinstance(env, gym.Wrapper):
            if isinstance(env, wrapper_class):
                return True
            env = env.env
        return False


class BridgedEnvFn:
    """A picklable ``env_fn`` that returns ``SubEnvBridge(env_fn())``."""

    def __init__(self, env_fn: Callable[[], gym.Env]) -> None:
        self.env_fn = env_fn

    def __call__(self) -> gym.Env:
        env = self.env_fn()
        return env if isinstance(env, SubEnvBridge) else SubEnvBridge(env)
