"""A fan-out of 64 against its floor: 64 bare ``os.fork()``s stepping once (issue 35).

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/fanout_floor.py \
        [--copies 64] [--rounds 3] [--json OUT]

Two contenders, each in a fresh interpreter, interleaved, ``--rounds`` rounds, each run
the median of REPEATS fan-outs:

  bare fork   a Python process holding a CartPole env (gymnasium, numpy imported, the
              env reset) forks ``copies`` children; each steps its copy of the env once
              and writes a byte to a pipe; the time until every byte is in (the children
              are then killed and reaped, untimed). No isolation, no channel: what the
              kernel and CPython cost.
  fork        ``ForkVectorEnv.from_parent`` CartPole x1, ``fork(indices=[0],
              copies=copies)`` + one ``step`` of the branch (its close untimed): the same
              fan-out with every clone isolated and connected.

Reports medians with min-max, the ratio fork / bare fork (issue 35's goal: <= 1.25), the
CPU the box spent per clone (/proc/stat busy time over the fan-out, divided by
``copies``), and the load before and after each round (a run beside other work measures
that work too).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # host_cpu: the box's busy time, as the peers table reads it

REPEATS = 5
CONTENDERS = ("bare fork", "fork")


def busy_ms() -> float:
    """CPU time every core has spent busy so far (steal left out), ms."""
    return peers.host_cpu()[0] * 1e3


def bare_fork_once(env, copies: int) -> tuple[float, float]:
    """One fan-out of bare forks: (seconds until every child stepped, busy ms)."""
    read_end, write_end = os.pipe()
    started, busy = time.perf_counter(), busy_ms()
    children = []
    for _ in range(copies):
        pid = os.fork()
        if pid == 0:
            try:
                os.close(read_end)
                env.step(0)
                os.write(write_end, b"x")
                signal.pause()
            finally:
                os._exit(0)
        children.append(pid)
    got = 0
    while got < copies:
        got += len(os.read(read_end, copies - got))
    took, spent = time.perf_counter() - started, busy_ms() - busy
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    os.close(read_end)
    os.close(write_end)
    return took, spent


def one(contender: str, copies: int) -> dict:
    """In a fresh interpreter: the median of REPEATS fan-outs of ``contender``."""
    import gymnasium as gym
    import numpy as np

    times, spent = [], []
    if contender == "bare fork":
        env = gym.make("CartPole-v1")
        env.reset(seed=0)
        for _ in range(REPEATS):
            took, busy = bare_fork_once(env, copies)
            times.append(took)
            spent.append(busy)
            time.sleep(0.2)  # the killed children's teardown is not the next one's
    else:
        from gym_fork import ForkVectorEnv

        envs = ForkVectorEnv.from_parent(lambda: gym.make("CartPole-v1"), 1, seed=0)
        try:
            envs.reset(seed=0)
            actions = np.zeros(copies, dtype=np.int64)
            for r in range(REPEATS):
                started, busy = time.perf_counter(), busy_ms()
                branch = envs.fork(f"fan-{r}", indices=[0], copies=copies)
                branch.step(actions)
                times.append(time.perf_counter() - started)
                spent.append(busy_ms() - busy)
                branch.close()
                time.sleep(0.2)
        finally:
            envs.close()
    return {
        "seconds": statistics.median(times),
        "busy_ms_per_clone": statistics.median(spent) / copies,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.copies)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in CONTENDERS}
    loads = []
    for r in range(args.rounds):
        before = os.getloadavg()[0]
        for contender in CONTENDERS:
            done = subprocess.run(
                [sys.executable, __file__, "--one", contender, "--copies", str(args.copies)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            runs[contender].append(json.loads(done.stdout.strip().splitlines()[-1]))
        loads.append({"round": r, "load_before": before, "load_after": os.getloadavg()[0]})
        print(f"round {r}: load {before:.2f} -> {os.getloadavg()[0]:.2f}", flush=True)
    table = {}
    for contender, results in runs.items():
        seconds = [res["seconds"] for res in results]
        cpu = [res["busy_ms_per_clone"] for res in results]
        table[contender] = {
            "ms": {
                "median": 1e3 * statistics.median(seconds),
                "min": 1e3 * min(seconds),
                "max": 1e3 * max(seconds),
            },
            "busy_ms_per_clone": statistics.median(cpu),
        }
    ratio = table["fork"]["ms"]["median"] / table["bare fork"]["ms"]["median"]
    print(f"{args.copies} copies + one step each, {os.cpu_count()} cores")
    for contender, row in table.items():
        ms = row["ms"]
        print(
            f"  {contender:<10} {ms['median']:7.1f} ms ({ms['min']:.1f}-{ms['max']:.1f}), "
            f"{row['busy_ms_per_clone']:.1f} ms of CPU per clone"
        )
    print(f"  fork / bare fork: {ratio:.2f}x (issue 35's goal: <= 1.25x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "command": " ".join(sys.argv),
                    "copies": args.copies,
                    "loads": loads,
                    "table": table,
                    "ratio": ratio,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
