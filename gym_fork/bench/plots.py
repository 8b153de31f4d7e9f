"""PNG plots of a ``gym-fork bench`` result (needs matplotlib: extra ``plots``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

COLOURS = {"sync": "#757575", "async": "#90a4ae", "fork": "#1565c0", "cold": "#ef6c00"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("plots need matplotlib: pip install 'gym_fork[plots]'") from exc
    return plt


def _caption(result: dict[str, Any]) -> str:
    meta = result["meta"]
    return (
        f"gym-fork bench ({meta['mode']}) {meta['date'][:10]}, {meta['cpus']} cores, "
        f"load {meta['load_average'][0]:.1f}"
    )


def write_plots(result: dict[str, Any], directory: str | os.PathLike) -> list[Path]:
    """Write bench-throughput.png, bench-clone.png, bench-fanout.png and bench-memory.png
    into ``directory``; return their paths."""
    plt = _pyplot()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, draw in (
        ("bench-throughput.png", _throughput),
        ("bench-clone.png", _clone),
        ("bench-fanout.png", _fanout),
        ("bench-memory.png", _memory),
    ):
        fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=110)
        draw(ax, result)
        fig.text(0.99, 0.01, _caption(result), ha="right", va="bottom", fontsize=7, color="#777")
        fig.tight_layout(rect=(0, 0.03, 1, 1))
        fig.savefig(out / name, facecolor="white")
        plt.close(fig)
        paths.append(out / name)
    return paths


def _throughput(ax: Any, result: dict[str, Any]) -> None:
    tp = result["throughput"]
    names = list(tp["steps_per_s"])
    values = [tp["steps_per_s"][n] for n in names]
    anchor = tp["steps_per_s"]["AsyncVectorEnv"]
    colours = [
        COLOURS["fork"] if n.startswith("Fork") else COLOURS["async" if "Async" in n else "sync"]
        for n in names
    ]
    bars = ax.barh(range(len(names)), values, color=colours)
    ax.set_yticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.invert_yaxis()
    for bar, value in zip(bars, values, strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {value:,.0f}  ({value / anchor:.1f}x Async)",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(0, max(values) * 1.45)
    ax.set_xlabel("sub-env steps per second (higher is better)")
    ax.set_title(f"Step throughput, {tp['env']} x{tp['num_envs']}", fontsize=10)


def _clone(ax: Any, result: dict[str, Any]) -> None:
    rows = result["clones"]
    names = [r["name"] for r in rows]
    width = 0.27
    series = [
        ("cold build + first step", [r["cold_ms"] for r in rows], COLOURS["cold"]),
        ("clone of the warm parent + step", [r["clone_ms"]["p50"] for r in rows], COLOURS["fork"]),
        ("fork() of a running sub-env + step", [r["fork_ms"]["p50"] for r in rows], "#64b5f6"),
    ]
    for k, (label, values, colour) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(rows))]
        bars = ax.bar(xs, values, width, label=label, color=colour)
        for bar, value in zip(bars, values, strict=True):
            ax.text(
                bar.get_x() + bar.get_width() / 2,
                value,
                f"{value:.1f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), names, fontsize=8)
    ax.set_ylabel("ms (p50, log scale)")
    ax.set_title("Cold start against a clone of a warm parent", fontsize=10)
    ax.legend(fontsize=8)


def _fanout(ax: Any, result: dict[str, Any]) -> None:
    for r in result["clones"]:
        sizes = [int(n) for n in r["fan_out_ms"]]
        ax.plot(sizes, list(r["fan_out_ms"].values()), marker="o", label=r["name"])
    sizes = sorted({int(n) for r in result["clones"] for n in r["fan_out_ms"]})
    ax.set_xticks(sizes)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("copies in one fork(copies=N) + one step of all")
    ax.set_ylabel("ms")
    ax.set_title("Fan-out time", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _memory(ax: Any, result: dict[str, Any]) -> None:
    rows = result["clones"]
    width = 0.38
    clones = [r["clones_pss_mb"] for r in rows]
    independent = [r["independent_pss_mb"] for r in rows]
    n = rows[0]["clones"] if rows else 0
    left = ax.bar(
        [i - width / 2 for i in range(len(rows))],
        independent,
        width,
        label=f"{n} independent envs",
        color=COLOURS["cold"],
    )
    right = ax.bar(
        [i + width / 2 for i in range(len(rows))],
        clones,
        width,
        label=f"{n} clones (fork copies={n})",
        color=COLOURS["fork"],
    )
    for bar, value in zip(left, independent, strict=True):
        ax.text(
            bar.get_x() + bar.get_width() / 2,
            value,
            f"{value:,.0f} MB",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    for bar, r in zip(right, rows, strict=True):
        ax.text(
            bar.get_x() + bar.get_width() / 2,
            bar.get_height(),
            f"{r['clones_pss_mb']:,.0f} MB\n= 1/{r['memory_ratio']:.0f}",
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_ylim(0, max(independent + clones, default=1) * 1.2)
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.set_ylabel("PSS, MB")
    ax.set_title(f"Memory of {n} clones against {n} independent envs", fontsize=10)
    ax.legend(fontsize=8)
