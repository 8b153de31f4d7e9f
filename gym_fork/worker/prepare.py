"""What a warm parent prepares once, whatever its sandbox kind: the env_fns, the
controller's import path and registry, and (``from_parent``) a prepared prototype env."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from typing import Any

import cloudpickle


class EnvRecipe:
    """The env_fns of a vector env, unpickled once in the warm parent, and what a new
    sandbox's sub-envs start from (:meth:`make_env`)."""

    def __init__(self) -> None:
        self.env_fns: list[Any] = []
        self.prototype = None  # the prepared env of from_parent, None otherwise
        self.recipe: tuple | None = None  # (warmup, ready_check, seed) of from_parent
        self._attach_cache: dict[bytes, dict] = {}

    def prepare(self, message: dict[str, Any]) -> None:
        """Apply an init message (see ``gym_fork.hosts.base.init_message``)."""
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
            self.recipe = cloudpickle.loads(prepare)
            if not message.get("prepare_in_sandbox"):
                self.prototype = self.prepared_env()
        # Objects alive now are shared copy-on-write with every sandbox: keep the
        # collector from touching (and so copying) their pages after fork.
        gc.collect()
        gc.freeze()

    def builds_in_sandbox(self) -> bool:
        """True when sandboxes build their envs from ``env_fns`` (no prepared parent)."""
        return self.prototype is None and self.recipe is None and bool(self.env_fns)

    def prepared_env(self):
        """env_fn(), then reset(seed), warmup(env) and ready_check(env)."""
        warmup, ready_check, seed = self.recipe
        env = self.env_fns[0]()
        if seed is not None:
            env.reset(seed=seed)
        if warmup is not None:
            warmup(env)
        if ready_check is not None and ready_check(env) is False:
            raise RuntimeError("ready_check(env) returned False: the parent is not ready")
        return env

    def make_env(self, origin: int):
        """The env a new sandbox starts from: the prototype's copy, a prepared env built
        in the sandbox (a clean launch), or a fresh build of env_fns[origin]."""
        if self.prototype is not None:
            return self.prototype
        if self.recipe is not None:
            return self.prepared_env()
        return self.env_fns[origin]()

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
