"""Cold starts against clones of a warm parent: time, fan-out and memory (PSS).

cold      env_fn() + reset + first step, in this process
clone     reset of a from_parent sub-env by a fresh clone (reset_mode="clone") + first step,
          back to back, and ``clone_apart``: the same 30 ms apart (as an RL loop's reset comes
          at an episode's end, after the idle pool has been refilled)
fork      fork() of a running sub-env into a 1-env branch + first step
fan-out   fork(copies=N) + one step of all N
memory    PSS added by N clones (after their first step: the PSS of the warm parent,
          source and clones minus that before the fan-out) against N x the PSS of one
          independent process holding the same env (nothing shared between those)
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gym_fork.progress import Task

# The pause before each clone of the ``clone_apart`` series.
CLONE_GAP_S = 0.03

# What the independent process imports before it evaluates the env expression.
DEFAULT_IMPORTS = "from gym_fork.bench.heavy import HeavyEnv"

INDEPENDENT = """
import gymnasium as gym
{imports}
env = {expr}
env.reset(seed=0); env.step(0)
with open("/proc/self/smaps_rollup") as f:
    print(next(int(l.split()[1]) for l in f if l.startswith("Pss:")))
"""


def pss_kb(pid: int) -> int:
    """Proportional set size of a process in KiB (0 if it has none or is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_of(root: int) -> list[int]:
    """``root`` and every process below it: all that share its pages (the sources, the
    clones, the warm parent's idle sandboxes), so that summed PSS adds up."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(
                    int(entry)
                )
    found, stack = [root], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def pct(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def independent_pss_kb(expr: str, imports: str = DEFAULT_IMPORTS) -> int:
    """PSS (KiB) of a fresh interpreter that built ``expr``, reset it and stepped it once."""
    code = INDEPENDENT.format(imports=imports, expr=expr)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


def measure(
    name: str,
    make: Callable[[], Any],
    expr: str,
    cold_runs: int,
    clone_runs: int,
    *,
    fan_sizes: Sequence[int] = (64,),
    fan_repeats: int = 3,
    imports: str = DEFAULT_IMPORTS,
    bar: Task | None = None,
) -> dict[str, Any]:
    """Cold, clone, fork and fan-out times (s) of ``make`` and the memory of the largest
    fan-out against as many independent processes built from ``expr``.

    Returns ``name``, ``cold``, ``clone``, ``clone_apart``, ``fork`` (lists of seconds),
    ``fan_by_size`` (copies -> seconds), ``fan`` (those of the largest fan-out),
    ``clones`` (its size), ``clones_pss_kb`` (median PSS it added) and
    ``independent_pss_kb``.
    """
    from gym_fork import ForkVectorEnv

    def tick() -> None:
        if bar is not None:
            bar.advance()

    cold = []
    for _ in range(cold_runs):
        start = time.perf_counter()
        env = make()
        env.reset(seed=0)
        env.step(0)
        cold.append(time.perf_counter() - start)
        env.close()
        del env
        tick()

    largest = max(fan_sizes)
    envs = ForkVectorEnv.from_parent(make, 1, lineage_log=False)
    one = np.zeros(1, dtype=np.int64)
    try:
        envs.reset(seed=0)
        envs.step(one)
        clone = []
        for i in range(clone_runs):
            start = time.perf_counter()
            envs.reset(seed=i)  # a fresh clone of the warm parent
            envs.step(one)
            clone.append(time.perf_counter() - start)
            tick()
        clone_apart = []
        for i in range(clone_runs):
            time.sleep(CLONE_GAP_S)
            start = time.perf_counter()
            envs.reset(seed=i)
            envs.step(one)
            clone_apart.append(time.perf_counter() - start)
        fork = []
        for i in range(clone_runs):
            start = time.perf_counter()
            branch = envs.fork(f"f{i}")
            branch.step(one)
            fork.append(time.perf_counter() - start)
            branch.close()
            tick()
        fan_by_size: dict[int, list[float]] = {}
        pss: list[float] = []
        warm_parent = envs.sandboxes.host.pid
        for copies in fan_sizes:
            times = fan_by_size.setdefault(copies, [])
            for i in range(fan_repeats):
                before = sum(pss_kb(p) for p in tree_of(warm_parent))
                start = time.perf_counter()
                branch = envs.fork(f"fan{copies}-{i}", copies=copies)
                branch.step(np.zeros(copies, dtype=np.int64))
                times.append(time.perf_counter() - start)
                if copies == largest:
                    # PSS adds up to real memory use: the clones' cost is what the whole
                    # tree grew by (their private pages; shared pages only re-split).
                    pss.append(sum(pss_kb(p) for p in tree_of(warm_parent)) - before)
                branch.close()
                tick()
    finally:
        envs.close()
    independent = independent_pss_kb(expr, imports)
    tick()
    return {
        "name": name,
        "cold": cold,
        "clone": clone,
        "clone_apart": clone_apart,
        "fork": fork,
        "fan_by_size": fan_by_size,
        "fan": fan_by_size[largest],
        "clones": largest,
        "clones_pss_kb": statistics.median(pss),
        "independent_pss_kb": independent * largest,
    }


def steps_of(cold_runs: int, clone_runs: int, fan_sizes: Sequence[int], fan_repeats: int) -> int:
    """How many times :func:`measure` advances its bar."""
    return cold_runs + 2 * clone_runs + len(fan_sizes) * fan_repeats + 1


def sandbox_setup(runs: int = 40) -> dict[str, float] | None:
    """Isolation set-up of one new process sandbox, as the warm parent's fork does it:
    ``be_born`` + its report in a fork of a prepared CartPole parent inside a tree
    of its own. Medians of wall time (ms), CPU time (ms) and page faults (copy-on-write
    and first touches); None where a tree cannot be made (needs root)."""
    import contextlib
    import gc
    import os
    import resource

    import gymnasium as gym

    from gym_fork.system import confine
    from gym_fork.system.birth import Role, be_born
    from gym_fork.system.isolation import IsolationConfig, become_tree_init, isolate_tree

    read, write = os.pipe()
    helper = os.fork()
    if helper == 0:  # the tree's creator; its first child is pid 1 of the tree
        code = 1
        try:
            os.close(read)
            config = IsolationConfig()
            with contextlib.suppress(OSError):  # the sandboxes report it; still measured
                confine.prepare_seccomp()
            tree = isolate_tree(config, os.getpid())
            init = os.fork()
            if init:
                code = os.waitstatus_to_exitcode(os.waitpid(init, 0)[1])
            else:
                try:
                    become_tree_init(tree)
                    env = gym.make("CartPole-v1")
                    env.reset(seed=0)
                    env.step(0)
                    gc.collect()
                    gc.freeze()
                    for _ in range(runs):
                        pid = os.fork()
                        if pid == 0:
                            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                            cpu, wall = time.process_time(), time.perf_counter()
                            _, achieved = be_born(Role.SPAWNED, config, tree, os.getppid())
                            achieved.report()
                            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                            os.write(write, f"{wall} {cpu} {faults}\n".encode())
                            os._exit(0)
                        os.waitpid(pid, 0)
                    code = 0
                finally:
                    os._exit(code)
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as pipe:
        rows = [line.split() for line in pipe]
    os.waitpid(helper, 0)
    if not rows:
        return None
    return {
        "wall_ms": statistics.median(float(r[0]) for r in rows) * 1e3,
        "cpu_ms": statistics.median(float(r[1]) for r in rows) * 1e3,
        "faults": statistics.median(int(r[2]) for r in rows),
    }
