"""A text env whose state is a workspace of files, and a search that branches it.

    python examples/agent_workspace.py [--depth 3]

``WorkspaceEnv`` is what a tool-using agent's env looks like to gym_fork: the action is a
command string (``write NAME TEXT``, ``append NAME TEXT``, ``cat NAME``, ``ls``,
``rm NAME``), the observation is the tool's output as a string (Gymnasium ``Text``
spaces), and the state is real files in a directory of the sandbox's private /tmp. The
reward is how many target files hold their target text.

The search: at each depth, fork every kept branch once per candidate command
(``fork(copies=...)``: the clones own copies of the workspace as it is, each file
included), step each clone with its command, keep the best. Nothing is replayed and no
workspace is rebuilt; the source keeps its files as they were.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shlex
import shutil
import string
import tempfile

import gymnasium as gym
import numpy as np
from gymnasium import spaces

CHARSET = string.ascii_letters + string.digits + " ._-:\n"
MAX_OBSERVATION = 1024
MAX_ACTION = 128
TARGET = {"notes.txt": "hello", "todo.txt": "fork"}


class WorkspaceEnv(gym.Env):
    """Files in a private directory, driven by command strings."""

    metadata = {"render_modes": []}
    observation_space = spaces.Text(MAX_OBSERVATION, min_length=0, charset=CHARSET)
    action_space = spaces.Text(MAX_ACTION, min_length=0, charset=CHARSET)

    def __init__(self, target: dict[str, str] | None = None, max_steps: int = 20) -> None:
        self.target = dict(TARGET if target is None else target)
        self.max_steps = max_steps
        self.root = tempfile.mkdtemp(prefix="workspace-")  # in the sandbox's own /tmp
        self.t = 0

    def _path(self, name: str) -> str:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"not a file name here: {name!r}")
        return os.path.join(self.root, name)

    def _score(self) -> int:
        score = 0
        for name, text in self.target.items():
            path = os.path.join(self.root, name)
            if os.path.exists(path):
                with open(path) as f:
                    score += f.read() == text
        return score

    def _run(self, command: str) -> str:
        words = shlex.split(command) if command.strip() else ["ls"]
        verb, args = words[0], words[1:]
        if verb == "ls":
            return " ".join(sorted(os.listdir(self.root)))
        if verb == "cat" and len(args) == 1:
            with open(self._path(args[0])) as f:
                return f.read()
        if verb in ("write", "append") and len(args) >= 1:
            with open(self._path(args[0]), "w" if verb == "write" else "a") as f:
                f.write(" ".join(args[1:]))
            return f"{verb} {args[0]}: ok"
        if verb == "rm" and len(args) == 1:
            os.unlink(self._path(args[0]))
            return f"rm {args[0]}: ok"
        return f"unknown command: {verb}"

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        for name in os.listdir(self.root):
            os.unlink(os.path.join(self.root, name))
        self.t = 0
        return "", {"files": 0}

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def step(self, action: str):
        self.t += 1
        before = self._score()
        try:
            output = self._run(str(action))
        except OSError as exc:  # its strerror only: the path names this sandbox's /tmp
            output = f"error: {exc.strerror}"
        except ValueError as exc:
            output = f"error: {exc}"
        output = "".join(c for c in output if c in CHARSET)[:MAX_OBSERVATION]
        score = self._score()
        done = score == len(self.target)
        info = {"files": len(os.listdir(self.root)), "tool": output.split(" ", 1)[0]}
        return output, float(score - before), done, self.t >= self.max_steps, info


CANDIDATES = (
    "write notes.txt hello",
    "write todo.txt fork",
    "append notes.txt hello",
    "rm notes.txt",
    "ls",
)


def search(depth: int = 3, width: int = 2) -> tuple[float, list[str]]:
    """Beam search over CANDIDATES by branching live workspaces; (best return, commands)."""
    from gym_fork import ForkVectorEnv

    names = (f"node-{n}" for n in itertools.count())  # branch ids are unique in a tree
    root = ForkVectorEnv([WorkspaceEnv])
    root.reset(seed=0)
    beam: list[tuple[float, list[str], ForkVectorEnv]] = [(0.0, [], root)]
    try:
        for _ in range(depth):
            children: list[tuple[float, list[str], ForkVectorEnv]] = []
            for total, commands, envs in beam:
                branch = envs.fork(next(names), copies=len(CANDIDATES))
                _, rewards, *_ = branch.step(tuple(CANDIDATES))
                for i, command in enumerate(CANDIDATES):
                    children.append((total + float(rewards[i]), [*commands, command], branch))
            children.sort(key=lambda c: -c[0])
            kept = children[:width]
            # Each kept child continues in a branch of its own (its clone's sub-env).
            nxt = []
            for total, commands, branch in kept:
                index = CANDIDATES.index(commands[-1])
                nxt.append((total, commands, branch.fork(next(names), indices=[index])))
            for _, _, envs in beam:
                if envs is not root:
                    envs.close()
            for branch in {id(c[2]): c[2] for c in children}.values():
                branch.close()
            beam = nxt
        best = max(beam, key=lambda c: c[0])
        return best[0], best[1]
    finally:
        for _, _, envs in beam:
            envs.close()
        root.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=3)
    args = parser.parse_args()
    total, commands = search(args.depth)
    print(f"best return {total:.0f} with: {' ; '.join(commands)}")


if __name__ == "__main__":
    np.set_printoptions(linewidth=120)
    main()
