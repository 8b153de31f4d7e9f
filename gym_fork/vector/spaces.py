"""Spaces and actions of a vector env: batching the sub-envs' spaces as AsyncVectorEnv
does, and turning a batch of actions into what the workers read."""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
from gymnasium import Space, spaces
from gymnasium.vector.utils import (
    batch_differing_spaces,
    batch_space,
    create_empty_array,
    iterate,
)

from gym_fork.errors import BadActionError, BadObservationError, SandboxStartError
from gym_fork.transport import text_codes
from gym_fork.transport.layout import leaf_values
from gym_fork.transport.layout import leaves as slab_leaves
from gym_fork.transport.slab import SlabSet
from gym_fork.transport.space_codec import SpaceRefused, space_from_data


def empty_buffer(space: Space, n: int) -> Any:
    """``create_empty_array(space, n, np.zeros)``, the buffer ``concatenate`` fills, but
    with "" for each Text entry: Gymnasium's holds ``min_length`` characters per entry
    (a sandbox declaring ``Text(2**30, min_length=2**30)`` cost the controller 1 GiB per
    sub-env; concatenate returns the texts themselves, never this buffer's). None for a
    custom space without one, as Gymnasium gives."""
    if isinstance(space, spaces.Text):
        return ("",) * n
    if isinstance(space, spaces.Dict):
        return {key: empty_buffer(child, n) for key, child in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(empty_buffer(child, n) for child in space.spaces)
    if isinstance(space, spaces.Sequence) and space.stack:  # Gymnasium's: one of n=1 each
        return tuple(empty_buffer(space.feature_space, 1) for _ in range(n))
    return create_empty_array(space, n=n, fn=np.zeros)


def empty_batch(space: Space, n: int) -> tuple[Any, ...] | dict[str, Any] | np.ndarray:
    """:func:`empty_buffer`, refused (TypeError) for a space that has none."""
    batch = empty_buffer(space, n)
    if batch is None:
        raise TypeError(f"{space} has no batch buffer")
    return batch


def ring_text_space(space: Space, obs_in_slab: bool, trusted: bool) -> Space | None:
    """The observation space whose values :func:`check_ring_observations` must look at:
    an untrusted vector env's, where they come in ring records and hold Text."""
    return None if obs_in_slab or trusted or not text_codes.has_text(space) else space


def check_ring_observations(
    space: Space | None, observations: list[Any], indices: list[int]
) -> None:
    """Observations an untrusted sandbox sent in ring records (``shared_memory=False``,
    or a space without a slab layout): their Text parts must be what a slab row would
    hold (a str of the charset, at most ``max_length``), else BadObservationError naming
    the sub-env. ``space``: :func:`ring_text_space`'s (None: nothing to look at; a
    trusted vector env's sandboxes may send any object, and no other leaf is looked at,
    as AsyncVectorEnv looks at none)."""
    if space is None:
        return
    for index, obs in zip(indices, observations, strict=True):
        problem = text_codes.misfit(space, obs)
        if problem:
            raise BadObservationError(
                f"sub-env {index}'s sandbox sent an observation that does not fit the "
                f"observation space {space}: {problem}"
            )


@dataclass
class VectorSpaces:
    """The single and batched spaces of a vector env, and how observations are checked
    against the sub-envs' own (``check_mode``: same, different or custom)."""

    single_observation_space: Space
    observation_space: Space
    single_action_space: Space
    action_space: Space
    sub_env_observation_spaces: list[Space]
    check_mode: str

    @classmethod
    def from_hellos(
        cls, observation_mode: Any, hellos: list[dict[str, Any]], *, trusted: bool
    ) -> VectorSpaces:
        """Batch the spaces the workers reported, as ``observation_mode`` asks (a pickled
        space is loaded only from ``trusted`` sandboxes)."""
        try:
            obs_spaces = [
                space_from_data(s, trusted=trusted) for h in hellos for s in h["observation_spaces"]
            ]
            act_spaces = [
                space_from_data(s, trusted=trusted) for h in hellos for s in h["action_spaces"]
            ]
        except (KeyError, TypeError) as exc:
            raise SandboxStartError(f"a sandbox reported malformed spaces: {exc!r:.200}") from exc
        except SpaceRefused as exc:
            raise SandboxStartError(f"a sandbox's spaces were refused: {exc}") from exc
        single_action = act_spaces[0]
        action_space = batch_space(single_action, len(act_spaces))
        mode = observation_mode
        if isinstance(mode, tuple) and len(mode) == 2:
            if not isinstance(mode[0], Space) or not isinstance(mode[1], Space):
                raise TypeError(
                    "Expected both elements of observation_mode to be Spaces, got "
                    f"{type(mode[0])} and {type(mode[1])}"
                )
            batched, single = mode
            check = "custom"
        elif mode == "same":
            single = obs_spaces[0]
            batched = batch_space(single, len(obs_spaces))
            check = "same"
        elif mode == "different":
            single = obs_spaces[0]
            batched = batch_differing_spaces(obs_spaces)
            check = "different"
        else:
            raise ValueError(
                "Invalid `observation_mode`, expected: 'same' or 'different' or tuple of single "
                f"and batch observation space, actual got {mode}"
            )
        return cls(single, batched, single_action, action_space, obs_spaces, check)

    def for_branch(self, observation_mode: Any, sources: list[int]) -> VectorSpaces:
        """The spaces of a branch whose sub-env j continues sub-env ``sources[j]``."""
        n = len(sources)
        same_size = n == len(self.sub_env_observation_spaces)
        sub_env_spaces = [self.sub_env_observation_spaces[i] for i in sources]
        if observation_mode == "different":
            batched = batch_differing_spaces(sub_env_spaces)
        elif isinstance(observation_mode, tuple):
            batched = self.observation_space  # custom: as given
        elif same_size:
            batched = _batched_again(self.observation_space, self.single_observation_space, n)
        else:
            batched = _batch(self.single_observation_space, n)
        actions = (
            _batched_again(self.action_space, self.single_action_space, n)
            if same_size
            else _batch(self.single_action_space, n)
        )
        return VectorSpaces(
            self.single_observation_space,
            batched,
            self.single_action_space,
            actions,
            sub_env_spaces,
            self.check_mode,
        )


# Single spaces whose batch_space is one space seeded with a copy of the single space's
# generator (gymnasium.vector.utils.space_utils), so that a copy of an earlier batch is
# the same space with the same randomness.
_COPIED_BATCHES = (spaces.Box, spaces.Discrete, spaces.MultiDiscrete, spaces.MultiBinary)


def _batched_again(batched: Space, single: Space, n: int) -> Space:
    """``batch_space(single, n)``, as a copy of ``batched`` (an earlier batch of it) where
    that is exact: building a batched Box of image observations costs ~11 ms per fork of
    a tree search, the copy under 1 (tests/vector/test_spaces.py)."""
    if type(single) not in _COPIED_BATCHES:
        return _batch(single, n)
    # Its generator is replaced below: not copied first (a generator's deepcopy goes
    # through pickling, ~40 us).
    copied = copy.deepcopy(batched, {id(batched._np_random): None})
    copied._np_random = _copy_generator(single.np_random)  # as batch_space seeds it
    return copied


def _batch(single: Space, n: int) -> Space:
    """``batch_space(single, n)``; for a Text space (an agent's observations and actions)
    the same space made without the deep copies its reseeding throws away: each of the
    n copies' generator went through pickling (~40 us) to be replaced, and its character
    tables (never changed after construction) were copied too, 20 ms of each 64-branch
    fork of a Text env (tests/vector/test_spaces.py: equal, and the same samples)."""
    if type(single) is not spaces.Text:
        return batch_space(single, n)
    generator = single.np_random  # made now where it was not yet, as batch_space does
    copies = tuple(copy.copy(single) for _ in range(n))  # each gets its own generator below
    batched = spaces.Tuple(copies, seed=_copy_generator(generator))
    seeds = _copy_generator(generator).integers(0, int(1e8), n)
    batched.seed([int(seed) for seed in seeds])  # each copy's own generator, from its seed
    return batched


# Bit generators a copy is made of by setting a fresh one's state (its seeding from the
# OS is ~10 us, a deepcopy ~40): numpy's own, whose state is all there is of them.
_STATEFUL_BIT_GENERATORS = (np.random.PCG64, np.random.PCG64DXSM, np.random.Philox)


def _copy_generator(generator: np.random.Generator) -> np.random.Generator:
    """A generator that draws (and spawns) what ``generator`` would from now on,
    independent of it: what ``copy.deepcopy`` makes."""
    bits = generator.bit_generator
    if type(generator) is not np.random.Generator or type(bits) not in _STATEFUL_BIT_GENERATORS:
        return copy.deepcopy(generator)
    seeds = bits.seed_seq
    if not isinstance(seeds, np.random.SeedSequence):
        return copy.deepcopy(generator)
    fresh = type(bits)(copy.deepcopy(seeds))
    fresh.state = bits.state
    return np.random.Generator(fresh)


@functools.singledispatch
def integer_bounds(space: Space) -> tuple[Any, Any] | None:
    """(low, high) of an integer action space, for ``check_actions`` on the slab path;
    None for spaces that are not checked there. Register a custom space with
    ``@integer_bounds.register``."""
    return None


@integer_bounds.register
def _(space: spaces.Discrete) -> tuple[Any, Any]:
    return space.start, space.start + space.n - 1


@integer_bounds.register
def _(space: spaces.MultiDiscrete) -> tuple[Any, Any]:
    return space.start, space.start + space.nvec - 1


@integer_bounds.register
def _(space: spaces.MultiBinary) -> tuple[Any, Any]:
    return 0, 1


class ActionWriter:
    """Turns a batch of actions into the workers' requests: scattered over their slabs
    (fast path) or one list per worker. Checks them first when ``check_actions`` is on."""

    def __init__(self, vector_spaces: VectorSpaces, slabs: SlabSet, check: bool) -> None:
        self.spaces = vector_spaces
        self.slabs = slabs
        self.check = check
        self.checked = check and any(
            integer_bounds(leaf.space) is not None for leaf in slab_leaves(slabs.action_layout)
        )

    def write_slab(self, actions: Any) -> bool:
        """Scatter an exact batch over the slabs; False (nothing written) otherwise."""
        if not self.slabs.accepts_actions(actions):
            return False
        if self.checked:
            self._check_integers(actions)
        self.slabs.write_actions(actions)
        return True

    def _check_integers(self, actions: Any) -> None:
        for leaf, values in leaf_values(self.slabs.action_layout, actions):
            bounds = integer_bounds(leaf.space)
            if bounds is None:
                continue
            low, high = bounds
            outside = (values < low) | (values > high)
            if np.any(outside):
                bad = np.flatnonzero(np.any(outside, axis=tuple(range(1, values.ndim))))
                raise BadActionError(
                    f"actions for sub-envs {bad.tolist()} are outside {leaf.space}: "
                    f"{values[bad].tolist()}"
                )

    def per_sub_env(self, actions: Any) -> list[Any]:
        """One action per sub-env, as AsyncVectorEnv passes them (checked if asked)."""
        action_space = self.spaces.action_space
        num_envs = len(self.spaces.sub_env_observation_spaces)
        expected = action_space.shape
        if (
            isinstance(actions, np.ndarray)
            and expected is not None
            and (actions.ndim != len(expected) or actions.shape[:1] != (num_envs,))
        ):
            raise BadActionError(
                f"expected a batch of actions of shape {expected} for "
                f"{action_space}, got an array of shape {actions.shape}"
            )
        try:
            per_env = list(iterate(action_space, actions))
        except (TypeError, ValueError, KeyError) as exc:
            raise BadActionError(
                f"actions do not fit the batched action space {action_space}: {exc}"
            ) from exc
        if len(per_env) != num_envs:
            raise BadActionError(
                f"expected {num_envs} actions (one per sub-env), got {len(per_env)}"
            )
        if self.check:
            single = self.spaces.single_action_space
            for i, action in enumerate(per_env):
                if not single.contains(action):
                    raise BadActionError(f"action for sub-env {i} is outside {single}: {action!r}")
        return per_env


def check_attached(checks: list[list[bool]], observation_mode: Any, action_space: Space) -> None:
    """Raise AsyncVectorEnv's errors when the sub-envs' own spaces (as the workers checked
    them at ATTACH: [same observation space, same action space] each) do not batch."""
    if not all(c[0] for c in checks):
        if observation_mode == "same":
            raise RuntimeError(
                "AsyncVectorEnv(..., observation_mode='same') however some of the "
                "sub-environments observation spaces are not equivalent. If this is "
                "intentional, use `observation_mode='different'` instead."
            )
        raise RuntimeError(
            "AsyncVectorEnv(..., observation_mode='different' or custom space) however the "
            "sub-environment's observation spaces do not share a common shape and dtype."
        )
    if not all(c[1] for c in checks):
        raise RuntimeError(
            f"Some environments have an action space different from "
            f"`{action_space}`. In order to batch actions, the action spaces "
            "from all environments must be equal."
        )
