"""``gym-fork bench``: throughput, clone time, fan-out and memory measured side by side in
one run, printed as a table of ratios, written as JSON and PNG plots."""

from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import gymnasium as gym

from gym_fork import progress
from gym_fork.bench import clones, throughput
from gym_fork.bench.heavy import HeavyEnv

SYNC, ASYNC, FORK = "SyncVectorEnv", "AsyncVectorEnv", "ForkVectorEnv (auto)"


@dataclass(frozen=True)
class Sizes:
    """How much a bench run measures."""

    mode: str
    num_envs: int  # CartPole sub-envs in the throughput comparison
    steps: int  # vector steps per throughput sample
    repeats: int  # interleaved throughput samples per vector env
    per_worker: bool  # also ForkVectorEnv(envs_per_worker=1)
    round_trips: int  # records per ring/pipe round-trip sample (3 samples)
    heavy: tuple[tuple[float, int, bool], ...]  # (init s, state MB, THP) per heavy env
    cold_runs: tuple[int, int]  # cold builds of CartPole, of a heavy env
    clone_runs: int  # clones (and forks) per env
    fan_sizes: tuple[int, ...]  # fan-out sizes; memory is measured at the largest
    fan_repeats: int


MODES = {
    "full": Sizes(
        mode="full",
        num_envs=8,
        steps=3000,
        repeats=3,
        per_worker=True,
        round_trips=20000,
        heavy=((1.5, 200, True), (1.5, 200, False)),
        cold_runs=(20, 2),
        clone_runs=50,
        fan_sizes=(8, 16, 32, 64),
        fan_repeats=3,
    ),
    "quick": Sizes(
        mode="quick",
        num_envs=8,
        steps=2000,
        repeats=3,
        per_worker=False,
        round_trips=10000,
        heavy=((0.5, 50, True),),
        cold_runs=(20, 2),
        clone_runs=20,
        fan_sizes=(8, 32, 64),
        fan_repeats=2,
    ),
    # For the test of the command: every figure once, as small as still means something.
    "tiny": Sizes(
        mode="tiny",
        num_envs=4,
        steps=200,
        repeats=1,
        per_worker=False,
        round_trips=1000,
        heavy=((0.2, 16, True),),
        cold_runs=(5, 1),
        clone_runs=4,
        fan_sizes=(4, 8),
        fan_repeats=1,
    ),
}


def _cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def run_bench(mode: str = "full", *, quiet: bool = False) -> dict[str, Any]:
    """Measure everything of ``mode`` ("full", "quick" or "tiny") and return the JSON-able
    result (see docs/benchmarks-notebook.md for what each figure is)."""
    sizes = MODES[mode]
    started = time.perf_counter()
    result: dict[str, Any] = {
        "meta": {
            "mode": mode,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "cpus": os.cpu_count(),
            "load_average": list(os.getloadavg()),
            "python": platform.python_version(),
            "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
            "packages": {n: _version(n) for n in ("gym_fork", "gymnasium", "numpy")},
            "sizes": asdict(sizes),
        }
    }
    makers = throughput.cartpole_makers(sizes.num_envs, per_worker=sizes.per_worker)
    with progress.task(
        f"throughput: CartPole-v1 x{sizes.num_envs}", len(makers) * sizes.repeats, quiet=quiet
    ) as bar:
        samples = throughput.compare(makers, sizes.steps, sizes.num_envs, sizes.repeats, bar)
    med = throughput.medians(samples)
    result["throughput"] = {
        "env": "CartPole-v1",
        "num_envs": sizes.num_envs,
        "steps": sizes.steps,
        "repeats": sizes.repeats,
        "steps_per_s": med,
        "samples": samples,
        "ratios": {
            "fork_vs_async": med[FORK] / med[ASYNC],
            "fork_vs_sync": med[FORK] / med[SYNC],
            "sync_vs_async": med[SYNC] / med[ASYNC],
        },
    }
    with progress.task("round trip: ring and pipe", 6, quiet=quiet) as bar:
        ring, pipe = [], []
        for _ in range(3):
            ring.append(throughput.ring_round_trip_us(sizes.round_trips))
            bar.advance()
            pipe.append(throughput.pipe_round_trip_us(sizes.round_trips))
            bar.advance()
    result["round_trip_us"] = {
        "ring": statistics.median(ring),
        "pipe": statistics.median(pipe),
        "pipe_vs_ring": statistics.median(pipe) / statistics.median(ring),
    }
    cases: list[tuple[str, Any, str, int]] = [
        ("CartPole-v1", _cartpole, "gym.make('CartPole-v1')", sizes.cold_runs[0])
    ]
    for init, mb, thp in sizes.heavy:
        cases.append(
            (
                f"heavy {mb} MB, {init:g} s, THP {'on' if thp else 'off'}",
                functools.partial(HeavyEnv, init, mb, thp),
                f"HeavyEnv({init}, {mb}, {thp})",
                sizes.cold_runs[1],
            )
        )
    result["clones"] = []
    for name, make, expr, cold_runs in cases:
        total = clones.steps_of(cold_runs, sizes.clone_runs, sizes.fan_sizes, sizes.fan_repeats)
        with progress.task(f"clones: {name}", total, quiet=quiet) as bar:
            row = clones.measure(
                name,
                make,
                expr,
                cold_runs,
                sizes.clone_runs,
                fan_sizes=sizes.fan_sizes,
                fan_repeats=sizes.fan_repeats,
                bar=bar,
            )
        result["clones"].append(_summary(row))
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    return result


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    ms = 1000.0
    cold = statistics.median(row["cold"])
    clone50 = clones.pct(row["clone"], 0.5)
    return {
        "name": row["name"],
        "cold_ms": cold * ms,
        "clone_ms": {"p50": clone50 * ms, "p99": clones.pct(row["clone"], 0.99) * ms},
        "clone_apart_ms": {"p50": clones.pct(row["clone_apart"], 0.5) * ms},
        "fork_ms": {
            "p50": clones.pct(row["fork"], 0.5) * ms,
            "p99": clones.pct(row["fork"], 0.99) * ms,
        },
        "cold_vs_clone": cold / clone50,
        "fan_out_ms": {str(n): statistics.median(v) * ms for n, v in row["fan_by_size"].items()},
        "clones": row["clones"],
        "clones_pss_mb": row["clones_pss_kb"] / 1024,
        "independent_pss_mb": row["independent_pss_kb"] / 1024,
        "memory_ratio": row["independent_pss_kb"] / max(1, row["clones_pss_kb"]),
        "samples_ms": {key: [v * ms for v in row[key]] for key in ("cold", "clone", "fork")},
    }


def format_table(result: dict[str, Any]) -> str:
    """The comparison table of a :func:`run_bench` result, as text."""
    meta, tp = result["meta"], result["throughput"]
    lines = [
        f"gym-fork bench ({meta['mode']}), {meta['date']}: {meta['cpus']} cores, "
        f"load average {meta['load_average'][0]:.2f}, Python {meta['python']}, "
        f"{meta['elapsed_s']:.0f} s",
        "All figures are from this one run; ratios are against anchors measured alongside.",
        "",
        f"Step throughput, {tp['env']} x{tp['num_envs']} ({tp['steps']} steps, "
        f"median of {tp['repeats']})",
        f"{'vector env':<36}{'steps/s':>10}{'vs Async':>10}{'vs Sync':>9}",
    ]
    med = tp["steps_per_s"]
    for name, value in med.items():
        lines.append(
            f"{name:<36}{value:>10,.0f}{value / med[ASYNC]:>9.2f}x{value / med[SYNC]:>8.2f}x"
        )
    rt = result["round_trip_us"]
    lines += [
        "",
        f"Small-record round trip: ring {rt['ring']:.2f} us, pipe {rt['pipe']:.2f} us "
        f"({rt['pipe_vs_ring']:.1f}x)",
        "",
        "Clones (cold: env_fn()+reset+step; clone: reset by a fresh clone of the warm parent "
        "+ step, back to back; apart: the same 30 ms apart, as at episodes' ends; "
        "fork: fork() + step)",
    ]
    rows = result["clones"]
    sizes = list(rows[0]["fan_out_ms"]) if rows else []
    fan_head = "fan-out " + "/".join(sizes) + " ms"
    lines.append(
        f"{'env':<30}{'cold':>9}{'clone p50/p99':>16}{'apart':>8}{'cold/clone':>11}"
        f"{'fork p50/p99':>15}"
        f"  {fan_head:<24}{'PSS clones':>11}{'indep.':>10}{'ratio':>7}"
    )
    for r in rows:
        fans = "/".join(f"{v:.0f}" for v in r["fan_out_ms"].values())
        lines.append(
            f"{r['name']:<30}{r['cold_ms']:>7.1f}ms"
            f"{r['clone_ms']['p50']:>9.2f}/{r['clone_ms']['p99']:<6.2f}"
            f"{r['clone_apart_ms']['p50']:>8.2f}"
            f"{r['cold_vs_clone']:>10.{2 if r['cold_vs_clone'] < 10 else 0}f}x"
            f"{r['fork_ms']['p50']:>8.2f}/{r['fork_ms']['p99']:<6.2f}"
            f"  {fans:<24}"
            f"{r['clones_pss_mb']:>8.1f} MB{r['independent_pss_mb']:>7.0f} MB"
            f"{r['memory_ratio']:>6.1f}x"
        )
    if rows:
        lines.append(
            f"\nPSS clones: what {rows[0]['clones']} clones of a running sub-env added to the "
            f"summed PSS of the tree; indep.: {rows[0]['clones']} independent processes "
            "holding the same env; ratio: indep. / clones."
        )
    return "\n".join(lines)


def main(
    *,
    mode: str,
    json_path: str | None = None,
    plots_dir: str | None = None,
    quiet: bool = False,
) -> int:
    """Run, print the table, write the JSON and the plots; the exit status."""
    import json

    result = run_bench(mode, quiet=quiet)
    print(format_table(result))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2, sort_keys=False)
            f.write("\n")
        print(f"\nwrote {json_path}")
    if plots_dir:
        from gym_fork.bench.plots import write_plots

        for path in write_plots(result, plots_dir):
            print(f"wrote {path}")
    sys.stdout.flush()
    return 0
