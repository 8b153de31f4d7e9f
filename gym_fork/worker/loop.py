"""The worker loop: hosts one or more sub-envs and serves the controller's requests.

The same code serves every sandbox kind (a forked process, a microVM guest, a thread of
the controller for ``host="inline"``). It makes no process: a host creates the sandbox,
gives it a channel and the means to map the batch slab, and calls :meth:`Worker.run`.
Hosts extend it by subclassing: where the slab lives (:meth:`Worker.open_slab`), what a
sandbox reports about itself (:meth:`Worker.identity`) and extra operations
(:meth:`Worker.extra_handlers`, e.g. FORK for the process host).
"""

from __future__ import annotations

import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, SupportsFloat

import cloudpickle
import gymnasium as gym
import numpy as np
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode

from gym_fork._ring import lib
from gym_fork.errors import BadObservationError
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import pack, pack_empty_reply
from gym_fork.transport.layout import ArrayLeaf
from gym_fork.transport.slab import Slab
from gym_fork.transport.space_codec import mapping_to_data, space_to_data
from gym_fork.transport.spin import SpinChoice

from . import protocol as P
from .protocol import error_record

Handler = Callable[[Any], tuple[Any, list[dict[str, Any]] | None]]


class SubEnvSlot:
    """One sub-env inside a worker, with its autoreset bookkeeping."""

    __slots__ = ("autoreset", "env", "index", "last_obs")

    def __init__(self, index: int, env: gym.Env) -> None:
        self.index = index
        self.env = env
        self.autoreset = False
        self.last_obs: Any = None


class Worker:
    """Serves one channel for the sub-envs at ``indices``.

    ``make_env(origin)`` gives the env a slot starts from (a fresh build of env_fns
    [origin], or the warm parent's prepared prototype). ``slab_fd`` is this sandbox's own
    slab (its sub-envs' rows only), handed over by the controller and mapped at ATTACH.
    """

    def __init__(
        self,
        channel: Channel,
        indices: Sequence[int],
        origins: Sequence[int],
        make_env: Callable[[int], gym.Env],
        slab_fd: int = -1,
    ) -> None:
        self.channel = channel
        self.indices = list(indices)
        self.origins = list(origins)
        self.make_env = make_env
        self.slab_fd = slab_fd
        self.slots: list[SubEnvSlot] = []
        self.slab: Slab | None = None
        self.attach_arg: dict[str, Any] | None = None
        self.autoreset_mode = AutoresetMode.NEXT_STEP
        self.isolation: dict[str, Any] = {}

    # -- hooks for hosts ------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """What this sandbox reports about itself in its HELLO."""
        return {"pid": os.getpid(), "isolation": self.isolation}

    def open_slab(self, obs_space, act_space, num_envs: int, use_observations: bool) -> Slab:
        """Map the vector env's batch slab (from the fd the host handed over)."""
        return Slab(
            obs_space,
            act_space,
            num_envs,
            use_observations=use_observations,
            region_fd=self.slab_fd,
        )

    def extra_handlers(self) -> dict[int, Handler]:
        """Operations a host adds to the loop (op -> handler)."""
        return {}

    def on_close(self) -> Any:
        """Called after the sub-envs are closed; its result is the CLOSE reply's."""
        return None

    # -- start-up -------------------------------------------------------------------
    def hello(self, attach: dict[str, Any] | None = None) -> bool:
        """Build the sub-envs and report them; False if any failed to build.

        With ``attach`` (a replacement sandbox: the controller knows the spaces already)
        the worker attaches at once and reports only its identity.
        """
        errors = []
        for index, origin in zip(self.indices, self.origins, strict=True):
            try:
                env = self.make_env(origin)
            except Exception as exc:
                errors.append(error_record(index, exc))
                continue
            self.slots.append(SubEnvSlot(index, env))
        if errors:
            self.channel.send([P.HELLO, 0, None, errors])
            return False
        if attach is not None:
            self.attach(attach)
            self.channel.send([P.HELLO, 0, self.identity(), None])
            return True
        first = self.slots[0].env
        # Plain data, not pickles: an untrusted sandbox's HELLO is read without loading
        # any pickle (transport/space_codec.py).
        spec_id = getattr(first.spec, "id", None)
        info = {
            **self.identity(),
            "spec_id": spec_id if isinstance(spec_id, str) else None,
            "metadata": mapping_to_data(dict(first.metadata)),
            "render_mode": first.render_mode if isinstance(first.render_mode, str) else None,
            "observation_spaces": [space_to_data(s.env.observation_space) for s in self.slots],
            "action_spaces": [space_to_data(s.env.action_space) for s in self.slots],
        }
        self.channel.send([P.HELLO, 0, info, None])
        return True

    def attach(self, arg: dict[str, Any]) -> list[list[bool]]:
        """Map the slab for the controller's spaces; per sub-env: [same obs, same act]."""
        obs_space, act_space = self._map_slab(arg)
        mode = arg["observation_mode"]
        checks = []
        for slot in self.slots:
            env = slot.env
            same_obs = (
                obs_space == env.observation_space
                if mode == "same"
                else is_space_dtype_shape_equiv(obs_space, env.observation_space)
            )
            checks.append([bool(same_obs), bool(act_space == env.action_space)])
        return checks

    def _map_slab(self, arg: dict[str, Any]) -> tuple[Any, Any]:
        """This sandbox's own slab (one row per sub-env it hosts, in slot order), mapped
        for the spaces of ``arg``; returns them."""
        obs_space = _loaded(arg["observation_space"])
        act_space = _loaded(arg["action_space"])
        # Kept unpickled: clones made from this worker attach with it directly.
        self.attach_arg = dict(arg, observation_space=obs_space, action_space=act_space)
        self.autoreset_mode = AutoresetMode(arg["autoreset_mode"])
        if self.slab is not None:
            self.slab.close()
        self.slab = self.open_slab(obs_space, act_space, len(self.slots), arg["shared_memory"])
        return obs_space, act_space

    # -- a clone's new identity -----------------------------------------------------
    def hosted(self, index: int) -> SubEnvSlot:
        """The slot of sub-env ``index`` (RuntimeError when this worker does not host it)."""
        slot = next((s for s in self.slots if s.index == index), None)
        if slot is None:
            raise RuntimeError(f"fork: this worker does not host sub-env {index}")
        return slot

    def become_clone(self, source: int, index: int, seed: int | None, num_envs: int) -> None:
        """Turn this copy of a running worker into the clone of its sub-env ``source``,
        whatever made the copy (a forked process, a restored VM): it keeps that one
        sub-env, now sub-env ``index`` of a branch of ``num_envs`` (its worker-mates stay
        with the source, dropped here unclosed as a forked process drops them), reseeded
        with ``seed`` when given; it maps the branch's slab with the source's spaces and
        announces itself with a HELLO."""
        slot = self.hosted(source)
        if self.attach_arg is None:
            raise RuntimeError("fork: the source worker had not attached its slab")
        self.origins = [self.origins[self.slots.index(slot)]]
        self.slots = [slot]
        slot.index = index
        self.indices = [index]
        if seed is not None:
            reseed_env(slot.env, seed)
        # Its source's spaces, checked against its env at the source's ATTACH: not again
        # (~0.4 ms of a clone's birth, most of it copy-on-write faults).
        self._map_slab(dict(self.attach_arg, num_envs=num_envs))
        self.channel.send([P.HELLO, 0, self.identity(), None])

    # -- requests -------------------------------------------------------------------
    def _attached(self) -> Slab:
        """The slab mapped at ATTACH (the controller attaches before any other request)."""
        if self.slab is None:
            raise RuntimeError("a request that needs the slab came before ATTACH")
        return self.slab

    def _store_obs(self, slot: SubEnvSlot, obs: Any, out: list[Any] | None, k: int) -> None:
        leaf = self._attached().observations
        if leaf is not None:
            try:
                leaf.write(k, obs)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                self._bad_obs(slot, exc)
        else:
            assert out is not None  # no slab leaf: the caller's list carries them
            out[k] = obs
        slot.last_obs = obs

    def reset(self, arg: list[Any]) -> tuple[list[Any], list[Any]]:
        """Reset the masked sub-envs with their seeds and options."""
        n = len(self.slots)
        slab = self._attached()
        obs_out = None if slab.observations is not None else [None] * n
        infos: list[Any] = [None] * n
        errors = []
        for k, (slot, (seed, options, do_reset)) in enumerate(zip(self.slots, arg, strict=True)):
            if not do_reset:
                if obs_out is not None:
                    obs_out[k] = slot.last_obs
                infos[k] = {}
                continue
            try:
                obs, info = slot.env.reset(seed=seed, options=options)
                slot.autoreset = False
                self._store_obs(slot, obs, obs_out, k)
                slab.terminations[k] = False
                slab.truncations[k] = False
                infos[k] = info
            except Exception as exc:
                errors.append(error_record(slot.index, exc))
        return [obs_out, infos], errors

    def step(self, arg: list[Any] | None) -> tuple[list[Any], list[Any] | None]:
        """Step every sub-env: actions from the slab (``arg`` None) or from the request."""
        slab = self._attached()
        n = len(self.slots)
        obs_leaf = slab.observations
        obs_out = None if obs_leaf is not None else [None] * n
        # Hot path (docs/benchmarks-notebook.md, "where a small step's time goes"): the common
        # leaves are plain arrays, read and written here without a call per leaf.
        obs_array: np.ndarray | None = None  # set for a plain array leaf only
        if type(obs_leaf) is ArrayLeaf:
            obs_array, obs_shape, obs_space = obs_leaf.array, obs_leaf.shape, obs_leaf.space
        act_leaf = slab.actions
        scalar_actions = arg is None and type(act_leaf) is ArrayLeaf and not act_leaf.shape
        if scalar_actions:
            act_array = act_leaf.array
        rewards, terminations, truncations = slab.rewards, slab.terminations, slab.truncations
        infos: list[Any] | None = None
        errors = None
        reward: SupportsFloat
        mode = self.autoreset_mode
        next_step = mode is AutoresetMode.NEXT_STEP
        for k, slot in enumerate(self.slots):
            env = slot.env
            try:
                if scalar_actions:
                    action = act_array[k]
                else:
                    action = act_leaf.read(k) if arg is None else arg[k]
                if next_step:
                    if slot.autoreset:
                        obs, info = env.reset()
                        reward, terminated, truncated = 0, False, False
                    else:
                        obs, reward, terminated, truncated, info = env.step(action)
                    slot.autoreset = terminated or truncated
                elif mode is AutoresetMode.SAME_STEP:
                    obs, reward, terminated, truncated, info = env.step(action)
                    if terminated or truncated:
                        reset_obs, reset_info = env.reset()
                        info = {"final_info": info, "final_obs": obs, **reset_info}
                        obs = reset_obs
                else:
                    obs, reward, terminated, truncated, info = env.step(action)
                if obs_array is not None:
                    try:
                        value = np.asarray(obs)
                        if value.shape != obs_shape:
                            raise ValueError(
                                f"expected shape {obs_shape} for {obs_space}, got {value.shape}"
                            )
                        obs_array[k] = value
                    except (ValueError, TypeError, KeyError, IndexError) as exc:
                        self._bad_obs(slot, exc)
                    slot.last_obs = obs
                else:
                    self._store_obs(slot, obs, obs_out, k)
                rewards[k] = reward
                terminations[k] = terminated
                truncations[k] = truncated
                if info:
                    if infos is None:
                        infos = [{}] * n
                    infos[k] = info
            except Exception as exc:
                if errors is None:
                    errors = []
                errors.append(error_record(slot.index, exc))
        return [obs_out, infos], errors

    def _bad_obs(self, slot: SubEnvSlot, exc: Exception) -> None:
        leaf = self._attached().observations
        space = leaf.space if leaf is not None else None
        raise BadObservationError(
            f"sub-env {slot.index} returned an observation that does not fit the "
            f"observation space {space}: {exc}"
        ) from exc

    def call(self, arg: list[Any]) -> tuple[list[Any], list[Any]]:
        """Call a method (or read an attribute) of every sub-env."""
        name, args, kwargs = arg
        results: list[Any] = [None] * len(self.slots)
        errors = []
        for k, slot in enumerate(self.slots):
            try:
                if name in P.RESERVED_CALLS:
                    raise ValueError(
                        f"Trying to call function `{name}` with `call`, "
                        f"use `{name}` directly instead."
                    )
                attr = slot.env.get_wrapper_attr(name)
                results[k] = attr(*args, **kwargs) if callable(attr) else attr
            except Exception as exc:
                errors.append(error_record(slot.index, exc))
        return results, errors

    def setattr(self, arg: list[Any]) -> tuple[None, list[Any]]:
        """Set an attribute of every sub-env (one value each)."""
        name, values = arg
        errors = []
        for slot, value in zip(self.slots, values, strict=True):
            try:
                slot.env.set_wrapper_attr(name, value)
            except Exception as exc:
                errors.append(error_record(slot.index, exc))
        return None, errors

    def close_envs(self) -> None:
        """Close every sub-env; an env whose close raises is reported on stderr."""
        for slot in self.slots:
            try:
                slot.env.close()
            except Exception:
                traceback.print_exc(file=sys.stderr)

    def run(self, first_wait_asleep: bool = False) -> None:
        """Serve requests until CLOSE. Every request gets exactly one reply.

        ``first_wait_asleep``: wait for the first request asleep (futex) from the start,
        not spinning first; later waits spin as usual."""
        handlers: dict[int, Handler] = {
            P.RESET: self.reset,
            P.STEP: self.step,
            P.CALL: self.call,
            P.SETATTR: self.setattr,
            P.ATTACH: self._guarded(self.attach),
            **self.extra_handlers(),
        }
        channel = self.channel
        receive = self._recv_asleep if first_wait_asleep else channel.recv
        spin = SpinChoice()  # long steps: wait for the next request spinning longer
        inbox = channel.inbox
        clock = time.perf_counter
        while True:
            op, seq, arg = receive()
            receive = channel.recv
            if op == P.CLOSE:
                self.close_envs()
                channel.send([P.CLOSE, seq, self.on_close(), None])
                return
            handler = handlers.get(op)
            result: Any
            errors: list[dict[str, Any]] | None
            if handler is None:
                result = None
                errors = [error_record(self.indices[0], RuntimeError(f"unknown operation {op!r}"))]
            elif op == P.STEP and not inbox.polling:
                started = clock()
                result, errors = handler(arg)
                rounds = spin.observe(clock() - started)
                if inbox.spin != rounds:
                    inbox.set_spin(rounds)
            else:
                result, errors = handler(arg)
            if result is NO_REPLY:
                continue
            if (
                not errors
                and op == P.STEP
                and type(seq) is int
                and result[0] is None
                and result[1] is None
            ):
                channel.send_raw(pack_empty_reply(op, seq))  # every result is in the slab
                continue
            try:
                record = pack([op, seq, result, errors or None])
            except Exception as exc:
                # An info or call result that cannot travel: report it, lose nothing else.
                record = pack([op, seq, None, [error_record(self.indices[0], exc)]])
            channel.send_raw(record)

    def _recv_asleep(self) -> Any:
        ring = self.channel.inbox
        spin, ring.spin = ring.spin, ring.spin & lib.GF_SPIN_POLL  # sleep at once
        try:
            return self.channel.recv()
        finally:
            ring.spin = spin

    def _guarded(self, function: Callable[[Any], Any]) -> Handler:
        """A handler whose exception is the worker's error, not a per-sub-env one."""

        def handler(arg: Any) -> tuple[Any, list[dict[str, Any]] | None]:
            try:
                return function(arg), None
            except Exception as exc:
                return None, [error_record(self.indices[0], exc)]

        return handler


# A handler's result that means "this operation answers on its own" (REBIND: a HELLO).
NO_REPLY = object()


def _loaded(value: Any) -> Any:
    """A space sent pickled (bytes) or already unpickled by the warm parent."""
    return cloudpickle.loads(value) if isinstance(value, bytes) else value


def reseed_env(env: gym.Env, seed: int) -> None:
    """Give a clone its own randomness: the env's np_random and the global RNGs."""
    env.unwrapped.np_random = np.random.default_rng(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
