"""The published figures: one results file, what each benchmark adds to it, and the page
blocks drawn from it.

``docs/results.json`` holds every figure the README, the FAQ and docs/benchmarks.md quote,
each with the run it came from (command, date, commit, machine, load). The benchmarks
write it (``benchmarks/publish.py``); the pages' figures sit between
``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` lines and are rendered from it,
and ``tests/test_published_figures.py`` fails when a block differs from its rendering or
when a checked page quotes, outside the blocks, a figure the file does not hold.

Keys: ``<what>.<row>.<contender or statistic>``; a figure is ``{"text": "1.82x", "value":
1.82, "run": "peers", "what": "..."}`` with ``"range": "1.70-1.90x"`` where it has rounds.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results.json"
# The pages whose every figure must come from the results file.
CHECKED_PAGES = ("README.md", "docs/index.md", "docs/guides/faq.md", "docs/benchmarks.md")

# A quoted figure: a number (or a range of two) with a unit; "~" and "x8" are not part of it.
FIGURE_TOKEN = re.compile(
    r"(?<![\w.])(\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?)\s?(x|us|ms|s|MiB|MB|GiB|GB|KB|KiB|%)(?![\w/])"
)
BLOCK = re.compile(
    r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S
)

Figures = dict[str, dict[str, Any]]

# ---------------------------------------------------------------------------- formats


def ratio_text(value: float) -> str:
    return f"{value:.2f}x"


def ms_text(value_ms: float) -> str:
    return f"{value_ms:.1f} ms" if value_ms < 100 else f"{value_ms:.0f} ms"


def s_text(value_s: float) -> str:
    return f"{value_s:.3f} s"


def us_text(value_us: float) -> str:
    return f"{value_us:.1f} us"


def figure(text: Callable[[float], str], values: list[float], run: str, what: str) -> dict:
    """A figure from its rounds: the median, and min-max where there is more than one."""
    middle = statistics.median(values)
    found: dict[str, Any] = {"text": text(middle), "value": middle, "run": run, "what": what}
    if len(values) > 1:
        found["range"] = span(text, min(values), max(values))
    return found


def span(text: Callable[[float], str], low: float, high: float) -> str:
    """'1.70-1.90x': a range with its unit once."""
    low_text, high_text = text(low), text(high)
    unit = re.sub(r"^[\d.]+", "", high_text)
    return f"{low_text[: len(low_text) - len(unit)]}-{high_text}"


def slug(row: str) -> str:
    """'100 us step x8' -> 'slow100us_x8', 'CartPole x8' -> 'cartpole_x8'."""
    name = row.replace("100 us step", "slow100us").replace("CartPole-v1", "CartPole")
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


# ------------------------------------------------------------------- what runs yield

PEER_NAMES = {
    "Async": "async",
    "EnvPool": "envpool",
    "ForkVectorEnv auto": "fork",
    "ForkVectorEnv 1/sandbox": "fork1",
    "ceiling: Sync split over cores": "ceiling",
}


def from_peers(found: dict, run: str = "peers") -> Figures:
    """benchmarks/peers.py --json: steps/s ratios to Sync per round, construction, PSS."""
    out: Figures = {}
    for row, by in found["samples"].items():
        sync = by.get("Sync", [])
        if not sync or not all(isinstance(v, int | float) for v in sync):
            continue
        if row.startswith(("construction", "PSS")):
            continue
        for name, values in by.items():
            if name == "Sync" or not all(isinstance(v, int | float) for v in values):
                continue
            rounds = [v / s for v, s in zip(values, sync, strict=False)]
            out[f"step.{slug(row)}.{PEER_NAMES[name]}"] = figure(
                ratio_text, rounds, run, f"{row}: {name} steps/s / SyncVectorEnv's"
            )
        fork, async_, ceiling = (
            by.get(n) for n in ("ForkVectorEnv auto", "Async", "ceiling: Sync split over cores")
        )
        if _numbers(fork) and _numbers(async_):
            rounds = [f / a for f, a in zip(fork, async_, strict=False)]
            out[f"step.{slug(row)}.fork_vs_async"] = figure(
                ratio_text, rounds, run, f"{row}: ForkVectorEnv / AsyncVectorEnv steps/s"
            )
        if _numbers(fork) and _numbers(ceiling):
            rounds = [f / c for f, c in zip(fork, ceiling, strict=False)]
            out[f"step.{slug(row)}.fork_of_ceiling"] = figure(
                lambda v: f"{v:.2f}", rounds, run, f"{row}: ForkVectorEnv / the ceiling"
            )
    sync64 = found["samples"].get("CartPole x64", {}).get("Sync")
    if _numbers(sync64):
        out["cost.cartpole_step"] = figure(
            lambda v: f"{v:.0f} us",
            [1e6 / v for v in sync64],
            run,
            "one CartPole-v1 step in SyncVectorEnv x64 (1 / its steps/s): the env's own cost",
        )
    out["param.slow_step"] = {
        "text": f"{SLOW_STEP_US:.0f} us",
        "value": SLOW_STEP_US,
        "run": run,
        "what": "the busy-wait of peers.SlowStepEnv's step (a parameter)",
    }
    for name, values in found.get("construction_samples", {}).items():
        if _numbers(values):
            out[f"build.later.{PEER_NAMES.get(name, 'sync')}"] = figure(
                s_text, values, run, f"construction + first reset of CartPole x8: {name}, seconds"
            )
    pss = found["table"].get("PSS 16 envs (MiB)", {})
    for name, value in pss.items():
        if isinstance(value, int | float):
            out[f"pss16.{found['pss_env']}.{PEER_NAMES.get(name, 'sync')}"] = figure(
                lambda v: f"{v:.0f} MiB",
                [value],
                run,
                f"total PSS of 16 {found['pss_env']} envs: {name}",
            )
    return out


SLOW_STEP_US = 100.0  # peers.SlowStepEnv's default, the "100 us step" rows


def _numbers(values: Any) -> bool:
    return bool(values) and all(isinstance(v, int | float) for v in values)


def from_construction(found: dict, run: str = "construction") -> Figures:
    """benchmarks/construction_report.py --json: the first vector env of a fresh process."""
    out: Figures = {}
    seconds = []
    for work, rows in found["work"].items():
        tag = "w" + work.replace(".", "_")
        base = statistics.median(r["first"] for r in rows["async"])
        for kind, runs in rows.items():
            first = [r["first"] for r in runs]
            name = kind.replace("-", "_")
            what = f"first env of a fresh process after {work} s of other work: {kind}"
            out[f"build.first.{tag}.{name}"] = figure(s_text, first, run, what + ", seconds")
            if kind != "async":
                out[f"build.first.{tag}.{name}_vs_async"] = figure(
                    lambda v: f"{v:.1f}x",
                    [v / base for v in first],
                    run,
                    what + " / async's median",
                )
        seconds += [r["second"] for r in rows["fork"]]
    out["build.second.fork"] = figure(s_text, seconds, run, "the second ForkVectorEnv of a process")
    return out


def from_clones(found: dict, run: str = "clone") -> Figures:
    """benchmarks/clone_report.py --json: clone, fork, fan-out of 64 and their memory."""
    out: Figures = {}
    for row in found["rows"]:
        name = "cartpole" if row["name"].startswith("CartPole") else slug(row["name"])
        if "thp_off" in name:
            continue
        name = "heavy" if name.startswith("heavy") else name
        ms = [v * 1e3 for v in row["clone"]]
        apart = [v * 1e3 for v in row["clone_apart"]]
        fork = [v * 1e3 for v in row["fork"]]
        what = f"{row['name']}:"
        out[f"clone.{name}.apart_p50"] = figure(
            ms_text, [_pct(apart, 0.5)], run, what + " clone + first step 30 ms apart, p50"
        )
        out[f"clone.{name}.back_p50"] = figure(
            ms_text, [_pct(ms, 0.5)], run, what + " clone + first step back to back, p50"
        )
        out[f"clone.{name}.back_p99"] = figure(
            ms_text, [_pct(ms, 0.99)], run, what + " the same, p99"
        )
        out[f"fork.{name}.p50"] = figure(
            ms_text, [_pct(fork, 0.5)], run, what + " fork of a running sub-env + first step, p50"
        )
        out[f"fanout64.{name}"] = figure(
            ms_text, [v * 1e3 for v in row["fan"]], run, what + " fork(copies=64) + one step of all"
        )
        cold = statistics.median(row["cold"]) * 1e3
        out[f"cold.{name}"] = figure(
            ms_text, [cold], run, what + " env_fn() + reset + first step in-process, p50"
        )
        out[f"clone.{name}.vs_cold"] = figure(
            lambda v: f"{v:.0f}x" if v >= 10 else f"{v:.2f}x",
            [cold / _pct(apart, 0.5)],
            run,
            what + " cold p50 / clone apart p50",
        )
        share = row["independent_pss_kb"] / max(1, row["clones_pss_kb"])
        out[f"memory64.{name}"] = figure(
            lambda v: f"1/{v:.0f}",
            [share],
            run,
            what + " PSS 64 clones add, as a share of 64 independent copies'",
        )
    from gym_fork.bench.clones import CLONE_GAP_S

    out["param.clone_gap"] = {
        "text": f"{CLONE_GAP_S * 1e3:.0f} ms",
        "value": CLONE_GAP_S * 1e3,
        "run": run,
        "what": "the pause before each clone of the 'apart' series (a parameter)",
    }
    out["heavy.init_s"] = {
        "text": f"{found['heavy_init_s']} s",
        "value": found["heavy_init_s"],
        "run": run,
        "what": "the heavy env's init time (a parameter)",
    }
    out["heavy.mb"] = {
        "text": f"{found['heavy_mb']} MB",
        "value": found["heavy_mb"],
        "run": run,
        "what": "the heavy env's touched state (a parameter)",
    }
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def from_bench(found: dict, run: str = "ring") -> Figures:
    """gym-fork bench --json: a ring round trip against a pipe's."""
    trip = found["round_trip_us"]
    return {
        "round_trip.ring": figure(us_text, [trip["ring"]], run, "a ring round trip, us"),
        "round_trip.pipe": figure(us_text, [trip["pipe"]], run, "a pipe round trip, us"),
    }


def from_gymnasium_step(found: dict, run: str = "gymnasium_step") -> Figures:
    """benchmarks/gymnasium_step.py --json: Gymnasium's benchmark_vector_step."""
    out: Figures = {}
    for row, by in found["samples"].items():
        sync = by["Sync"]
        for name, values in by.items():
            key = f"gymnasium_step.{slug(row)}.{PEER_NAMES.get(name, 'sync')}"
            out[key] = figure(lambda v: f"{v:,.0f}", values, run, f"{row}: {name}, steps/s")
            if name != "Sync":
                out[key + "_vs_sync"] = figure(
                    ratio_text,
                    [v / s for v, s in zip(values, sync, strict=False)],
                    run,
                    f"{row}: {name} / Sync",
                )
    return out


def from_grouping(found: dict, run: str = "grouping") -> Figures:
    """benchmarks/grouping_report.py --json: autotune's fastest grouping against "auto"."""
    out: Figures = {}
    for row, r in found["rows"].items():
        by = r["by_grouping"]
        auto, best = str(r["auto"]), str(r["recommended"])
        key = f"grouping.{slug(row)}"
        out[key + ".auto"] = {
            "text": auto,
            "value": r["auto"],
            "run": run,
            "what": f'{row}: envs_per_worker "auto" gives',
        }
        out[key + ".best"] = {
            "text": best,
            "value": r["recommended"],
            "run": run,
            "what": f"{row}: autotune's fastest envs_per_worker",
        }
        # Each text compares the medians autotune ranked by; its range, the rounds.
        one_worker = str(max(map(int, by)))
        for name, k, what in (
            ("best_vs_auto", best, "fastest"),
            ("one_worker_vs_auto", one_worker, "all in one worker"),
            ("one_per_sandbox_vs_auto", "1", "one sub-env per sandbox"),
        ):
            per_round = [b / a for b, a in zip(r["rounds"][k], r["rounds"][auto], strict=False)]
            out[f"{key}.{name}"] = {
                **figure(ratio_text, per_round, run, f"{row}: {what} / auto (medians; rounds)"),
                "text": ratio_text(by[k] / by[auto]),
                "value": by[k] / by[auto],
            }
    return out


def from_suite(found: dict, run: str = "suite") -> Figures:
    """tools/run_gymnasium_suite.py --json: Gymnasium's own vector tests."""
    return {
        "suite.passed_async": {
            "text": str(found["passed_async"]),
            "value": found["passed_async"],
            "run": run,
            "what": "Gymnasium vector tests passing with AsyncVectorEnv",
        },
        "suite.passed_both": {
            "text": str(found["passed_both"]),
            "value": found["passed_both"],
            "run": run,
            "what": "of those, passing with ForkVectorEnv",
        },
        "suite.lost": {
            "text": str(len(found["lost"])),
            "value": len(found["lost"]),
            "run": run,
            "what": "; ".join(found["lost"]),
        },
    }


def stats_figure(
    text: Callable[[float], str], stats: dict, scale: float, run: str, what: str
) -> dict:
    """A figure from a benchmark's own {"median", "min", "max"} (values times ``scale``)."""
    middle, low, high = (stats[k] * scale for k in ("median", "min", "max"))
    found = {"text": text(middle), "value": middle, "run": run, "what": what}
    return {**found, "range": span(text, low, high)}


def ms2_text(value_ms: float) -> str:
    return f"{value_ms:.2f} ms"


def from_agent_workspace(found: dict, run: str = "agent_workspace") -> Figures:
    """benchmarks/agent_workspace.py --json: fork + first step of an agent's workspace."""
    workspace = f"{found['workspace']['mb']} MB in {found['workspace']['files']} files"
    out: Figures = {}
    for row, r in found["table"].items():
        key = f"agent.{slug(row)}"
        where = row.replace("sandbox", f"workspace ({workspace}) the source wrote")
        out[key + ".first_step"] = stats_figure(
            ms_text, r["first_step_s"], 1e3, run, f"{where}: until every copy's first step"
        )
        out[key + ".branches_per_s"] = {
            "text": f"{r['branches_per_s']:.0f}",
            "value": r["branches_per_s"],
            "run": run,
            "what": f"{where}: copies / median time to their first step",
        }
        if "swap_s" in r:
            out[key + ".swap"] = stats_figure(
                ms2_text, r["swap_s"], 1e3, run, f"{where}: the source's own time on its layer"
            )
    table = found["table"]
    if "fork x1 sandbox" in table and "fork x1 empty" in table:
        ratio = (
            table["fork x1 sandbox"]["first_step_s"]["median"]
            / table["fork x1 empty"]["first_step_s"]["median"]
        )
        out["agent.x1_sandbox_vs_empty"] = {
            "text": ratio_text(ratio),
            "value": ratio,
            "run": run,
            "what": f"fork x1 + first step: workspace ({workspace}) / empty, medians",
        }
    return out


EXTRACTORS: dict[str, Callable[[dict], Figures]] = {
    "peers": from_peers,
    "construction": from_construction,
    "clone": from_clones,
    "ring": from_bench,
    "gymnasium_step": from_gymnasium_step,
    "grouping": from_grouping,
    "suite": from_suite,
    "agent_workspace": from_agent_workspace,
}

# ----------------------------------------------------------------------- the file


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())


def save(results: dict, path: Path = RESULTS) -> None:
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")


def merge(results: dict, run: str, about: dict, raw: dict) -> dict:
    """Replace ``run``'s description, what its benchmark wrote and its figures."""
    kept = {k: v for k, v in results.get("figures", {}).items() if v["run"] != run}
    return {
        "runs": {**results.get("runs", {}), run: about},
        "raw": {**results.get("raw", {}), run: raw},
        "figures": {**kept, **EXTRACTORS[run](raw)},
    }


def extracted(results: dict) -> Figures:
    """The figures the stored benchmark output gives (what the file's figures must be)."""
    out: Figures = {}
    for run, raw in results.get("raw", {}).items():
        out.update(EXTRACTORS[run](raw))
    return out


def held_texts(results: dict) -> set[str]:
    """Every way the file lets a page print a figure."""
    held = set()
    for found in results["figures"].values():
        held.add(found["text"])
        if "range" in found:
            held.add(found["range"])
    return held


def tokens(text: str) -> Iterable[tuple[int, str]]:
    """(line number, figure) for every figure-looking token in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in FIGURE_TOKEN.finditer(line):
            yield number, f"{match.group(1)}{' ' if ' ' in match.group(0) else ''}{match.group(2)}"


def outside_blocks(text: str) -> str:
    """``text`` with every figures block's body blanked (line numbers kept)."""
    return BLOCK.sub(lambda m: m.group(1) + "\n" * m.group("body").count("\n") + m.group(4), text)


def unheld(text: str, results: dict) -> list[tuple[int, str]]:
    """Figures quoted outside the blocks that the results file does not hold."""
    held = held_texts(results)
    return [(n, t) for n, t in tokens(outside_blocks(text)) if t not in held]


def apply(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each block it has replaced by its rendering (KeyError if unknown)."""
    return BLOCK.sub(lambda m: m.group(1) + blocks[m.group("name")] + m.group(4), text)
