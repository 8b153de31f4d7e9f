"""The worker loop: hosts one or more sub-envs and serves the controller's requests.

The same code runs in every sandbox kind. It owns no process management: a host
creates the sandbox, hands it a channel fd and a slab fd, and calls :func:`serve`.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import cloudpickle
import gymnasium as gym
from gymnasium.spaces.utils import is_space_dtype_shape_equiv
from gymnasium.vector import AutoresetMode

from gym_fork.errors import BadObservationError
from gym_fork.system.isolation import enter_sandbox
from gym_fork.system.linux import die_with_parent
from gym_fork.system.scratch import remove_scratch
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import pack
from gym_fork.transport.control import recv_message
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
    """Serves one channel for the sub-envs at ``indices``.

    ``make_env(origin)`` gives the env a slot starts from (a fresh build of env_fns
    [origin], or the warm parent's prepared prototype). ``sock`` is the side channel
    that brings fds for ``fork``; ``warm_parent`` adopts the clones this worker forks.
    """

    def __init__(
        self,
        channel: Channel,
        slab_fd: int,
        sock: socket.socket,
        indices: Sequence[int],
        origins: Sequence[int],
        make_env: Callable[[int], gym.Env],
        warm_parent: int,
    ) -> None:
        self.channel = channel
        self.slab_fd = slab_fd
        self.sock = sock
        self.indices = list(indices)
        self.origins = list(origins)
        self.make_env = make_env
        self.warm_parent = warm_parent
        self.slots: list[_SubEnvSlot] = []
        self.slab: Slab | None = None
        self.attach_arg: dict[str, Any] | None = None
        self.autoreset_mode = AutoresetMode.NEXT_STEP
        self.scratch: str | None = None
        self.isolation_config = None  # IsolationConfig, set by serve()
        self.tree_isolation = None  # Isolation of the tree, set by serve()
        self.isolation: dict[str, Any] = {}

    # -- start-up -------------------------------------------------------------------
    def hello(self, attach: dict[str, Any] | None = None) -> bool:
        """Build the sub-envs and report them; False if any failed to build.

        With ``attach`` (a replacement sandbox: the controller knows the spaces already)
        the worker attaches at once and reports only its pid and scratch dir.
        """
        errors = []
        for index, origin in zip(self.indices, self.origins, strict=True):
            try:
                env = self.make_env(origin)
            except Exception as exc:
                errors.append(_error_entry(index, exc))
                continue
            self.slots.append(_SubEnvSlot(index, env))
        if errors:
            self.channel.send([P.HELLO, 0, None, errors])
            return False
        if attach is not None:
            self.attach(attach)
            self.channel.send([P.HELLO, 0, self._identity(), None])
            return True
        first = self.slots[0].env
        info = {
            **self._identity(),
            "spec_id": getattr(first.spec, "id", None),
            "metadata": cloudpickle.dumps(dict(first.metadata)),
            "render_mode": first.render_mode,
            "observation_spaces": cloudpickle.dumps([s.env.observation_space for s in self.slots]),
            "action_spaces": cloudpickle.dumps([s.env.action_space for s in self.slots]),
        }
        self.channel.send([P.HELLO, 0, info, None])
        return True

    def _identity(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "scratch": self.scratch, "isolation": self.isolation}

    def enter_sandbox(self, copy_from: str | None = None) -> None:
        """Isolate this freshly forked process (see hosts/process/isolation.py)."""
        self.scratch, achieved = enter_sandbox(
            self.isolation_config, self.tree_isolation, self.warm_parent, copy_from
        )
        self.isolation = achieved.report()

    def attach(self, arg: dict[str, Any]) -> list[Any]:
        obs_space = _loaded(arg["observation_space"])
        act_space = _loaded(arg["action_space"])
        # Kept unpickled: clones forked from this worker attach with it directly.
        self.attach_arg = dict(arg, observation_space=obs_space, action_space=act_space)
        mode = arg["observation_mode"]
        self.autoreset_mode = AutoresetMode(arg["autoreset_mode"])
        self.slab = self.open_slab(obs_space, act_space, arg["num_envs"], arg["shared_memory"])
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

    def open_slab(self, obs_space, act_space, num_envs: int, use_observations: bool) -> Slab:
        """Map the vector env's batch slab (from the fd the host handed over)."""
        return Slab(
            obs_space,
            act_space,
            num_envs,
            use_observations=use_observations,
            region_fd=self.slab_fd,
        )

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

    def fork(self, arg: dict[str, Any]) -> tuple[list[int], list[Any]]:
        """Clone sub-envs of this worker, each into a new sandbox adopted by the warm parent.

        ``arg["clones"]`` lists ``[source_index, branch_index, seed, name]``; the fds
        (branch slab, then a channel and a socket per clone) arrive on ``self.sock``.
        """
        clones = arg["clones"]
        _message, fds = recv_message(self.sock)
        per = FDS_PER_SANDBOX
        if len(fds) != 1 + per * len(clones):
            for fd in fds:
                os.close(fd)
            raise RuntimeError(f"fork: expected {1 + per * len(clones)} fds, got {len(fds)}")
        branch_arg = dict(self.attach_arg, num_envs=arg["num_envs"])
        gc.freeze()  # what lives now is shared with the clones: keep the GC off it
        plan = []
        for k, (source_index, branch_index, seed, name) in enumerate(clones):
            slot = next(s for s in self.slots if s.index == source_index)
            mine = (fds[0], *fds[1 + per * k : 1 + per * (k + 1)])
            plan.append((slot, branch_index, seed, name, mine))
        try:
            pids = self._fork_clones(plan, fds, branch_arg, arg["ring_capacity"])
        finally:
            for fd in fds:
                os.close(fd)
        return pids, []

    def _fork_clones(self, plan, all_fds, branch_arg, capacity) -> list[int]:
        """Double fork: short-lived intermediates fork the clones, then exit, so the
        clones are orphaned and adopted by the warm parent (a subreaper) and outlive this
        worker. A large fan-out is split over one intermediate per core: forking copies
        this process's page tables, and two cores copy them twice as fast."""
        read_end, write_end = os.pipe()
        # The gate: clones block on it until every intermediate (its only other writers)
        # is gone, i.e. until they are orphans about to be adopted, instead of polling.
        gate_read, gate_write = os.pipe()
        cores = len(os.sched_getaffinity(0)) or 1
        parts = max(1, min(cores, len(plan) // FORKS_PER_INTERMEDIATE))
        intermediates = []
        for part in range(parts):
            pid = os.fork()
            if pid == 0:
                try:
                    os.close(read_end)
                    for k in range(part, len(plan), parts):
                        slot, branch_index, seed, name, mine = plan[k]
                        clone = os.fork()
                        if clone == 0:
                            os.close(write_end)
                            os.close(gate_write)
                            self._become_clone(
                                slot,
                                branch_index,
                                seed,
                                name,
                                mine,
                                all_fds,
                                branch_arg,
                                capacity,
                                gate_read,
                            )
                        # 16 bytes < PIPE_BUF: writes from several intermediates never mix
                        os.write(write_end, k.to_bytes(8, "little") + clone.to_bytes(8, "little"))
                finally:
                    os._exit(0)
            intermediates.append(pid)
        os.close(gate_read)
        os.close(gate_write)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            data = pipe.read()
        for pid in intermediates:
            os.waitpid(pid, 0)
        if len(data) != 16 * len(plan):
            raise RuntimeError(
                f"fork: {len(data) // 16} of {len(plan)} clones were created before a failure"
            )
        pids = [0] * len(plan)
        for i in range(0, len(data), 16):
            pids[int.from_bytes(data[i : i + 8], "little")] = int.from_bytes(
                data[i + 8 : i + 16], "little"
            )
        return pids

    def _become_clone(
        self, slot, branch_index, seed, name, mine, all_fds, branch_arg, capacity, gate
    ):
        slab_fd, channel_fd, sock_fd, out_fd, err_fd = mine
        redirect_output(out_fd, err_fd)

        def body() -> None:
            for fd in all_fds:
                if fd not in mine:
                    os.close(fd)
            # Let go of the source's channel, socket and slab: they are not ours.
            self.channel.close()
            self.sock.close()
            if self.slab is not None:
                self.slab.close()
            slot.index = branch_index
            if seed is not None:
                _reseed(slot.env, seed)
            worker = Worker(
                Channel.attach(channel_fd, capacity, name),
                slab_fd,
                socket.socket(fileno=sock_fd),
                [branch_index],
                [self.origins[self.slots.index(slot)]],
                self.make_env,
                self.warm_parent,
            )
            worker.slots = [slot]
            worker.isolation_config = self.isolation_config
            worker.tree_isolation = self.tree_isolation
            worker.enter_sandbox(copy_from=self.scratch)
            worker.attach(branch_arg)
            worker.channel.send([P.HELLO, 0, worker._identity(), None])
            _await_adoption(gate, self.warm_parent)
            worker.run()

        run_as_sandbox(body)

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
                remove_scratch(self.scratch)
                channel.send([P.CLOSE, seq, None, None])
                return
            if op == P.ATTACH:
                try:
                    result, errors = self.attach(arg), None
                except Exception as exc:
                    result, errors = None, [_error_entry(self.indices[0], exc)]
            elif op == P.PING:
                result, errors = os.getpid(), None
            elif op == P.REBIND and hasattr(self, "rebind"):
                self.rebind(arg)  # a restored microVM clone; it answers with a HELLO
                continue
            elif op == P.FORK:
                try:
                    result, errors = self.fork(arg)
                except Exception as exc:
                    result, errors = None, [_error_entry(self.indices[0], exc)]
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


def run_as_sandbox(body: Callable[[], None]) -> NoReturn:
    """Run a sandbox process's whole life; it never returns into the code that forked it."""
    code = 0
    try:
        body()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# A fan-out gets one more intermediate (up to one per core) per this many clones.
FORKS_PER_INTERMEDIATE = 16

# Fds handed to a new sandbox besides the slab: channel, side socket, stdout, stderr.
FDS_PER_SANDBOX = 4


def redirect_output(out_fd: int, err_fd: int) -> None:
    """Point fds 1 and 2 (and so print, logging, C stdio) at this sandbox's own pipes."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)


def _await_adoption(gate: int, warm_parent: int) -> None:
    """Block until the intermediate is gone (EOF on the gate), then tie our life to the
    warm parent that adopts us. Set-up and HELLO happen before, in parallel."""
    while os.read(gate, 1):
        pass
    os.close(gate)
    deadline = time.monotonic() + 5.0
    while os.getppid() != warm_parent and time.monotonic() < deadline:
        time.sleep(0.0001)  # exit_files() runs just before the reparenting in exit()
    die_with_parent(warm_parent)


def _loaded(value: Any) -> Any:
    """A space sent pickled (bytes) or already unpickled by the warm parent."""
    return cloudpickle.loads(value) if isinstance(value, bytes) else value


def _reseed(env: gym.Env, seed: int) -> None:
    """Give a clone its own randomness: the env's np_random and the global RNGs."""
    import random

    import numpy as np

    env.unwrapped.np_random = np.random.default_rng(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def serve(
    channel_fd: int,
    ring_capacity: int,
    slab_fd: int,
    sock_fd: int,
    indices: Sequence[int],
    origins: Sequence[int],
    make_env: Callable[[int], gym.Env],
    name: str,
    *,
    warm_parent: int,
    isolation: tuple,
    attach: dict[str, Any] | None = None,
) -> None:
    """Entry point of a worker sandbox: isolate, attach the channel, build, serve."""
    channel = Channel.attach(channel_fd, ring_capacity, name)
    sock = socket.socket(fileno=sock_fd)
    worker = Worker(channel, slab_fd, sock, indices, origins, make_env, warm_parent)
    worker.isolation_config, worker.tree_isolation = isolation
    worker.enter_sandbox()
    if worker.hello(attach):
        worker.run()
