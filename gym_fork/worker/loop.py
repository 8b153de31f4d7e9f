"""The worker loop: hosts one or more sub-envs and serves the controller's requests.

The same code runs in every sandbox kind. It owns no process management: a host
creates the sandbox, hands it a channel fd and a slab fd, and calls :func:`serve`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import gymnasium as gym
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode

from gym_fork.errors import BadObservationError
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import pack
from gym_fork.transport.slab import Slab

from . import protocol as P


def _error_entry(index: int, exc: BaseException) -> list[Any]:
    trace = traceback.format_exc()
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:
        pickled = None
    return [index, pickled, type(exc).__qualname__, str(exc), trace]


class _SubEnvSlot:
    """One sub-env inside this worker, with its autoreset bookkeeping."""

    __slots__ = ("autoreset", "env", "index", "last_obs")

    def __init__(self, index: int, env: gym.Env) -> None:
        self.index = index
        self.env = env
        self.autoreset = False
        self.last_obs: Any = None


class Worker:
    """Serves one channel for the sub-envs at ``indices``."""

    def __init__(
        self,
        channel: Channel,
        slab_fd: int,
        indices: Sequence[int],
        env_fns: Sequence[Callable[[], gym.Env]],
    ) -> None:
        self.channel = channel
        self.slab_fd = slab_fd
        self.indices = list(indices)
        self.env_fns = env_fns
        self.slots: list[_SubEnvSlot] = []
        self.slab: Slab | None = None
        self.autoreset_mode = AutoresetMode.NEXT_STEP

    # -- start-up -------------------------------------------------------------------
    def hello(self) -> bool:
        """Build the sub-envs and report their spaces; False if any failed to build."""
        errors = []
        for index in self.indices:
            try:
                env = self.env_fns[index]()
            except Exception as exc:
                errors.append(_error_entry(index, exc))
                continue
            self.slots.append(_SubEnvSlot(index, env))
        if errors:
            self.channel.send([P.HELLO, 0, None, errors])
            return False
        first = self.slots[0].env
        info = {
            "pid": os.getpid(),
            "metadata": cloudpickle.dumps(dict(first.metadata)),
            "render_mode": first.render_mode,
            "observation_spaces": cloudpickle.dumps([s.env.observation_space for s in self.slots]),
            "action_spaces": cloudpickle.dumps([s.env.action_space for s in self.slots]),
        }
        self.channel.send([P.HELLO, 0, info, None])
        return True

    def attach(self, arg: dict[str, Any]) -> list[Any]:
        obs_space = cloudpickle.loads(arg["observation_space"])
        act_space = cloudpickle.loads(arg["action_space"])
        mode = arg["observation_mode"]
        self.autoreset_mode = AutoresetMode(arg["autoreset_mode"])
        self.slab = Slab(
            obs_space,
            act_space,
            arg["num_envs"],
            use_observations=arg["shared_memory"],
            region_fd=self.slab_fd,
        )
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

    # -- requests -------------------------------------------------------------------
    def _store_obs(self, slot: _SubEnvSlot, obs: Any, out: list[Any] | None, k: int) -> None:
        if self.slab.observations is not None:
            try:
                self.slab.observations.write(slot.index, obs)
            except (ValueError, TypeError, KeyError, IndexError) as exc:
                raise BadObservationError(
                    f"sub-env {slot.index} returned an observation that does not fit the "
                    f"observation space {self.slab.observations.space}: {exc}"
                ) from exc
        else:
            out[k] = obs
        slot.last_obs = obs

    def reset(self, arg: list[Any]) -> tuple[list[Any], list[Any]]:
        n = len(self.slots)
        obs_out = None if self.slab.observations is not None else [None] * n
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
                self.slab.terminations[slot.index] = False
                self.slab.truncations[slot.index] = False
                infos[k] = info
            except Exception as exc:
                errors.append(_error_entry(slot.index, exc))
        return [obs_out, infos], errors

    def step(self, arg: list[Any] | None) -> tuple[list[Any], list[Any]]:
        slab = self.slab
        n = len(self.slots)
        obs_out = None if slab.observations is not None else [None] * n
        infos: list[Any] | None = None
        errors = []
        mode = self.autoreset_mode
        for k, slot in enumerate(self.slots):
            i = slot.index
            env = slot.env
            try:
                action = slab.actions.read(i) if arg is None else arg[k]
                if mode is AutoresetMode.NEXT_STEP:
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
                self._store_obs(slot, obs, obs_out, k)
                slab.rewards[i] = reward
                slab.terminations[i] = terminated
                slab.truncations[i] = truncated
                if info:
                    if infos is None:
                        infos = [{}] * n
                    infos[k] = info
            except Exception as exc:
                errors.append(_error_entry(i, exc))
        return [obs_out, infos], errors

    def call(self, arg: list[Any]) -> tuple[list[Any], list[Any]]:
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
                errors.append(_error_entry(slot.index, exc))
        return results, errors

    def setattr(self, arg: list[Any]) -> tuple[None, list[Any]]:
        name, values = arg
        errors = []
        for slot, value in zip(self.slots, values, strict=True):
            try:
                slot.env.set_wrapper_attr(name, value)
            except Exception as exc:
                errors.append(_error_entry(slot.index, exc))
        return None, errors

    def close_envs(self) -> None:
        for slot in self.slots:
            try:
                slot.env.close()
            except Exception:
                traceback.print_exc(file=sys.stderr)

    def run(self) -> None:
        """Serve requests until CLOSE. Every request gets exactly one reply."""
        handlers = {
            P.RESET: self.reset,
            P.STEP: self.step,
            P.CALL: self.call,
            P.SETATTR: self.setattr,
        }
        channel = self.channel
        while True:
            op, seq, arg = channel.recv()
            if op == P.CLOSE:
                self.close_envs()
                channel.send([P.CLOSE, seq, None, None])
                return
            if op == P.ATTACH:
                try:
                    result, errors = self.attach(arg), None
                except Exception as exc:
                    result, errors = None, [_error_entry(self.indices[0], exc)]
            elif op == P.PING:
                result, errors = os.getpid(), None
            else:
                handler = handlers.get(op)
                if handler is None:
                    result = None
                    errors = [
                        _error_entry(self.indices[0], RuntimeError(f"unknown operation {op!r}"))
                    ]
                else:
                    result, errors = handler(arg)
            try:
                record = pack([op, seq, result, errors or None])
            except Exception as exc:
                # An info or call result that cannot travel: report it, lose nothing else.
                record = pack([op, seq, None, [_error_entry(self.indices[0], exc)]])
            channel.send_raw(record)


def serve(
    channel_fd: int,
    ring_capacity: int,
    slab_fd: int,
    indices: Sequence[int],
    env_fns: Sequence[Callable[[], gym.Env]],
    name: str,
) -> None:
    """Entry point of a worker sandbox: attach the channel, build, serve, return."""
    channel = Channel.attach(channel_fd, ring_capacity, name)
    worker = Worker(channel, slab_fd, indices, env_fns)
    if worker.hello():
        worker.run()
