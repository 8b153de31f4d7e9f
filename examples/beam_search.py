"""Beam search over an environment that cannot clone itself, by forking sandboxes.

Run:  .venv/bin/python examples/beam_search.py [--depth 6] [--width 4] [--seed 3]

Its search tree goes to the lineage log (the default one: $GYM_FORK_LINEAGE_LOG, else
~/.local/state/gym_fork/lineage.jsonl). Look at it afterwards with

    gym-fork lineage                       # the latest run's tree, headed by time and script
    gym-fork lineage --html tree.html      # the same as a page (--png tree.png: an image)

Tree search needs to expand a node: take the environment exactly as it is at that
node and try every action. Most environments cannot copy their own state: here the
state lives in C memory (a ctypes buffer from malloc), so ``copy.deepcopy`` fails and
``pickle`` refuses, the way ALE, Box2D or MuJoCo handles behave. gym_fork branches
the *sandbox* instead: ``envs.fork(...)`` clones the whole process copy-on-write, so
every child continues from the exact state, RNG included.

The search keeps the ``width`` best action sequences at each depth. Each beam node
is one sub-env of some branch; expanding it is one ``fork`` with one copy per action,
and one batched ``step`` tries all the actions at once.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from gym_fork import ForkVectorEnv


class CStateWalk(gym.Env):
    """A noisy 1-D walk whose position lives in malloc'd C memory.

    Actions 0/1/2 move left/stay/right; a random push (from ``np_random``) is added.
    Reward is higher the closer the walker is to ``target``. ``deepcopy`` raises:
    ctypes pointers cannot be copied, just like real simulator handles.
    """

    metadata = {"render_modes": []}

    def __init__(self, target: int = 5, horizon: int = 12):
        self.observation_space = spaces.Box(-100, 100, (2,), np.float64)
        self.action_space = spaces.Discrete(3)
        self.target, self.horizon = target, horizon
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        self._cell = ctypes.cast(libc.malloc(16), ctypes.POINTER(ctypes.c_int64))

    def _obs(self):
        return np.array([self._cell[0], self._cell[1]], dtype=np.float64)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._cell[0] = int(self.np_random.integers(-2, 3))  # position
        self._cell[1] = 0  # time step
        return self._obs(), {}

    def step(self, action):
        push = int(self.np_random.choice([-1, 0, 0, 1]))
        self._cell[0] += int(action) - 1 + push
        self._cell[1] += 1
        reward = -abs(self._cell[0] - self.target) / 10.0
        terminated = self._cell[0] == self.target
        truncated = self._cell[1] >= self.horizon
        return self._obs(), reward, bool(terminated), bool(truncated), {}


@dataclass
class Node:
    """A beam entry: where its env lives, how it got there, and what it earned."""

    envs: ForkVectorEnv
    index: int
    actions: tuple[int, ...]
    ret: float
    done: bool


def beam_search(make_env, seed: int, depth: int, width: int) -> list[Node]:
    """The ``width`` best action sequences of length <= ``depth`` from ``reset(seed)``."""
    root = ForkVectorEnv.from_parent(make_env, 1)  # its tree goes to the default lineage log
    root.reset(seed=seed)
    beam = [Node(root, 0, (), 0.0, False)]
    n_actions = int(root.single_action_space.n)
    alive = {id(root): root}
    for level in range(depth):
        children: list[Node] = []
        for node in beam:
            if node.done:
                children.append(node)
                continue
            name = f"d{level}-" + (".".join(map(str, node.actions)) or "root")
            branch = node.envs.fork(name, indices=[node.index], copies=n_actions)
            alive[id(branch)] = branch
            _, rewards, term, trunc, _ = branch.step(np.arange(n_actions))
            for a in range(n_actions):
                children.append(
                    Node(
                        branch,
                        a,
                        (*node.actions, a),
                        node.ret + float(rewards[a]),
                        bool(term[a] or trunc[a]),
                    )
                )
        children.sort(key=lambda n: (-n.ret, n.actions))
        beam = children[:width]
        kept = {id(n.envs) for n in beam}
        for key in list(alive):
            if key not in kept:
                alive.pop(key).close()
    for envs in alive.values():
        envs.close()
    return beam


def replay_return(make_env, seed: int, actions: tuple[int, ...]) -> float:
    """Ground truth: rebuild the env, reset it with the seed, replay the actions."""
    env = make_env()
    env.reset(seed=seed)
    total = 0.0
    for a in actions:
        _, reward, term, trunc, _ = env.step(a)
        total += float(reward)
        if term or trunc:
            break
    env.close()
    return total


if __name__ == "__main__":
    import argparse
    import copy

    parser = argparse.ArgumentParser(description="Beam search by forking sandboxes.")
    parser.add_argument("--depth", type=int, default=6, help="actions per sequence (default 6)")
    parser.add_argument("--width", type=int, default=4, help="sequences kept (default 4)")
    parser.add_argument("--seed", type=int, default=3, help="seed of the reset (default 3)")
    args = parser.parse_args()
    try:
        copy.deepcopy(CStateWalk())
    except (ValueError, TypeError) as exc:
        print(f"deepcopy of the env fails as expected: {exc}")
    best = beam_search(CStateWalk, seed=args.seed, depth=args.depth, width=args.width)
    for node in best:
        truth = replay_return(CStateWalk, args.seed, node.actions)
        print(f"actions {node.actions}  return {node.ret:+.2f}  replayed {truth:+.2f}")
    print("its search tree: gym-fork lineage")
