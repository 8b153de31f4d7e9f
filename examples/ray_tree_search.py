"""Beam search with its branches spread over Ray nodes (examples/beam_search.py, on Ray).

Run:  .venv/bin/python examples/ray_tree_search.py            (a 3-node loopback cluster)
      .venv/bin/python examples/ray_tree_search.py --address HOST:PORT   (your cluster)

The environment keeps its state in malloc'd C memory (``CStateWalk`` from
examples/beam_search.py), so it cannot be deep-copied: expanding a beam node means forking
the sandbox that holds it. The first expansion uses ``spread=True``: the root's copies
go round-robin over the nodes (the copy on the root's node is an exact fork, the others
are fresh sub-envs reset from the same seed, which at depth 0 is the same state). Every
later expansion forks on the node that holds the beam node, so copy-on-write stays
local, and all the expansions of one level are stepped together (``step_async`` on every
branch, then ``step_wait``): the nodes work in parallel.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray: loopback

import cloudpickle
import numpy as np
from ray import cloudpickle as ray_cloudpickle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import beam_search
from beam_search import CStateWalk, replay_return

from gym_fork.ray import RayForkVectorEnv, loopback_cluster

# The actors import nothing from examples/: ship the env class by value (Ray pickles
# arguments with its own copy of cloudpickle).
cloudpickle.register_pickle_by_value(beam_search)
ray_cloudpickle.register_pickle_by_value(beam_search)


@dataclass
class Node:
    """A beam entry: the branch and sub-env holding it, its actions and return."""

    envs: RayForkVectorEnv
    index: int
    actions: tuple[int, ...]
    ret: float
    done: bool


def ray_beam_search(make_env, seed: int, depth: int, width: int) -> tuple[list[Node], set[str]]:
    """The ``width`` best action sequences of length <= ``depth`` from ``reset(seed)``, and
    the Ray node ids that held beam nodes."""
    root = RayForkVectorEnv([make_env], lineage_log=False)
    root.reset(seed=seed)
    n_actions = int(root.single_action_space.n)
    beam = [Node(root, 0, (), 0.0, False)]
    alive = {id(root): root}
    nodes_used: set[str] = set()
    for level in range(depth):
        children: list[Node] = []
        expansions = []
        for node in beam:
            if node.done:
                children.append(node)
                continue
            name = f"d{level}-" + (".".join(map(str, node.actions)) or "root")
            branch = node.envs.fork(
                name, indices=[node.index], copies=n_actions, spread=(level == 0)
            )
            alive[id(branch)] = branch
            nodes_used.update(branch.node_ids)
            expansions.append((node, branch))
        for _node, branch in expansions:  # all actors at once
            branch.step_async(np.arange(n_actions))
        for node, branch in expansions:
            _, rewards, term, trunc, _ = branch.step_wait()
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
    return beam, nodes_used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="an existing Ray cluster (default: start 3 nodes)")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--width", type=int, default=4)
    args = parser.parse_args()

    def run() -> None:
        best, nodes = ray_beam_search(CStateWalk, args.seed, args.depth, args.width)
        print(f"beam nodes held on {len(nodes)} Ray node(s)")
        for node in best:
            truth = replay_return(CStateWalk, args.seed, node.actions)
            print(f"actions {node.actions}  return {node.ret:+.2f}  replayed {truth:+.2f}")

    if args.address:
        import ray

        ray.init(address=args.address)
        run()
    else:
        with loopback_cluster(num_nodes=3, num_cpus=1):
            run()


if __name__ == "__main__":
    main()
