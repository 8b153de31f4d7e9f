"""Measure every published figure and write them into docs/results.json, then redraw the
pages' figure blocks from it (README.md, docs/guides/faq.md, docs/benchmarks.md).

    .venv/bin/python benchmarks/publish.py [--runs peers,clone,...] [--quick]
                                           [--gymnasium-git DIR] [--render]

Each run is one benchmark script in its own interpreter, started from /tmp (so its
sandboxes import the installed gym_fork, not a checkout on the path), one after the
other; its JSON goes through benchmarks/figures.py's extractor into the results file with
the command, date, commit, load and machine. ``--runs`` redoes only those (the others keep
their figures and their own dates). ``--render`` redraws the pages without measuring.
Run it on a quiet machine: nothing else stepping envs (the load is recorded per run).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import figures
import pages

ROOT = figures.ROOT
BENCH = ROOT / "benchmarks"


def commands(quick: bool, out: str, gymnasium_git: str | None) -> dict[str, list[str]]:
    """What each run executes (its JSON lands in ``out``)."""
    py = sys.executable
    made = {
        "peers": [py, str(BENCH / "peers.py"), "--json", out, "--png", out + ".png"],
        "construction": [py, str(BENCH / "construction_report.py"), "--runs", "3", "--json", out],
        "clone": [py, str(BENCH / "clone_report.py"), "--json", out],
        "ring": [py, "-m", "gym_fork", "bench", "--quick", "-q", "--json", out],
        "gymnasium_step": [py, str(BENCH / "gymnasium_step.py"), "--json", out],
        "grouping": [py, str(BENCH / "grouping_report.py"), "--json", out],
        "agent_workspace": [py, str(BENCH / "agent_workspace.py"), "--json", out],
    }
    if quick:
        made["peers"].append("--quick")
        made["construction"][3] = "1"
        made["clone"].append("--quick")
        made["gymnasium_step"] += ["--rounds", "1", "--seconds", "0.5"]
        made["grouping"] += ["--rounds", "1"]
        made["agent_workspace"] += ["--rounds", "1"]
    if gymnasium_git:
        made["suite"] = [
            py,
            str(ROOT / "tools" / "run_gymnasium_suite.py"),
            gymnasium_git,
            "--json",
            out,
        ]
    return made


def shown(argv: list[str]) -> str:
    """A command as a reader would type it from the repository root."""
    words = []
    for word in argv:
        if word == sys.executable:
            word = "python"
        elif word.startswith(str(ROOT) + "/"):
            word = word[len(str(ROOT)) + 1 :]
        elif word.startswith(tempfile.gettempdir()):
            word = "OUT.json" if word.endswith(".json") else "OUT.png"
        words.append(word)
    return " ".join(words)


def machine() -> dict:
    """The machine a run measured: cores, CPU model, memory, kernel, Python."""
    cpu = "?"
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as info:
        kib = int(next(line.split()[1] for line in info if line.startswith("MemTotal")))
    return {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": cpu,
        "memory_gib": round(kib / 2**20),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def head() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True
        ).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (
        "-dirty" if git("status", "--porcelain", "--untracked-files=no") else ""
    )


# Before each run, wait (up to SETTLE_S) for the 1-minute load to fall under SETTLED_LOAD:
# the previous run's own processes stay in the average for a minute after it ends.
SETTLED_LOAD, SETTLE_S = 1.0, 120.0


def settle() -> None:
    deadline = time.monotonic() + SETTLE_S
    while os.getloadavg()[0] > SETTLED_LOAD and time.monotonic() < deadline:
        time.sleep(5)


def measure(name: str, argv: list[str], out: str) -> tuple[dict, dict]:
    """Run one benchmark; (its description, the JSON it wrote)."""
    settle()
    load_before = list(os.getloadavg())
    print(f"[{name}] load {load_before[0]:.2f}: {shown(argv)}", flush=True)
    started = time.monotonic()
    subprocess.run(argv, cwd=tempfile.gettempdir(), check=True, stdout=subprocess.DEVNULL)
    found = json.loads(Path(out).read_text())
    about = {
        "command": shown(argv),
        "date": time.strftime("%Y-%m-%d %H:%M %z"),
        "head": head(),
        "machine": machine(),
        "load_before": load_before,
        "load_after": list(os.getloadavg()),
        "seconds": round(time.monotonic() - started),
    }
    return about, found


def render_pages(results: dict) -> list[str]:
    """Redraw the blocks of every checked page; the pages that changed."""
    changed = []
    for name, (now, drawn) in pages.rendered_pages(results).items():
        if now != drawn:
            (ROOT / name).write_text(drawn)
            changed.append(name)
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", help="comma-separated: " + ",".join(figures.EXTRACTORS))
    parser.add_argument("--quick", action="store_true", help="one round each (a smoke run)")
    parser.add_argument("--gymnasium-git", help="a Gymnasium clone: also run its vector tests")
    parser.add_argument("--results", default=str(figures.RESULTS), help="the results file")
    parser.add_argument("--render", action="store_true", help="only redraw the pages")
    args = parser.parse_args()
    path = Path(args.results)
    results = figures.load(path) if path.exists() else {"runs": {}, "figures": {}}
    if not args.render:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "run.json")
            runs = commands(args.quick, out, args.gymnasium_git)
            chosen = args.runs.split(",") if args.runs else list(runs)
            unknown = sorted(set(chosen) - set(runs))
            if unknown:
                parser.error(f"unknown or unavailable runs: {', '.join(unknown)}")
            for name in chosen:
                about, found = measure(name, runs[name], out)
                results = figures.merge(results, name, about, found)
                figures.save(results, path)
    elif results.get("raw"):  # an extractor may have changed: the figures follow it
        results = {**results, "figures": figures.extracted(results)}
        figures.save(results, path)
    if path == figures.RESULTS:
        print("pages redrawn:", ", ".join(render_pages(results)) or "none changed")


if __name__ == "__main__":
    main()
