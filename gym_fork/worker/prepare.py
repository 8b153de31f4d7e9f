"""What a warm parent prepares once, whatever its sandbox kind: the env_fns, the
controller's import path and registry, and (``from_parent``) a prepared prototype env."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cloudpickle


@dataclass(frozen=True)
class PrepareRecipe:
    """How ``from_parent`` prepares its warm parent: ``env_fn()``, ``reset(seed)`` when a
    seed is given, ``warmup(env)``, then ``ready_check(env)`` (False: not ready). The one
    recipe every host follows (pickled whole into a sandboxed warm parent)."""

    warmup: Callable | None = None
    ready_check: Callable | None = None
    seed: int | None = None

    def prepared_env(self, env_fn: Callable[[], Any]):
        """A new env from ``env_fn``, prepared by this recipe."""
        env = env_fn()
        if self.seed is not None:
            env.reset(seed=self.seed)
        if self.warmup is not None:
            self.warmup(env)
        if self.ready_check is not None and self.ready_check(env) is False:
            raise RuntimeError("ready_check(env) returned False: the parent is not ready")
        return env


class EnvSource:
    """The env_fns of a vector env, unpickled once in the warm parent, and what a new
    sandbox's sub-envs start from (:meth:`make_env`)."""

    def __init__(self) -> None:
        self.env_fns: list[Any] = []
        self.prototype = None  # the prepared env of from_parent, None otherwise
        self.preparation: PrepareRecipe | None = None  # from_parent's, None otherwise
        self._attach_cache: dict[bytes, dict] = {}

    def prepare(self, message: dict[str, Any]) -> None:
        """Apply an init message (see ``gym_fork.hosts.preparing.init_message``)."""
        sys.path[:] = message["sys_path"]
        with contextlib.suppress(OSError):
            os.chdir(message["cwd"])
        registry = cloudpickle.loads(message["registry"])
        from gymnasium.envs.registration import registry as local_registry

        for env_id, spec in registry.items():
            local_registry.setdefault(env_id, spec)
        self.env_fns = cloudpickle.loads(message["env_fns"])
        prepare = message.get("prepare")
        if prepare is not None:
            self.preparation = cloudpickle.loads(prepare)
            if not message.get("clean_launch"):
                self.prototype = self.prepared_env()
        # Objects alive now are shared copy-on-write with every sandbox: keep the
        # collector from touching (and so copying) their pages after fork.
        gc.collect()
        gc.freeze()

    def builds_in_sandbox(self) -> bool:
        """True when sandboxes build their envs from ``env_fns`` (no prepared parent)."""
        return self.prototype is None and self.preparation is None and bool(self.env_fns)

    def prepared_env(self):
        """env_fns[0] prepared by from_parent's recipe."""
        if self.preparation is None:
            raise RuntimeError("prepared_env: this vector env has no from_parent recipe")
        return self.preparation.prepared_env(self.env_fns[0])

    def make_env(self, origin: int):
        """The env a new sandbox starts from: the prototype's copy, a prepared env built
        in the sandbox (a clean launch), or a fresh build of env_fns[origin]."""
        if self.prototype is not None:
            return self.prototype
        if self.preparation is not None:
            return self.prepared_env()
        return self.env_fns[origin]()

    def last_attach_arg(self) -> dict | None:
        """The attach argument unpickled last (None before any)."""
        return next(reversed(self._attach_cache.values()), None)

    def attach_arg(self, pickled: bytes | None) -> dict | None:
        """The controller's attach argument, spaces unpickled once and then shared."""
        if pickled is None:
            return None
        if pickled not in self._attach_cache:
            arg = cloudpickle.loads(pickled)
            for key in ("observation_space", "action_space"):
                arg[key] = cloudpickle.loads(arg[key])
            self._attach_cache[pickled] = arg
        return self._attach_cache[pickled]
