"""Where the cores go: per-process CPU time by role, ForkVectorEnv against the ceiling.

    cd /tmp && /work/main/.venv/bin/python /work/main/benchmarks/cpu_roles.py \
        [--kind pong|cartpole|slow100us] [--envs 8] [--steps 600] [--rounds 3] [--json OUT]

Issue 35: on Pong x8 ForkVectorEnv reached 0.70-0.83 of the ceiling (the envs split over
one plain process per core, benchmarks/peers.py). Each run here is a fresh interpreter,
contenders interleaved, rounds repeated. For each it reads /proc before and after the
timed steps: user and system CPU and context switches of every process involved (the
controller; each sandbox; the warm parent, zygote and idle sandboxes as "rest"), and
reports them per env step, with steps/s and the cores kept busy (CPU / wall). The
ceiling's shares report their own CPU (one process per core, nothing handed over).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # the contenders and the ceiling, as the peers table runs them

TICK = os.sysconf("SC_CLK_TCK")
CONTENDERS = ("fork auto", "fork 1 per sandbox", "ceiling")
# --knob NAME=VALUE adds "fork auto NAME=VALUE": the same env with that knob set.


def proc_times(pid: int) -> tuple[float, float, int, int] | None:
    """(user s, system s, voluntary, involuntary context switches) of ``pid``'s threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        switches = [0, 0]
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        switches[0] += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        switches[1] += int(line.split()[1])
    except OSError:
        return None
    return int(fields[11]) / TICK, int(fields[12]) / TICK, switches[0], switches[1]


def fork_run(kind: str, n: int, steps: int, per_worker: int | str) -> dict:
    """Step ForkVectorEnv; CPU of each role over the timed steps."""
    from gym_fork import ForkVectorEnv

    env_fn, actions_n, _ = peers.ENVS[kind]
    actions = np.random.default_rng(0).integers(0, actions_n, (steps + 20, n))
    envs = ForkVectorEnv([env_fn] * n, envs_per_worker=per_worker)
    try:
        envs.reset(seed=0)
        for a in actions[:20]:
            envs.step(a)
        workers = set(envs.worker_pids)
        pids = peers.involved_pids()
        roles = {
            pid: ("controller" if pid == os.getpid() else "sandboxes" if pid in workers else "rest")
            for pid in pids
        }
        before = {pid: proc_times(pid) for pid in pids}
        started = time.perf_counter()
        for a in actions[20:]:
            envs.step(a)
        wall = time.perf_counter() - started
        after = {pid: proc_times(pid) for pid in pids}
        sandboxes = len(workers)
    finally:
        envs.close()
    totals: dict[str, list[float]] = {}
    for pid, role in roles.items():
        if before[pid] is None or after[pid] is None:
            continue
        delta = [b - a for a, b in zip(before[pid], after[pid], strict=True)]
        mine = totals.setdefault(role, [0.0, 0.0, 0, 0])
        for i, d in enumerate(delta):
            mine[i] += d
    env_steps = steps * n
    return {
        "steps_per_s": env_steps / wall,
        "sandboxes": sandboxes,
        "busy_cores": sum(t[0] + t[1] for t in totals.values()) / wall,
        "roles": {
            role: {
                "user_us_per_env_step": 1e6 * t[0] / env_steps,
                "system_us_per_env_step": 1e6 * t[1] / env_steps,
                "voluntary_per_vector_step": t[2] / steps,
                "involuntary_per_vector_step": t[3] / steps,
            }
            for role, t in totals.items()
        },
    }


def ceiling_run(kind: str, n: int, steps: int) -> dict:
    got = peers.ceiling_steps(kind, n, steps)
    env_steps = steps * n
    cpu = got["busy_cores"] * env_steps / got["steps_per_s"]
    return {
        "steps_per_s": got["steps_per_s"],
        "sandboxes": min(n, len(os.sched_getaffinity(0))),
        "busy_cores": got["busy_cores"],
        "roles": {"shares": {"user+system_us_per_env_step": 1e6 * cpu / env_steps}},
    }


def one(contender: str, kind: str, n: int, steps: int) -> dict:
    if contender.startswith("fork auto GYM_FORK_"):
        return fork_run(kind, n, steps, "auto")  # the knob is in our environment
    if contender == "ceiling":
        return ceiling_run(kind, n, steps)
    return fork_run(kind, n, steps, 1 if contender == "fork 1 per sandbox" else "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="pong", choices=sorted(peers.ENVS))
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument(
        "--knob", action="append", default=[], help="NAME=VALUE: one more contender"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.kind, args.envs, args.steps)))
        return
    runs = []
    contenders = (*CONTENDERS, *(f"fork auto {k}" for k in args.knob))
    for round_ in range(args.rounds):
        for contender in contenders:
            env = dict(os.environ)
            if contender.startswith("fork auto GYM_FORK_"):
                name, _, value = contender.removeprefix("fork auto ").partition("=")
                env[name] = value
            before = os.getloadavg()[0]
            argv = [
                sys.executable,
                os.path.abspath(__file__),
                "--one",
                contender,
                "--kind",
                args.kind,
                "--envs",
                str(args.envs),
                "--steps",
                str(args.steps),
            ]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
            if done.returncode != 0:
                raise SystemExit(f"{contender} failed:\n{done.stderr[-3000:]}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            got.update(round=round_, contender=contender, load=[before, os.getloadavg()[0]])
            runs.append(got)
            roles = "  ".join(
                f"{role}: " + " ".join(f"{k.split('_')[0]}={v:.1f}" for k, v in figures.items())
                for role, figures in got["roles"].items()
            )
            print(
                f"[{round_}] {contender:19s} {got['steps_per_s']:8.0f} steps/s, "
                f"{got['sandboxes']} sandboxes, busy {got['busy_cores']:.2f}, "
                f"load {got['load'][0]:.2f}->{got['load'][1]:.2f}  {roles}",
                flush=True,
            )
    print(f"\n{args.kind} x{args.envs}, {os.cpu_count()} cores, medians of {args.rounds} (min-max)")
    ceiling = statistics.median(r["steps_per_s"] for r in runs if r["contender"] == "ceiling")
    for contender in contenders:
        rates = [r["steps_per_s"] for r in runs if r["contender"] == contender]
        print(
            f"  {contender:19s} {statistics.median(rates):8.0f} "
            f"({min(rates):.0f}-{max(rates):.0f}) "
            f"= {statistics.median(rates) / ceiling:.2f} of the ceiling"
        )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {"kind": args.kind, "envs": args.envs, "steps": args.steps, "runs": runs},
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
