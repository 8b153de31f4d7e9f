"""The shard actor: one per node (or per N cores), owning node-local ForkVectorEnvs.

An actor holds any number of *handles*, each a node-local :class:`ForkVectorEnv` (the
shard of a root vector env, or of one of its branches). A fork of a handle runs here, so
the copy-on-write clones stay on this node. Every method takes and returns one batch for
the whole handle: the controller sends one request per actor per step and gets one
object back (numpy arrays travel out of band through Ray's pickle-5 serializer).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

from gym_fork.errors import GymForkError, like_builtin


class ShardWorker:
    """Actor body; wrapped with ``ray.remote`` by :func:`remote_class`."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.envs: dict[str, Any] = {}

    def where(self) -> tuple[str, int]:
        """(Ray node id, pid) of this actor."""
        return self.node_id, os.getpid()

    def _describe(self, handle: str) -> dict[str, Any]:
        env = self.envs[handle]
        return {
            "num_envs": env.num_envs,
            "single_observation_space": env.single_observation_space,
            "single_action_space": env.single_action_space,
            "metadata": dict(env.metadata),
            "render_mode": env.render_mode,
            "spec": getattr(env, "spec", None),
            "node_id": self.node_id,
            "pid": os.getpid(),
            "local_branch_id": env.lineage.branch_id if env.lineage is not None else None,
            "baseline_id": env.lineage.baseline_id if env.lineage is not None else None,
            "isolation": env.isolation,
        }

    def _stamp(self, handle: str, placement: dict[str, Any]) -> None:
        lineage = self.envs[handle].lineage
        if lineage is not None:
            lineage.tree.event(
                lineage.branch_id,
                "ray_placement",
                node_id=self.node_id,
                pid=os.getpid(),
                **placement,
            )

    def create(
        self,
        handle: str,
        env_fns: Sequence[Callable[[], Any]] | None,
        kwargs: dict[str, Any],
        placement: dict[str, Any],
        from_parent: dict[str, Any] | None = None,
        seeds: list[int | None] | None = None,
    ) -> dict[str, Any]:
        """Build a ForkVectorEnv for ``handle``: from ``env_fns`` (drop-in constructor) or
        ``from_parent`` (``ForkVectorEnv.from_parent``'s arguments); reset it with ``seeds`` when
        given (a spread fork's fresh copies) and return its description."""
        from gym_fork import ForkVectorEnv

        if handle in self.envs:
            raise ValueError(f"handle {handle!r} exists on this actor")
        if from_parent is not None:
            env = ForkVectorEnv.from_parent(**from_parent, **kwargs)
        else:
            env = ForkVectorEnv(list(env_fns), **kwargs)
        self.envs[handle] = env
        try:
            self._stamp(handle, placement)
            out = self._describe(handle)
            if seeds is not None:
                out["reset"] = env.reset(seed=list(seeds))
        except BaseException:
            self.envs.pop(handle).close(terminate=True)
            raise
        return out

    def fork(
        self,
        handle: str,
        new_handle: str,
        branch_id: str,
        indices: list[int],
        copies: int,
        reseed: list[int | None] | None,
        placement: dict[str, Any],
    ) -> dict[str, Any]:
        """Fork sub-envs of ``handle`` (local indices) into ``new_handle`` on this node."""
        branch = self.envs[handle].fork(branch_id, indices=indices, copies=copies, reseed=reseed)
        self.envs[new_handle] = branch
        self._stamp(new_handle, placement)
        return self._describe(new_handle)

    def run(self, op: str, items: list[tuple[str, tuple, dict[str, Any]]]) -> list[tuple]:
        """Run ``op`` (reset, step, call, get_attr, set_attr) on several handles of this
        actor in one request; one ``(True, result)`` or ``(False, exception)`` per item,
        so one failing handle does not hide the others' results."""
        if op not in ("reset", "step", "call", "get_attr", "set_attr"):
            raise ValueError(f"unknown op {op!r}")
        out: list[tuple] = []
        for handle, args, kwargs in items:
            try:
                out.append((True, getattr(self.envs[handle], op)(*args, **kwargs)))
            except Exception as exc:
                out.append((False, _portable(exc)))
        return out

    def close(self, handles: list[str], timeout: float | None, terminate: bool) -> int:
        """Close handles; returns how many handles this actor still holds."""
        for handle in handles:
            env = self.envs.pop(handle, None)
            if env is not None:
                env.close(timeout=timeout, terminate=terminate)
        return len(self.envs)

    def handles(self) -> list[str]:
        """The handles this actor holds."""
        return sorted(self.envs)


def _portable(exc: Exception) -> Exception | _Mixed:
    """The exception itself when it pickles; an untrusted sub-env error (a class made at
    run time, ``SubEnvError[ValueError]``) as a :class:`_Mixed` that unpickles as the
    same class; else a RuntimeError carrying its text."""
    try:
        cloudpickle.loads(cloudpickle.dumps(exc))
        return exc
    except Exception:
        if _Mixed.stands_for(exc):
            return _Mixed(exc)
        text = "".join(traceback.format_exception(exc))
        return RuntimeError(f"{type(exc).__name__}: {exc} (not picklable)\n{text}")


class _Mixed:
    """Pickles as the ``like_builtin`` exception it wraps: the class is made again on
    the controller from its base and names; attributes that do not pickle are left out
    (its notes and tracebacks are text and stay)."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    @staticmethod
    def stands_for(exc: Exception) -> bool:
        bases = type(exc).__bases__
        return (
            len(bases) == 2
            and issubclass(bases[0], GymForkError)
            and type(exc).__name__.startswith(f"{bases[0].__name__}[")
        )

    def __reduce__(self):
        base, candidate = type(self.exc).__bases__
        type_name = type(self.exc).__name__[len(base.__name__) + 1 : -1]
        state = {}
        for key, value in vars(self.exc).items():
            try:
                cloudpickle.loads(cloudpickle.dumps(value))
            except Exception:  # left out (e.g. gym_fork_errors: more such exceptions)
                continue
            state[key] = value
        return (_mixed_again, (base, type_name, candidate.__name__, self.exc.args), state)


def _mixed_again(base: type, type_name: str, candidate: str, args: tuple) -> Exception:
    cls = like_builtin(base, type_name, (candidate,))
    return cls.__new__(cls, *args)


_REMOTE: Any = None


def remote_class() -> Any:
    """``ray.remote(ShardWorker)``, made once per process."""
    global _REMOTE
    if _REMOTE is None:
        import ray

        _REMOTE = ray.remote(max_restarts=0, max_task_retries=0)(ShardWorker)
    return _REMOTE


__all__ = ["ShardWorker", "remote_class"]
