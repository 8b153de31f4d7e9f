"""Tree search end to end: a fixed-budget beam search, as nodes expanded per second.

    .venv/bin/python benchmarks/tree_search.py [--depth 50] [--width 4] [--rounds 3]
                                               [--envs pong,cstate] [--methods fork,replay]
                                               [--microvm] [--json OUT]

The same beam search (keep the ``width`` best action sequences at every depth, expand each
with every action of a fixed set, ``depth`` levels) done four ways:

  fork     gym_fork: the beam is one ForkVectorEnv; each level is ONE ``fork`` of the
           kept sub-envs (``copies`` = actions, one round trip) and one batched step
  replay   what users do without a clone: for each child, ``reset(seed)`` one env and
           replay the child's action prefix (its cost grows with the depth)
  native   ALE's own ``cloneState``/``restoreState`` (the floor; Pong only)
  microvm  ``fork`` on the microVM host (``--microvm``; TCG here, so slow)

Envs: ALE Pong (sticky actions off, so every method sees the same deterministic game) and
``CStateEnv``, an env whose state lives in malloc'd C memory (no deepcopy, no pickle, no
clone of its own) with a ~100 us step. Every method must find the same best sequence
and return; the script exits non-zero if one does not.

Nodes per second count the search alone: building the env (or the warm parent) and its
first reset are the set-up, reported apart (replay's resets are part of its search).
For fork, a level's time is also split (medians): the fork, the branch's first step and
the close of the level it was forked from.
Each (env, method) measurement runs in a fresh interpreter, the methods interleaved
over ``rounds``; medians with min-max (``--methods fork``: that one alone, a quick A/B of
the library; the ratios then print as "-"). Memory: peak summed PSS of the search's
processes (for fork: the controller, the warm parent tree and every sandbox), sampled
once per level.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

PONG_ACTIONS = (0, 2, 3)  # NOOP, UP, DOWN: the moves that matter
CSTATE_ACTIONS = (0, 1, 2)
SEED = 7


class CStateEnv(gym.Env):
    """A noisy 1-D walk in C memory whose step busy-works ``step_us`` microseconds."""

    metadata = {"render_modes": []}

    def __init__(self, step_us: float = 100.0, horizon: int = 10_000):
        self.observation_space = spaces.Box(-1e6, 1e6, (2,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.step_s, self.horizon = step_us * 1e-6, horizon
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        self._cell = ctypes.cast(libc.malloc(16), ctypes.POINTER(ctypes.c_int64))

    def _obs(self) -> np.ndarray:
        return np.array([self._cell[0], self._cell[1]], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._cell[0] = int(self.np_random.integers(-3, 4))
        self._cell[1] = 0
        return self._obs(), {}

    def step(self, action):
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        self._cell[0] += int(action) - 1 + int(self.np_random.choice([-1, 0, 0, 1]))
        self._cell[1] += 1
        reward = -abs(int(self._cell[0]) - 20) / 10.0
        return self._obs(), reward, False, bool(self._cell[1] >= self.horizon), {}


def make_pong() -> gym.Env:
    import ale_py

    gym.register_envs(ale_py)
    return gym.make("ALE/Pong-v5", repeat_action_probability=0.0)


ENVS: dict[str, tuple[Callable[[], gym.Env], tuple[int, ...]]] = {
    "pong": (make_pong, PONG_ACTIONS),
    "cstate": (CStateEnv, CSTATE_ACTIONS),
}


Node = tuple[float, tuple[int, ...], Any]  # return so far, action prefix, where it lives
Expand = Callable[[list[Node]], list[Node]]  # a level's children, each action of each node


def beam_search(root: Any, expand: Expand, depth: int, width: int, sample=None) -> tuple:
    """Keep the ``width`` best children at each of ``depth`` levels: highest return, then
    the smallest action sequence (so every method keeps the same nodes on ties). Returns
    the best return, its actions and how many nodes were expanded."""
    beam: list[Node] = [(0.0, (), root)]
    expanded = 0
    for _ in range(depth):
        children = expand(beam)
        expanded += len(children)
        beam = sorted(children, key=lambda c: (-c[0], c[1]))[:width]
        if sample:
            sample()
    return beam[0][0], beam[0][1], expanded


def search_fork(make, actions, depth, width, host="process", sample=None, levels=None) -> tuple:
    """Each level is one fork of the kept sub-envs (a copy per action) and one step.
    ``levels``: a list that gets each level's (fork, step, close) seconds."""
    from gym_fork import ForkVectorEnv

    env = ForkVectorEnv.from_parent(make, 1, host=host, lineage_log=False)
    env.reset(seed=SEED)
    started = time.perf_counter()
    live = [env]

    def expand(beam: list[Node]) -> list[Node]:
        k = len(actions)
        begin = time.perf_counter()
        branch = live[0].fork(f"level-{len(beam[0][1])}", [n[2] for n in beam], copies=k)
        forked = time.perf_counter()
        _, rewards, _, _, _ = branch.step(np.array(actions * len(beam)))  # source, then copy
        stepped = time.perf_counter()
        live[0].close()
        if levels is not None:
            levels.append((forked - begin, stepped - forked, time.perf_counter() - stepped))
        live[0] = branch
        return [
            (ret + float(rewards[i * k + c]), (*prefix, actions[c]), i * k + c)
            for i, (ret, prefix, _) in enumerate(beam)
            for c in range(k)
        ]

    try:
        return (*beam_search(0, expand, depth, width, sample), started)
    finally:
        live[0].close()


def search_replay(make, actions, depth, width, sample=None) -> tuple:
    """Each child rebuilt by ``reset(seed)`` and replaying its action prefix."""
    env = make()
    env.reset(seed=SEED)
    started = time.perf_counter()

    def child(ret: float, prefix: tuple[int, ...], action: int) -> Node:
        env.reset(seed=SEED)
        for b in prefix:
            env.step(b)
        return (ret + float(env.step(action)[1]), (*prefix, action), None)

    def expand(beam: list[Node]) -> list[Node]:
        return [child(ret, prefix, a) for ret, prefix, _ in beam for a in actions]

    try:
        return (*beam_search(None, expand, depth, width, sample), started)
    finally:
        env.close()


def search_native(make, actions, depth, width, sample=None) -> tuple:
    """Each child restored from its parent's ``cloneState`` (ALE's own)."""
    env = make()
    env.reset(seed=SEED)
    ale = env.unwrapped.ale
    started = time.perf_counter()

    def child(ret: float, prefix: tuple[int, ...], state: Any, action: int) -> Node:
        ale.restoreState(state)
        reward = float(env.step(action)[1])
        return (ret + reward, (*prefix, action), ale.cloneState())

    def expand(beam: list[Node]) -> list[Node]:
        return [child(ret, prefix, state, a) for ret, prefix, state in beam for a in actions]

    try:
        return (*beam_search(ale.cloneState(), expand, depth, width, sample), started)
    finally:
        env.close()


def _tree_pss_kb() -> int:
    """Summed PSS of this process and every process whose ancestry or session started
    here: descendants, plus the zygote's warm parents (reparented away from us)."""
    from gym_fork.bench.clones import pss_kb, tree_of

    pids = set(tree_of(os.getpid()))
    for pid in list(pids):  # a zygote's warm parents are its children: already in the tree
        pids.update(tree_of(pid))
    return sum(pss_kb(p) for p in pids)


def run_one(env_name: str, method: str, depth: int, width: int) -> dict[str, Any]:
    """One measurement, in this interpreter."""
    make, actions = ENVS[env_name]
    peak = [0]
    sampling = [0.0]  # the PSS walks of /proc are not the search's time

    def sample() -> None:
        begin = time.perf_counter()
        peak[0] = max(peak[0], _tree_pss_kb())
        sampling[0] += time.perf_counter() - begin

    levels: list[tuple[float, float, float]] = []
    start = time.perf_counter()
    if method == "fork":
        ret, best, expanded, started = search_fork(
            make, actions, depth, width, sample=sample, levels=levels
        )
    elif method == "microvm":
        ret, best, expanded, started = search_fork(
            make, actions, depth, width, "microvm", sample, levels
        )
    elif method == "replay":
        ret, best, expanded, started = search_replay(make, actions, depth, width, sample)
    elif method == "native":
        ret, best, expanded, started = search_native(make, actions, depth, width, sample)
    else:
        raise SystemExit(f"unknown method {method!r}")
    end = time.perf_counter()
    seconds = end - started - sampling[0]
    return {
        "env": env_name,
        "method": method,
        "setup_s": started - start,
        "seconds": seconds,
        "nodes_per_s": expanded / seconds,
        "expanded": expanded,
        "peak_pss_mb": peak[0] / 1024,
        "best_return": ret,
        "best": list(best),
        # Per level, medians (ms): the fork, the branch's first step, the source's close.
        "level_ms": [1e3 * statistics.median(p) for p in zip(*levels, strict=True)]
        if levels
        else None,
    }


def _fresh(env_name: str, method: str, depth: int, width: int) -> dict[str, Any]:
    from gym_fork.bench.fresh import last_json

    argv = [sys.executable, __file__, "--one", f"{env_name}:{method}"]
    argv += ["--depth", str(depth), "--width", str(width)]
    return last_json(argv, 1800, f"{env_name}:{method}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--envs", default="pong,cstate", help="comma-separated: pong, cstate")
    parser.add_argument(
        "--methods", help="comma-separated: only these of fork, replay, native, microvm"
    )
    parser.add_argument("--microvm", action="store_true", help="add the microVM host's fork")
    parser.add_argument("--json", metavar="OUT", help="write every measurement as JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # ENV:METHOD, in this interpreter
    args = parser.parse_args()
    if args.one:
        env_name, method = args.one.split(":")
        print(json.dumps(run_one(env_name, method, args.depth, args.width)))
        return
    plans = []
    for env_name in args.envs.split(","):
        methods = ["fork", "replay"] + (["native"] if env_name == "pong" else [])
        methods += ["microvm"] if args.microvm else []
        if args.methods:
            methods = [m for m in methods if m in args.methods.split(",")]
        plans.append((env_name, methods))
    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):  # interleaved: round-robin over every contender
        for env_name, methods in plans:
            for method in methods:
                r = _fresh(env_name, method, args.depth, args.width)
                results.setdefault((env_name, method), []).append(r)
                print(f"  {env_name:7} {method:8} {r['nodes_per_s']:10.0f} nodes/s", flush=True)
    failed = False
    print(f"\ndepth {args.depth}, width {args.width}, medians of {args.rounds} [min-max]")
    print(
        "| env | method | nodes/s | vs replay | vs native | set-up (s) | peak PSS (MB) "
        "| best return |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for env_name, methods in plans:
        med = {
            m: statistics.median(r["nodes_per_s"] for r in results[(env_name, m)]) for m in methods
        }
        bests = {tuple(r["best"]) for m in methods for r in results[(env_name, m)]}
        if len(bests) != 1:
            failed = True
            print(
                f"MISMATCH on {env_name}: the methods found {len(bests)} different best sequences"
            )
        for m in methods:
            runs = results[(env_name, m)]
            rates = [r["nodes_per_s"] for r in runs]
            pss = statistics.median(r["peak_pss_mb"] for r in runs)
            setup = statistics.median(r["setup_s"] for r in runs)
            vs_native = f"{med[m] / med['native']:.3f}x" if "native" in med else "-"
            vs_replay = f"{med[m] / med['replay']:.2f}x" if "replay" in med else "-"
            print(
                f"| {env_name} | {m} | {med[m]:,.0f} [{min(rates):,.0f}-{max(rates):,.0f}] "
                f"| {vs_replay} | {vs_native} | {setup:.2f} | {pss:.0f} "
                f"| {runs[0]['best_return']:.2f} |"
            )
    for env_name, methods in plans:
        for m in methods:
            parts = [r["level_ms"] for r in results[(env_name, m)] if r.get("level_ms")]
            if parts:
                fork, step, close = (statistics.median(p[i] for p in parts) for i in range(3))
                print(
                    f"{env_name} {m}: a level (median, ms): fork {fork:.1f}, first step "
                    f"{step:.1f}, close of the source level {close:.1f}"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r for runs in results.values() for r in runs], f, indent=1)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
