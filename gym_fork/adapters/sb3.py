"""A Stable-Baselines3 ``VecEnv`` whose sub-envs run in gym_fork sandboxes.

Install with ``pip install 'gym_fork[sb3]'``. ``ForkVecEnv(env_fns)`` replaces
``SubprocVecEnv(env_fns)`` / ``DummyVecEnv(env_fns)``; ``fork()`` branches it.

(Over ~450 lines as one job: every method of SB3's ``VecEnv`` with its conventions for
indices, actions and infos; the wrappers that carry state through ``fork()`` are
``sb3_wrappers.py``, the info conversion ``infos.py``.)
"""

from __future__ import annotations

import functools
import operator
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from copy import deepcopy
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate
from stable_baselines3.common.vec_env.base_vec_env import (
    VecEnv,
    VecEnvIndices,
    VecEnvObs,
    VecEnvStepReturn,
    VecEnvWrapper,
)

from gym_fork.adapters.bridge import BridgedEnvFn
from gym_fork.adapters.infos import unbatch_infos
from gym_fork.adapters.sb3_wrappers import check_carried, copy_wrappers
from gym_fork.errors import BadActionError
from gym_fork.vector.spaces import empty_buffer

__all__ = ["ForkVecEnv", "fork_wrapped"]


def _single(batch: Any, i: int) -> Any:
    """Sub-env ``i``'s observation out of a batch (arrays, dicts and tuples of them)."""
    if isinstance(batch, dict):
        return {key: _single(value, i) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_single(value, i) for value in batch)
    return deepcopy(batch[i])


# Spaces whose Gymnasium batch is one array with the sub-envs along its first axis: an
# array of SB3 actions is that batch already.
_ARRAY_SPACES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def sb3_actions(space: gym.Space, actions: Any, num_envs: int) -> Any:
    """SB3's actions as the Gymnasium batch a vector env takes.

    SB3 hands a ``VecEnv`` one action per sub-env: an array whose first axis is the
    sub-env, or any sequence of per-env actions (DummyVecEnv indexes it, SubprocVecEnv
    iterates it), e.g. a list of dicts for a ``Dict`` space or of tuples for a ``Tuple``
    space. Gymnasium wants one batch: an array for the array spaces, a dict or tuple of
    arrays for ``Dict``/``Tuple``. A wrong count or an action outside ``space``'s
    structure is a :class:`~gym_fork.errors.BadActionError`.
    """
    if isinstance(actions, np.ndarray) and actions.dtype != object:
        if isinstance(space, _ARRAY_SPACES):
            if actions.ndim == 0 or len(actions) != num_envs:
                raise BadActionError(
                    f"SB3 actions are one per sub-env: expected an array of {num_envs} "
                    f"actions along its first axis, got shape {actions.shape}"
                )
            return actions
    elif isinstance(actions, Mapping | str | bytes) or not isinstance(actions, Iterable):
        raise BadActionError(
            f"SB3 actions are one per sub-env (a list or array of {num_envs} actions for "
            f"{space}), got a {type(actions).__name__}"
        )
    items = list(actions)
    if len(items) != num_envs:
        raise BadActionError(f"{len(items)} SB3 actions for {num_envs} sub-envs")
    try:
        return concatenate(space, items, empty_buffer(space, num_envs))
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise BadActionError(
            f"SB3 actions that do not fit the action space {space}: {exc!r}"
        ) from exc


def sb3_indices(indices: VecEnvIndices, num_envs: int) -> list[int]:
    """SB3's ``indices`` as DummyVecEnv and SubprocVecEnv read them, each in
    ``0..num_envs-1``: None is every sub-env, an int is one, any other iterable of ints
    is those, in its order; a negative index counts from the end and a repeated one is
    repeated (the call reaches that sub-env again). Out of range: IndexError."""
    if indices is None:
        return list(range(num_envs))
    if isinstance(indices, int | np.integer):
        items: list[Any] = [indices]
    elif isinstance(indices, Iterable) and not isinstance(indices, str | bytes | Mapping):
        items = list(indices)
    else:
        raise TypeError(
            f"indices must be None, an int or an iterable of ints, got {type(indices).__name__}"
        )
    chosen = []
    for item in items:
        try:
            index = operator.index(item)
        except TypeError:
            raise TypeError(f"a sub-env index must be an int, got {item!r}") from None
        if not -num_envs <= index < num_envs:
            raise IndexError(f"sub-env index {index} is out of range for {num_envs} sub-envs")
        chosen.append(index % num_envs)
    return chosen


def _rounds(chosen: list[int]) -> list[list[int]]:
    """``chosen`` split into rounds holding each sub-env once: a sub-env listed k times
    is in the first k rounds (a call reaches it k times, in turn)."""
    rounds: list[list[int]] = []
    seen: Counter[int] = Counter()
    for index in chosen:
        if seen[index] == len(rounds):
            rounds.append([])
        rounds[seen[index]].append(index)
        seen[index] += 1
    return rounds


class ForkVecEnv(VecEnv):
    """SB3 ``VecEnv`` over a :class:`gym_fork.ForkVectorEnv`.

    ``ForkVecEnv(env_fns, **kwargs)`` builds ``ForkVectorEnv(env_fns, **kwargs)`` with
    ``autoreset_mode=SAME_STEP`` (unless given), each sub-env inside a transparent
    :class:`~gym_fork.adapters.bridge.SubEnvBridge` so that ``env_method``, ``set_attr``
    and ``env_is_wrapped`` can target chosen indices. ``ForkVecEnv(vector_env)`` wraps an
    existing ForkVectorEnv (any autoreset mode) and takes ownership of it: closing the
    adapter closes it. Without the bridge, calls on a strict subset of the sub-envs raise
    ``NotImplementedError`` and ``env_is_wrapped`` answers False with a warning.

    SB3 semantics: ``step`` returns the reset observation of a finished sub-env, its
    last observation in ``infos[i]["terminal_observation"]``, the step's own info,
    ``infos[i]["TimeLimit.truncated"]`` and ``dones = terminated | truncated``; the reset
    info goes to ``reset_infos[i]``. ``indices`` are SB3's (:func:`sb3_indices`:
    negative from the end, a repeated one called again) and actions are one per sub-env
    as SB3 hands them, for every space (:func:`sb3_actions`: Dict and Tuple too).
    """

    def __init__(self, env_fns: Sequence[Callable[[], gym.Env]] | Any, **vector_kwargs: Any):
        from gym_fork import ForkVectorEnv

        if isinstance(env_fns, ForkVectorEnv):
            if vector_kwargs:
                raise TypeError("ForkVectorEnv keyword arguments need env_fns, not a built env")
            vector_env = env_fns
        else:
            vector_kwargs.setdefault("autoreset_mode", AutoresetMode.SAME_STEP)
            vector_env = ForkVectorEnv([BridgedEnvFn(fn) for fn in env_fns], **vector_kwargs)
        self.vector_env = vector_env
        self.closed = False
        try:
            self.bridged = self._has_bridge()
            super().__init__(
                vector_env.num_envs,
                vector_env.single_observation_space,
                vector_env.single_action_space,
            )
        except BaseException:
            vector_env.close()
            raise

    @classmethod
    def from_parent(
        cls, env_fn: Callable[[], gym.Env], num_envs: int, **parent_kwargs: Any
    ) -> ForkVecEnv:
        """``ForkVectorEnv.from_parent`` (one env built and warmed, cloned ``num_envs``
        times), with ``autoreset_mode=SAME_STEP`` unless given, as an SB3 ``VecEnv``."""
        from gym_fork import ForkVectorEnv

        parent_kwargs.setdefault("autoreset_mode", AutoresetMode.SAME_STEP)
        return cls(ForkVectorEnv.from_parent(BridgedEnvFn(env_fn), num_envs, **parent_kwargs))

    def _has_bridge(self) -> bool:
        # env_fns is public (as on AsyncVectorEnv) and branches carry their source's.
        env_fns = getattr(self.vector_env, "env_fns", None) or ()
        return bool(env_fns) and all(isinstance(fn, BridgedEnvFn) for fn in env_fns)

    # -- stepping -------------------------------------------------------------------
    def reset(self) -> VecEnvObs:
        """Reset every sub-env with the seeds and options set by ``seed``/``set_options``."""
        seeds = self._seeds if any(s is not None for s in self._seeds) else None
        groups: dict[bytes, list[int]] = {}
        for i, options in enumerate(self._options):
            groups.setdefault(cloudpickle.dumps(options), []).append(i)
        if len(groups) == 1:
            options = deepcopy(self._options[0]) or None
            obs, infos = self.vector_env.reset(seed=seeds, options=options)
            self.reset_infos = unbatch_infos(infos, self.num_envs)
        else:
            # Gymnasium takes one options dict per reset: one masked reset per distinct one.
            for members in groups.values():
                mask = np.zeros(self.num_envs, dtype=np.bool_)
                mask[members] = True
                options = {**deepcopy(self._options[members[0]]), "reset_mask": mask}
                obs, infos = self.vector_env.reset(seed=seeds, options=options)
                per_env = unbatch_infos(infos, self.num_envs)
                for i in members:
                    self.reset_infos[i] = per_env[i]
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        """Send the actions, one per sub-env as SB3 hands them (see :func:`sb3_actions`);
        the sub-envs step while the caller does other work."""
        self.vector_env.step_async(sb3_actions(self.action_space, actions, self.num_envs))

    def step_wait(self) -> VecEnvStepReturn:
        """Wait for the step; finished sub-envs come back already reset (SB3 semantics)."""
        obs, rewards, terminations, truncations, batched = self.vector_env.step_wait()
        dones = np.logical_or(terminations, truncations)
        infos = unbatch_infos(batched, self.num_envs)
        finished = np.flatnonzero(dones)
        if self.vector_env.autoreset_mode == AutoresetMode.SAME_STEP:
            # The sub-env reset inside the step: the top-level info is the reset's, the
            # step's own info and last observation are under final_info / final_obs.
            # The last observation comes from the batch as the env returned it
            # (unbatch_infos makes Python scalars of numpy ones: a Discrete np.int64).
            final_obs = batched["final_obs"] if len(finished) else None
            for i in finished:
                reset_info = infos[i]
                infos[i] = reset_info.pop("final_info", {})
                reset_info.pop("final_obs")
                infos[i]["terminal_observation"] = deepcopy(final_obs[i])
                self.reset_infos[i] = reset_info
        elif len(finished):
            # NEXT_STEP would reset at the next step, ignoring its action; SB3 wants the
            # reset observation now. A masked reset also clears the pending autoreset.
            for i in finished:
                infos[i]["terminal_observation"] = _single(obs, i)
            obs, batched_reset = self.vector_env.reset(options={"reset_mask": dones})
            reset_infos = unbatch_infos(batched_reset, self.num_envs)
            for i in finished:
                self.reset_infos[i] = reset_infos[i]
        for i, info in enumerate(infos):
            info["TimeLimit.truncated"] = bool(truncations[i] and not terminations[i])
        return obs, np.asarray(rewards, dtype=np.float32), dones, infos

    # -- sub-env access ---------------------------------------------------------------
    def _select(self, indices: list[int], what: str) -> bool:
        """Mark the chosen sub-envs (each once) for the next bridged call; False when all
        are chosen."""
        if sorted(indices) == list(range(self.num_envs)):
            return False
        if not self.bridged:
            raise NotImplementedError(
                f"{what} on some sub-envs only needs the sub-envs built by ForkVecEnv "
                "(ForkVecEnv(env_fns) or ForkVecEnv.from_parent): this one wraps a "
                "ForkVectorEnv built elsewhere, whose calls reach every sub-env"
            )
        chosen = set(indices)
        self.vector_env.set_attr(
            "gym_fork_sb3_selected", [i in chosen for i in range(self.num_envs)]
        )
        return True

    def _each(self, chosen: list[int], what: str, call: Callable[[bool], Any]) -> list[Any]:
        """``call(only_selected)`` once per round of ``chosen`` (:func:`_rounds`), each
        round's sub-envs selected; the results in ``chosen``'s order."""
        by_round = []
        for members in _rounds(chosen):
            by_round.append(call(self._select(members, what)))
        seen: Counter[int] = Counter()
        results = []
        for index in chosen:
            results.append(by_round[seen[index]][index])
            seen[index] += 1
        return results

    def has_attr(self, attr_name: str) -> bool:
        """Whether every sub-env has the attribute (asked without raising in them)."""
        if self.bridged:
            return all(self.vector_env.call("gym_fork_sb3_has", attr_name))
        return super().has_attr(attr_name)

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """The attribute of each chosen sub-env, only those asked (a method is returned,
        not called, where the sub-envs were built by this adapter; Gymnasium's
        ``get_attr`` calls it)."""
        chosen = sb3_indices(indices, self.num_envs)
        if not self.bridged:
            values = self.vector_env.get_attr(attr_name)
            return [values[i] for i in chosen]
        return self._each(
            chosen,
            "get_attr",
            lambda only: self.vector_env.call("gym_fork_sb3_get", attr_name, only),
        )

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Set ``attr_name = value`` on each chosen sub-env (again for a repeated index)."""

        def assign(only: bool) -> Any:
            if self.bridged:
                return self.vector_env.call("gym_fork_sb3_set", attr_name, value, only)
            # A list or tuple would be read by Gymnasium as one value per sub-env.
            self.vector_env.set_attr(attr_name, [value] * self.num_envs)
            return [None] * self.num_envs

        self._each(sb3_indices(indices, self.num_envs), "set_attr", assign)

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs
    ) -> list[Any]:
        """Call a method on each chosen sub-env, only those (again for a repeated index),
        and return the results in ``indices``' order."""

        def call(only: bool) -> Any:
            if self.bridged:
                return self.vector_env.call(
                    "gym_fork_sb3_call", method_name, method_args, method_kwargs, only
                )
            return self.vector_env.call(method_name, *method_args, **method_kwargs)

        return self._each(sb3_indices(indices, self.num_envs), "env_method", call)

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether each chosen sub-env has a ``wrapper_class`` in its wrapper chain."""
        chosen = sb3_indices(indices, self.num_envs)
        if not self.bridged:
            warnings.warn(
                "env_is_wrapped cannot look into sub-envs built outside ForkVecEnv: "
                "answering False",
                stacklevel=2,
            )
            return [False] * len(chosen)
        results = self.vector_env.call("gym_fork_sb3_is_wrapped", wrapper_class)
        return [bool(results[i]) for i in chosen]

    def get_images(self) -> Sequence[np.ndarray | None]:
        """One ``rgb_array`` frame per sub-env."""
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"get_images needs render_mode='rgb_array', the sub-envs have {self.render_mode!r}",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return list(self.vector_env.render())

    # -- gym_fork -----------------------------------------------------------------------
    def fork(
        self,
        branch_id: str,
        indices: Sequence[int] | None = None,
        copies: int = 1,
        reseed: int | Sequence[int | None] | None = None,
    ) -> ForkVecEnv:
        """Branch running sub-envs (see :meth:`gym_fork.ForkVectorEnv.fork`) as a new
        ``ForkVecEnv``; stepped with the source's actions it replays the source exactly.

        Called on SB3 wrappers around this env (``VecNormalize(env).fork(...)``, as SB3
        forwards the attribute) it returns the branch in copies of those wrappers, their
        state carried (:func:`fork_wrapped`).
        """
        if indices is not None:  # SB3's conventions (negative from the end), as everywhere here
            indices = sb3_indices(indices, self.num_envs)
        branch = self.vector_env.fork(branch_id, indices, copies, reseed)
        adapter = ForkVecEnv(branch)
        sources = self.branch_sources(indices, copies)
        adapter.reset_infos = [deepcopy(self.reset_infos[i]) for i in sources]
        return adapter

    def branch_sources(self, indices: VecEnvIndices, copies: int = 1) -> list[int]:
        """For ``fork(..., indices, copies)``: the sub-env of this env that each sub-env of
        the branch is a clone of."""
        chosen = (
            list(range(self.num_envs)) if indices is None else sb3_indices(indices, self.num_envs)
        )
        return [i for i in chosen for _ in range(copies)]

    def getattr_recursive(self, name: str) -> Any:
        """An attribute as SB3's wrappers forward it (``VecEnvWrapper.__getattr__``):
        ``fork`` reached through wrappers forks through them (:func:`fork_wrapped`);
        every other name is this env's own."""
        if name == "fork":
            chain = _forwarding_wrappers(self)
            if chain:
                return functools.partial(fork_wrapped, chain[-1])
        return getattr(self, name)

    @property
    def lineage(self):
        """Provenance of the underlying ForkVectorEnv (see ``ForkVectorEnv.lineage``)."""
        return self.vector_env.lineage

    def close(self) -> None:
        """Close the sub-envs and their sandboxes."""
        if not self.closed:
            self.closed = True
            self.vector_env.close()

    def __enter__(self) -> ForkVecEnv:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _forwarding_wrappers(env: ForkVecEnv) -> list[VecEnvWrapper]:
    """The VecEnvWrappers whose attribute forwarding is calling ``env`` right now,
    innermost first: SB3's ``__getattr__`` -> ``getattr_recursive`` frames above this
    one, each wrapping the one below. Empty when ``env`` was not reached that way."""
    chain: list[VecEnvWrapper] = []
    below: VecEnv = env
    frame = sys._getframe(2)
    try:
        while frame is not None and frame.f_code.co_name in _FORWARDING:
            owner = frame.f_locals.get("self")
            if isinstance(owner, VecEnvWrapper) and owner.venv is below:
                chain.append(owner)
                below = owner
            elif owner is not below:  # not the same wrapper's __getattr__ either
                break
            frame = frame.f_back
    finally:
        del frame
    return chain


_FORWARDING = ("getattr_recursive", "__getattr__")


def fork_wrapped(
    env: VecEnv,
    branch_id: str,
    indices: VecEnvIndices = None,
    copies: int = 1,
    reseed: int | Sequence[int | None] | None = None,
) -> VecEnv:
    """Fork the :class:`ForkVecEnv` under ``env``'s SB3 wrappers and wrap the branch in
    copies of them, their state carried: ``VecNormalize``'s running mean and variance
    copied (the branch updates its own copy), its returns and last observations, and
    ``VecFrameStack``'s stacked frames, of the sub-envs the branch is cloned from
    (``VecCheckNan`` and ``VecTransposeImage`` hold nothing more). Any other wrapper is
    refused with a TypeError naming it, before anything is forked."""
    chain: list[VecEnvWrapper] = []
    inner = env
    while isinstance(inner, VecEnvWrapper):
        chain.append(inner)
        inner = inner.venv
    if not isinstance(inner, ForkVecEnv):
        raise TypeError(
            f"fork_wrapped needs a ForkVecEnv under the wrappers, found {type(inner).__name__}"
        )
    chain.reverse()
    check_carried(chain)
    branch = inner.fork(branch_id, indices, copies, reseed)
    try:
        return copy_wrappers(chain, branch, inner.branch_sources(indices, copies))
    except BaseException:
        branch.close()
        raise
