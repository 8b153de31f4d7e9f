"""ForkVectorEnv against its peers, side by side in one run: medians of 3.

.venv/bin/python benchmarks/peers.py [--quick] [--json peers.json] [--png peers.png]

Rows: CartPole-v1 x2, x8, x64 steps/s; a ~100 us Python step env x8; Atari Pong x8
(frameskip 4, 84x84 grayscale, frame stack 4; where ale-py works); construction + first
reset of CartPole x8 (the first vector env of a fresh process); total PSS of 16 Pong
envs (CartPole where Pong is unavailable). Every measurement runs in a fresh interpreter,
contenders interleaved; each reports the cores other processes kept busy meanwhile
(/proc/stat's busy time less the measured processes' own), and one beside more than
0.25 cores of other work is listed as disturbed under the table.
Columns: gymnasium's SyncVectorEnv and AsyncVectorEnv, EnvPool and PufferLib's
multiprocessing backend with 2 workers (each only where it imports; otherwise the reason
is printed in its cells), ForkVectorEnv with ``envs_per_worker="auto"``, and for memory
also ForkVectorEnv with one sub-env per sandbox. Each row has its goal and whether
ForkVectorEnv meets it. Install the optional contenders with ``pip install -e .[peers]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from gym_fork.bench.clones import pss_kb, tree_of

SYNC, ASYNC, ENVPOOL, PUFFER, FORK, FORK1, CEILING = (
    "Sync",
    "Async",
    "EnvPool",
    "PufferLib mp x2",
    "ForkVectorEnv auto",
    "ForkVectorEnv 1/sandbox",
    "ceiling: Sync split over cores",
)
CONTENDERS = [SYNC, ASYNC, ENVPOOL, PUFFER, FORK, CEILING]


class Unavailable(Exception):
    """A contender cannot run this row; the message says why."""


class SlowStepEnv(gym.Env):
    """A pure-Python env whose step busy-waits ``step_us`` microseconds (holds the GIL,
    as Python simulation code does)."""

    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, step_us: float = 100.0) -> None:
        self.step_s = step_us / 1e6
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        end = time.perf_counter() + self.step_s
        while time.perf_counter() < end:
            pass
        self.t += 1
        return np.full(4, self.t % 7 / 7, np.float32), 1.0, False, self.t >= 500, {}


def cartpole() -> gym.Env:
    """CartPole-v1."""
    return gym.make("CartPole-v1")


def pong() -> gym.Env:
    """ALE Pong with the usual preprocessing: frameskip 4, 84x84 grayscale, 4 stacked."""
    if "ALE/Pong-v5" not in gym.registry:
        import ale_py

        gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1, repeat_action_probability=0.0)
    env = gym.wrappers.AtariPreprocessing(
        env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=30
    )
    return gym.wrappers.FrameStackObservation(env, 4)


ENVS: dict[str, tuple[Callable[[], gym.Env], int, str | None]] = {
    # kind: (env_fn, number of actions, EnvPool's task id)
    "cartpole": (cartpole, 2, "CartPole-v1"),
    "slow100us": (SlowStepEnv, 2, None),
    "pong": (pong, 6, "Pong-v5"),
}


def pong_available() -> str | None:
    """None when Pong runs here, else why not."""
    try:
        pong().close()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:120]
    return None


class _EnvPoolVector:
    """EnvPool in synchronous mode (batch = all envs), Gymnasium API."""

    def __init__(self, task: str, n: int) -> None:
        import envpool

        extra: dict[str, Any] = {}
        if task == "Pong-v5":  # the same preprocessing as pong(); EnvPool's defaults
            extra = {"img_height": 84, "img_width": 84, "stack_num": 4, "frame_skip": 4}
        self.env = envpool.make(
            task, env_type="gymnasium", num_envs=n, batch_size=n, seed=0, **extra
        )

    def reset(self, seed: int | None = None):
        return self.env.reset()

    def step(self, actions: np.ndarray):
        return self.env.step(actions)

    def close(self) -> None:
        self.env.close()


class _PufferVector:
    """PufferLib's multiprocessing backend with 2 workers, Gymnasium-style calls."""

    def __init__(self, env_fn: Callable[[], gym.Env], n: int) -> None:
        import pufferlib.emulation
        import pufferlib.vector

        def creator(*args: Any, **kwargs: Any):
            return pufferlib.emulation.GymnasiumPufferEnv(env_creator=env_fn)

        self.env = pufferlib.vector.make(
            creator, backend=pufferlib.vector.Multiprocessing, num_envs=n, num_workers=2
        )

    def reset(self, seed: int | None = None):
        return self.env.reset(seed=seed)

    def step(self, actions: np.ndarray):
        return self.env.step(actions)

    def close(self) -> None:
        self.env.close()


def import_reason(module: str) -> str | None:
    """None when ``module`` imports, else the error in a line."""
    try:
        __import__(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:120]
    return None


def make(contender: str, kind: str, n: int) -> Any:
    """A vector env of ``n`` envs of ``kind`` for ``contender`` (raises Unavailable)."""
    env_fn, _, task = ENVS[kind]
    fns = [env_fn for _ in range(n)]
    if contender == SYNC:
        return gym.vector.SyncVectorEnv(fns)
    if contender == ASYNC:
        return gym.vector.AsyncVectorEnv(fns)
    if contender in (FORK, FORK1):
        from gym_fork import ForkVectorEnv

        return ForkVectorEnv(fns, envs_per_worker=1 if contender == FORK1 else "auto")
    if contender == ENVPOOL:
        reason = import_reason("envpool")
        if reason:
            raise Unavailable(reason)
        if task is None:
            raise Unavailable("C++ envs only: a Python env cannot run in EnvPool")
        return _EnvPoolVector(task, n)
    if contender == PUFFER:
        reason = import_reason("pufferlib.vector")
        if reason:
            raise Unavailable(reason)
        return _PufferVector(env_fn, n)
    raise ValueError(contender)


def involved_pids() -> set[int]:
    """This process, every process below it, and every process gym_fork started for it
    wherever it went (a warm parent and its sandboxes carry GYM_FORK_SANDBOX=<our pid>
    in their environment; reparented, they are no descendants of ours)."""
    needle = f"\0GYM_FORK_SANDBOX={os.getpid()}\0".encode()
    pids = set(tree_of(os.getpid()))
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in b"\0" + f.read():
                        pids.add(int(entry))
            except OSError:
                continue
    return pids


def cpu_seconds(pids: set[int]) -> float:
    """CPU time (user + system) of ``pids`` (threads count in their process)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (after state at [0])
    return total / tick


def host_cpu() -> tuple[float, float]:
    """CPU seconds every core of this machine spent busy (user, nice, system, irq,
    softirq), and those the hypervisor took (steal), since boot."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def disturbance(busy_before: tuple[float, float], involved_cpu: float, wall: float) -> dict:
    """The cores other processes (and the hypervisor: steal) kept busy during a
    measurement of ``wall`` seconds whose own processes spent ``involved_cpu``."""
    busy, steal = host_cpu()
    return {
        "foreign_cores": max(0.0, busy - busy_before[0] - involved_cpu) / wall,
        "steal_cores": (steal - busy_before[1]) / wall,
    }


# A measurement beside more than this many cores' worth of other work is "disturbed".
DISTURBED_CORES = 0.25


def run_steps(contender: str, kind: str, n: int, steps: int) -> dict[str, float]:
    """Construction + first reset (s), steps/s over ``steps`` vector steps (after 20
    warm-up steps) of one fresh vector env, and the cores it kept busy meanwhile (CPU
    seconds of every process involved over wall seconds)."""
    if contender == CEILING:
        return ceiling_steps(kind, n, steps)
    _, actions_n, _ = ENVS[kind]
    actions = np.random.default_rng(0).integers(0, actions_n, (steps + 20, n))
    started = time.perf_counter()
    envs = make(contender, kind, n)
    try:
        envs.reset(seed=0)
        construction = time.perf_counter() - started
        for a in actions[:20]:
            envs.step(a)
        pids = involved_pids()
        cpu = cpu_seconds(pids)
        before = host_cpu()
        started = time.perf_counter()
        for a in actions[20:]:
            envs.step(a)
        wall = time.perf_counter() - started
        spent = cpu_seconds(pids) - cpu
        others = disturbance(before, spent, wall)
        rate = steps * n / wall
    finally:
        envs.close()
    return {
        "construction_s": construction,
        "steps_per_s": rate,
        "busy_cores": spent / wall,
        **others,
    }


def _ceiling_share(kind: str, n: int, steps: int, start, results) -> None:
    """(In a process of its own.) Step a SyncVectorEnv of ``n`` envs ``steps`` times
    from ``start`` on; put (wall seconds, CPU seconds) in ``results``."""
    _, actions_n, _ = ENVS[kind]
    envs = gym.vector.SyncVectorEnv([ENVS[kind][0] for _ in range(n)])
    actions = np.random.default_rng(0).integers(0, actions_n, (steps + 20, n))
    envs.reset(seed=0)
    for a in actions[:20]:
        envs.step(a)
    start.wait()
    started, cpu = time.perf_counter(), time.process_time()
    for a in actions[20:]:
        envs.step(a)
    results.put((time.perf_counter() - started, time.process_time() - cpu))
    envs.close()


def ceiling_steps(kind: str, n: int, steps: int) -> dict[str, float]:
    """What this machine's cores do with ``n`` envs of ``kind`` when nothing hands
    anything over: the envs split over one plain process per core (at most ``n``), each
    stepping its share in a loop, all started together; steps/s over the slowest share.
    A vector env's steps/s against this is its efficiency on this machine (cores busy
    with other jobs, or cores sharing caches and memory bandwidth, lower this too)."""
    import multiprocessing

    ctx = multiprocessing.get_context()
    k = max(1, min(n, len(os.sched_getaffinity(0))))
    shares = [n // k + (1 if i < n % k else 0) for i in range(k)]
    start, results = ctx.Barrier(k + 1), ctx.Queue()
    workers = [
        ctx.Process(target=_ceiling_share, args=(kind, share, steps, start, results))
        for share in shares
    ]
    for worker in workers:
        worker.start()
    try:
        start.wait(timeout=120)  # every share built and warmed up: the window opens
        before = host_cpu()
        started = time.perf_counter()
        measured = [results.get(timeout=600) for _ in workers]
        window = time.perf_counter() - started
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
                worker.join()
    wall = max(w for w, _ in measured)
    return {
        "construction_s": float("nan"),
        "steps_per_s": steps * n / wall,
        "busy_cores": sum(c for _, c in measured) / wall,
        **disturbance(before, sum(c for _, c in measured), window),
    }


def fresh_run_steps(contender: str, kind: str, n: int, steps: int) -> dict[str, Any]:
    """:func:`run_steps` in a fresh interpreter (a process's first vector env is what a
    script waits for; nothing one contender leaves behind reaches the next)."""
    argv = [sys.executable, os.path.abspath(__file__), "--run-child", contender, kind]
    done = subprocess.run([*argv, str(n), str(steps)], capture_output=True, text=True, timeout=900)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{contender} {kind} x{n} failed: {done.stderr[-2000:]}")
    got = json.loads(lines[-1])
    if "unavailable" in got:
        raise Unavailable(got["unavailable"])
    return got


def pss_child(contender: str, kind: str, n: int) -> None:
    """(In a fresh process.) Build, reset and step the vector env, then print the total
    PSS of this process and every process it started, in MiB, as JSON."""
    try:
        envs = make(contender, kind, n)
    except Unavailable as exc:
        print(json.dumps({"skip": str(exc)}))
        return
    try:
        envs.reset(seed=0)
        _, actions_n, _ = ENVS[kind]
        for a in np.random.default_rng(0).integers(0, actions_n, (50, n)):
            envs.step(a)
        pids = set(tree_of(os.getpid())) | set(getattr(envs, "worker_pids", []) or [])
        total = sum(pss_kb(pid) for pid in pids)
        print(json.dumps({"pss_mb": total / 1024, "processes": len(pids)}))
    finally:
        envs.close()


def pss_of(contender: str, kind: str, n: int) -> float | str:
    """Total PSS (MiB) of a fresh process running ``contender``, or why it could not."""
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--pss-child", contender, kind, str(n)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"failed: {done.stderr.strip().splitlines()[-1:]}"[:120]
    result = json.loads(lines[-1])
    return result.get("pss_mb", result.get("skip", "?"))


# (row, env kind, num_envs, vector steps full / quick, goal text, check on the medians)
ROWS: list[tuple[str, str, int, int, int]] = [
    ("CartPole x2", "cartpole", 2, 5000, 1500),
    ("CartPole x8", "cartpole", 8, 3000, 800),
    ("CartPole x64", "cartpole", 64, 400, 100),
    ("100 us step x8", "slow100us", 8, 500, 150),
    ("Pong x8", "pong", 8, 300, 80),
    ("Pong x16", "pong", 16, 150, 40),
]
# row: (goal, numerator, denominator, what the ratio must reach; "<=" goals are written
# as the reference over ForkVectorEnv's figure, so that the ratio must reach 1 either way)
GOALS: dict[str, tuple[str, str, str, float]] = {
    "CartPole x2": (">= 0.9x Sync", FORK, SYNC, 0.9),
    "CartPole x8": (">= 1.3x Sync", FORK, SYNC, 1.3),
    "CartPole x64": (">= 1.5x Sync", FORK, SYNC, 1.5),
    "100 us step x8": (">= 1.85x Sync", FORK, SYNC, 1.85),
    "Pong x8": (">= EnvPool", FORK, ENVPOOL, 1.0),
    "Pong x16": (">= 1.8x Sync", FORK, SYNC, 1.8),
    "construction CartPole x8 (s)": ("<= Async", ASYNC, FORK, 1.0),
    "PSS 16 envs (MiB)": ("1/sandbox <= Async", ASYNC, FORK1, 1.0),
}


def ratio(row: dict[str, Any], a: str, b: str) -> float | None:
    """``row[a] / row[b]`` where both are figures."""
    x, y = row.get(a), row.get(b)
    if not isinstance(x, float) or not isinstance(y, float) or y == 0:
        return None
    return x / y


def measure(quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    """Every row for every contender; medians of 3 (1 with ``quick``), interleaved."""
    repeats = 1 if quick else 3
    load_before = os.getloadavg()
    pong_missing = pong_available()
    samples: dict[str, dict[str, list[Any]]] = {}
    construction: dict[str, list[Any]] = {c: [] for c in CONTENDERS}
    busy: dict[str, dict[str, list[float]]] = {}
    disturbed: list[list[Any]] = []  # [row, contender, repeat, other work's cores]
    for repeat in range(repeats):
        for row, kind, n, full, short in ROWS:
            if kind == "pong" and pong_missing:
                samples[row] = {c: [f"no Pong: {pong_missing}"] for c in CONTENDERS}
                continue
            samples.setdefault(row, {c: [] for c in CONTENDERS})
            for contender in CONTENDERS:
                try:
                    got = fresh_run_steps(contender, kind, n, short if quick else full)
                except Unavailable as exc:
                    samples[row][contender].append(str(exc))
                    if row == "CartPole x8":
                        construction[contender].append(str(exc))
                    continue
                samples[row][contender].append(got["steps_per_s"])
                busy.setdefault(row, {}).setdefault(contender, []).append(got["busy_cores"])
                if row == "CartPole x8" and contender != CEILING:
                    construction[contender].append(got["construction_s"])
                foreign = got["foreign_cores"]
                if foreign > DISTURBED_CORES:
                    disturbed.append([row, contender, repeat, round(foreign, 2)])
                log(
                    f"[{repeat + 1}/{repeats}] {row:<15} {contender:<20} "
                    f"{got['steps_per_s']:>10,.0f}  other work {foreign:.2f} cores, "
                    f"steal {got['steal_cores']:.2f}"
                    + ("  DISTURBED" if foreign > DISTURBED_CORES else "")
                )
    table: dict[str, dict[str, Any]] = {row: _medians(s) for row, s in samples.items()}
    table["construction CartPole x8 (s)"] = _medians(construction)
    pss_kind = "cartpole" if pong_missing else "pong"
    pss_row: dict[str, Any] = {}
    for contender in (SYNC, ASYNC, ENVPOOL, FORK, FORK1):
        values = [pss_of(contender, pss_kind, 16) for _ in range(1 if quick else 2)]
        numbers = [v for v in values if isinstance(v, float)]
        pss_row[contender] = statistics.median(numbers) if numbers else values[0]
        log(f"PSS 16 {pss_kind} {contender:<24} {pss_row[contender]}")
    table["PSS 16 envs (MiB)"] = pss_row
    return {
        "table": table,
        "samples": samples,
        "construction_samples": construction,
        "busy_cores": {
            row: {c: statistics.median(v) for c, v in b.items()} for row, b in busy.items()
        },
        "pss_env": pss_kind,
        "goals": {row: goal[0] for row, goal in GOALS.items()},
        "ratios": {row: ratio(table[row], a, b) for row, (_, a, b, _) in GOALS.items()},
        "met": {
            row: None if ratio(table[row], a, b) is None else ratio(table[row], a, b) >= least
            for row, (_, a, b, least) in GOALS.items()
        },
        "disturbed": disturbed,
        "quick": quick,
        "repeats": repeats,
        "cores": len(os.sched_getaffinity(0)),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "python": sys.version.split()[0],
        "versions": {m: _version(m) for m in ("gymnasium", "numpy", "ale_py", "envpool")},
    }


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


def _medians(samples: dict[str, list[Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for contender, values in samples.items():
        numbers = [v for v in values if isinstance(v, float)]
        out[contender] = statistics.median(numbers) if numbers else (values[0] if values else "")
    return out


def _cell(value: Any, row: str, notes: list[str]) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if "(s)" in row else f"{value:,.0f}"
    if not value:
        return "-"
    if value not in notes:
        notes.append(value)
    return f"n/a [{notes.index(value) + 1}]"


def format_table(result: dict[str, Any], markdown: bool = False) -> str:
    """The medians as a table: a row per benchmark, a column per contender, the goal and
    whether ForkVectorEnv meets it; why a contender has no figure, under the table."""
    columns = [SYNC, ASYNC, ENVPOOL, PUFFER, FORK, FORK1, CEILING]
    head = ["row", *columns, "goal", "ratio", "met", "ForkVectorEnv / ceiling"]
    notes: list[str] = []
    rows = []
    for row, values in result["table"].items():
        met = result["met"].get(row)
        cells = [row, *(_cell(values.get(c, ""), row, notes) for c in columns)]
        value = result["ratios"].get(row)
        cells += [
            result["goals"].get(row, ""),
            "-" if value is None else f"{value:.2f}",
            {True: "yes", False: "NO", None: "?"}[met],
        ]
        of_ceiling = ratio(values, FORK, CEILING)
        cells.append("-" if of_ceiling is None else f"{of_ceiling:.2f}")
        rows.append(cells)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    else:
        widths = [max(len(r[i]) for r in [head, *rows]) + 2 for i in range(len(head))]
        lines = ["".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    lines += [""] + [f"[{i + 1}] {note}" for i, note in enumerate(notes)]
    disturbed = result.get("disturbed", [])
    lines.append(
        "measurements beside other work (> "
        f"{DISTURBED_CORES} cores of it): "
        + (", ".join(f"{r} {c} round {k + 1} ({f} cores)" for r, c, k, f in disturbed) or "none")
    )
    lines += ["", per_core_table(result, markdown)]
    return "\n".join(lines)


def per_core_table(result: dict[str, Any], markdown: bool = False) -> str:
    """Per row and contender: the cores kept busy and the steps/s per busy core, the
    latter as a ratio to SyncVectorEnv's (1.00: as much env work per core as one
    process stepping the envs in a loop; below: cores spent on something else)."""
    head = ["row (busy cores, steps/s per busy core vs Sync's)", *CONTENDERS]
    rows = []
    for row, by_contender in result.get("busy_cores", {}).items():
        rates = result["table"].get(row, {})
        per_core = {
            c: rates[c] / cores
            for c, cores in by_contender.items()
            if isinstance(rates.get(c), float) and cores > 0
        }
        sync = per_core.get(SYNC)
        cells = [row]
        for c in CONTENDERS:
            if c not in per_core:
                cells.append("-")
                continue
            share = f" {per_core[c] / sync:.2f}x" if sync else ""
            cells.append(f"{by_contender[c]:.2f} cores,{share}")
        rows.append(cells)
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    return "\n".join("  ".join(r) for r in [head, *rows])


def plot(result: dict[str, Any], path: str) -> bool:
    """Steps/s relative to SyncVectorEnv per row, a bar per contender (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [row for row, *_ in ROWS if row in result["table"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(CONTENDERS)
    for i, contender in enumerate(CONTENDERS):
        ratios = []
        for row in rows:
            value, sync = result["table"][row].get(contender), result["table"][row].get(SYNC)
            ok = isinstance(value, float) and isinstance(sync, float)
            ratios.append(value / sync if ok else 0.0)
        ax.bar([x + i * width for x in range(len(rows))], ratios, width, label=contender)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(CONTENDERS) - 1) / 2 for x in range(len(rows))], rows)
    ax.set_ylabel("steps/s relative to SyncVectorEnv")
    ax.set_yscale("log")
    load = result["load_before"][0]
    ax.set_title(f"Peers ({result['cores']} cores, load {load:.1f} at the start)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _timed(owner: Any, name: str, totals: dict[str, float], label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``totals[label]``."""
    inner = getattr(owner, name)
    clock = time.perf_counter

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = clock()
        try:
            return inner(*args, **kwargs)
        finally:
            totals[label] = totals.get(label, 0.0) + clock() - started

    setattr(owner, name, wrapper)


def _per_step_us(per_worker: int, actions: np.ndarray) -> float:
    """Wall time per vector step of ForkVectorEnv CartPole with ``per_worker`` sub-envs
    in each sandbox."""
    from gym_fork import ForkVectorEnv

    envs = ForkVectorEnv([cartpole] * actions.shape[1], envs_per_worker=per_worker)
    try:
        envs.reset(seed=0)
        for a in actions[:200]:
            envs.step(a)
        started = time.perf_counter()
        for a in actions:
            envs.step(a)
        return (time.perf_counter() - started) / len(actions) * 1e6
    finally:
        envs.close()


def profile(steps: int = 3000, n: int = 8) -> None:
    """Where a small step's time goes: CartPole x``n`` on ForkVectorEnv (auto), the
    controller's wall time per vector step split by phase, SyncVectorEnv's for scale, and
    a cProfile of the controller (top functions by own time)."""
    import cProfile
    import pstats

    from gym_fork import ForkVectorEnv

    actions = np.random.default_rng(0).integers(0, 2, (steps, n))
    sync = gym.vector.SyncVectorEnv([cartpole] * n)
    sync.reset(seed=0)
    started = time.perf_counter()
    for a in actions:
        sync.step(a)
    sync_us = (time.perf_counter() - started) / steps * 1e6
    single = cartpole()
    single.reset(seed=0)
    started = time.perf_counter()
    for a in actions[:, 0]:
        _, _, term, trunc, _ = single.step(a)
        if term or trunc:
            single.reset()
    single_us = (time.perf_counter() - started) / steps * 1e6
    sync.close()
    single.close()

    envs = ForkVectorEnv([cartpole] * n)
    try:
        envs.reset(seed=0)
        for a in actions[:200]:
            envs.step(a)
        started = time.perf_counter()
        for a in actions:
            envs.step(a)
        plain_us = (time.perf_counter() - started) / steps * 1e6
        totals: dict[str, float] = {}
        pool = envs.sandboxes.pool
        _timed(envs, "step_async", totals, "step_async (all)")
        _timed(envs._actions, "write_slab", totals, "  actions into the slab")
        _timed(pool, "send_same", totals, "  ring send (STEP to every worker)")
        _timed(envs, "step_wait", totals, "step_wait (all)")
        _timed(envs, "_collect", totals, "  wait for the replies (_collect)")
        _timed(envs, "_add_info", totals, "  info merge (_add_info)")
        _timed(envs, "_observations_out", totals, "  observations out (gather/copy)")
        _timed(envs.sandboxes.slabs, "step_columns", totals, "  rewards/terminations/truncations")
        started = time.perf_counter()
        for a in actions:
            envs.step(a)
        timed_us = (time.perf_counter() - started) / steps * 1e6
        print(
            f"CartPole x{n}, {steps} steps, {len(pool.workers)} workers, "
            f"{len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.2f}"
        )
        print(f"one CartPole step in-process: {single_us:.1f} us")
        print(f"SyncVectorEnv per vector step: {sync_us:.1f} us")
        print(f"ForkVectorEnv per vector step: {plain_us:.1f} us (timed run: {timed_us:.1f} us)")
        for label, total in totals.items():
            print(f"  {label:<40}{total / steps * 1e6:8.1f} us/step")
        # The budget: what the controller computes, what the busiest worker computes (its
        # sub-envs at the in-process step time), and the rest of the wait: hand-overs.
        wait = totals.get("  wait for the replies (_collect)", 0.0) / steps * 1e6
        own = timed_us - wait
        busiest = max(len(w.indices) for w in pool.workers) * single_us
        print("budget per vector step (timed run):")
        print(f"  controller's own work (outside the wait) {own:8.1f} us")
        print(f"  busiest worker's sub-envs (in-process)   {busiest:8.1f} us")
        print(f"  hand-over, wake-ups, shared cores        {wait - busiest:8.1f} us")
        for per_worker in (n, n // 2, 1):
            print(
                f"  envs_per_worker={per_worker}: {_per_step_us(per_worker, actions):.1f} us/step"
            )
        profiler = cProfile.Profile()
        profiler.enable()
        for a in actions:
            envs.step(a)
        profiler.disable()
    finally:
        envs.close()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


def main() -> None:
    """Run every row, print the table, write JSON and a PNG."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 run per cell, fewer steps")
    parser.add_argument("--json", default="peers.json", help="where the JSON goes")
    parser.add_argument("--png", default="peers.png", help="where the plot goes")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument(
        "--profile", action="store_true", help="where a small step's time goes, then exit"
    )
    parser.add_argument("--pss-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--run-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.profile:
        profile()
        return
    if args.run_child:
        contender, kind, n, steps = args.run_child
        try:
            print(json.dumps(run_steps(contender, kind, int(n), int(steps))))
        except Unavailable as exc:
            print(json.dumps({"unavailable": str(exc)}))
        return
    if args.pss_child:
        contender, kind, n = args.pss_child
        pss_child(contender, kind, int(n))
        return
    started = time.perf_counter()
    result = measure(args.quick, lambda line: print(line, file=sys.stderr, flush=True))
    result["seconds"] = time.perf_counter() - started
    print(
        f"\nmedians of {result['repeats']}, {result['cores']} cores, load average "
        f"{result['load_before'][0]:.2f} at the start, {result['load_after'][0]:.2f} at "
        f"the end, {result['seconds']:.0f} s "
        "(a shared machine: other processes compete for the cores)"
    )
    print(format_table(result, markdown=args.markdown))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1, default=str)
    drawn = plot(result, args.png)
    print(f"\nJSON: {args.json}" + (f", plot: {args.png}" if drawn else " (no matplotlib)"))


if __name__ == "__main__":
    main()
