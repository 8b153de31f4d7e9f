"""The ``gym-fork`` command line: bench, and the lineage tree as text, HTML and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gym_fork.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def gym_fork_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "GYM_FORK_PROGRESS"}
    return subprocess.run(
        [sys.executable, "-m", "gym_fork", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.slow
def test_bench_tiny_writes_every_figure(tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    done = gym_fork_cli("bench", "--tiny", "--json", str(out), "--plots", str(plots))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert done.stderr == ""  # no progress bars: stderr is not a terminal
    assert "vs Async" in done.stdout and "fan-out" in done.stdout
    result = json.loads(out.read_text())
    assert set(result) == {"meta", "throughput", "round_trip_us", "clones"}
    meta = result["meta"]
    for key in ("mode", "date", "cpus", "load_average", "python", "packages", "sizes"):
        assert key in meta, key
    assert meta["mode"] == "tiny" and meta["elapsed_s"] > 0
    tp = result["throughput"]
    assert set(tp["steps_per_s"]) == {
        "SyncVectorEnv",
        "AsyncVectorEnv",
        "ForkVectorEnv (auto)",
    }
    assert all(v > 0 for v in tp["steps_per_s"].values())
    assert set(tp["ratios"]) == {"fork_vs_async", "fork_vs_sync", "sync_vs_async"}
    assert all(v > 0 for v in tp["ratios"].values())
    assert tp["ratios"]["fork_vs_async"] == pytest.approx(
        tp["steps_per_s"]["ForkVectorEnv (auto)"] / tp["steps_per_s"]["AsyncVectorEnv"]
    )
    rt = result["round_trip_us"]
    assert rt["ring"] > 0 and rt["pipe"] > 0 and rt["pipe_vs_ring"] > 0
    names = [row["name"] for row in result["clones"]]
    assert names[0] == "CartPole-v1" and any(n.startswith("heavy") for n in names)
    sizes = meta["sizes"]["fan_sizes"]
    for row in result["clones"]:
        for key in ("cold_ms", "cold_vs_clone", "clones_pss_mb", "independent_pss_mb"):
            assert row[key] > 0, (row["name"], key)
        for key in ("clone_ms", "fork_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p99"], (row["name"], key)
        assert row["clone_apart_ms"]["p50"] > 0, row["name"]
        assert [int(n) for n in row["fan_out_ms"]] == sizes
        assert all(v > 0 for v in row["fan_out_ms"].values())
        assert row["clones"] == max(sizes)
        assert row["memory_ratio"] == pytest.approx(
            row["independent_pss_mb"] / row["clones_pss_mb"], rel=1e-3
        )
        assert len(row["samples_ms"]["clone"]) == meta["sizes"]["clone_runs"]
    heavy = next(r for r in result["clones"] if r["name"].startswith("heavy"))
    assert heavy["cold_ms"] >= 150  # the heavy env really took its 0.2 s to build
    written = sorted(p.name for p in plots.iterdir())
    assert written == [
        "bench-clone.png",
        "bench-fanout.png",
        "bench-memory.png",
        "bench-throughput.png",
    ]
    for name in written:
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def _events() -> list[dict]:
    """A hand-written log: a root, a reseeded branch of it, a grandchild, a crashed
    branch; and a second tree."""
    return [
        {"event": "root_ready", "branch_id": "root", "parent_branch_id": None,
         "baseline_id": "4f3c2a1b9d8e7f60", "num_envs": 2, "created": 100.0,
         "timings": {"parent_ready_s": 0.2, "sandboxes_ready_s": 0.01}, "pids": [11, 12]},
        {"event": "branch_created", "branch_id": "child", "parent_branch_id": "root",
         "baseline_id": "4f3c2a1b9d8e7f60", "num_envs": 3, "source_indices": [1], "copies": 3,
         "seeds": [10, 11, 12], "created": 101.0, "timings": {"fork_s": 0.012},
         "pids": [21, 22, 23]},
        {"event": "branch_created", "branch_id": "grandchild", "parent_branch_id": "child",
         "baseline_id": "4f3c2a1b9d8e7f60", "num_envs": 1, "source_indices": [2], "copies": 1,
         "seeds": [None], "created": 102.0, "timings": {"fork_s": 0.004}, "pids": [31]},
        {"event": "branch_created", "branch_id": "crashy", "parent_branch_id": "root",
         "baseline_id": "4f3c2a1b9d8e7f60", "num_envs": 1, "source_indices": [0], "copies": 1,
         "seeds": [None], "created": 103.0, "timings": {"fork_s": 0.005}, "pids": [41]},
        {"event": "replaced", "branch_id": "crashy", "time": 103.5},
        {"event": "closed", "branch_id": "grandchild", "closed": 104.0, "exit_status": "closed"},
        {"event": "closed", "branch_id": "crashy", "closed": 104.5, "exit_status": "crashed"},
        {"event": "closed", "branch_id": "child", "closed": 105.0, "exit_status": "terminated"},
        {"event": "root_ready", "branch_id": "other-root", "parent_branch_id": None,
         "baseline_id": "0123456789abcdef", "num_envs": 4, "created": 200.0,
         "timings": {}, "pids": [51, 52, 53, 54]},
    ]  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def fonts_loaded(tmp_path_factory):
    """matplotlib keeps the font files it has used open for the life of the process:
    draw once before the leak check of the first test takes its snapshot of fds."""
    from gym_fork.lineage.png import render_png

    render_png(_events(), tmp_path_factory.mktemp("warm") / "warm.png")


@pytest.fixture
def log(tmp_path) -> Path:
    path = tmp_path / "lineage.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in _events()))
    return path


def test_lineage_text_shows_the_latest_run_unless_told(log, capsys):
    # No run records in this log: each root is a run of its own, shown with no heading.
    assert main(["lineage", str(log)]) == 0
    assert capsys.readouterr().out == "other-root baseline=0123456789abcdef x4 [open]\n"
    assert main(["lineage", str(log), "--all"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "root baseline=4f3c2a1b9d8e7f60 x2 [open]"
    assert "└── grandchild from [2] x1 -> 1 sub-envs [closed]" in out
    assert "<" not in out


def test_lineage_html_is_self_contained(log, tmp_path, capsys):
    page_path = tmp_path / "tree.html"
    assert main(["lineage", str(log), "--html", str(page_path), "--all"]) == 0
    assert "wrote" in capsys.readouterr().out
    page = page_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<svg" in page
    lowered = page.lower()
    assert "<script" not in lowered and "<link" not in lowered and "@import" not in lowered
    assert "src=" not in lowered
    # Nothing fetched: the only URL is the SVG namespace, which is a name, not a download.
    urls = {part.split('"')[0] for part in page.split("http")[1:]}
    assert urls <= {"://www.w3.org/2000/svg"}, urls
    for text in ("root", "child", "grandchild", "crashy", "other-root"):  # branch ids
        assert f">{text}<" in page, text
    assert "[10, 11, 12]" in page  # seeds
    assert "fork 12.0 ms" in page and "parent 200 ms" in page  # timings
    assert "21, 22, 23" in page  # pids
    assert ">terminated<" in page and ">crashed<" in page and ">open<" in page
    assert "#c62828" in page  # a crash is drawn in the failure colour
    assert "2 tree(s), 5 vector env(s), 11 sub-envs in all" in page


def test_lineage_png_without_matplotlib_writes_nothing(log, tmp_path, capsys, monkeypatch):
    """--html and --png together where matplotlib is missing: the error, and no HTML
    left behind as if the command had half worked."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    page, png = tmp_path / "tree.html", tmp_path / "tree.png"
    assert main(["lineage", str(log), "--html", str(page), "--png", str(png)]) == 2
    assert "--png needs matplotlib" in capsys.readouterr().out
    assert not page.exists() and not png.exists()


def test_lineage_png_and_tree_selection(log, tmp_path, capsys):
    png = tmp_path / "tree.png"
    assert main(["lineage", str(log), "--png", str(png), "--root", "grandchild"]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC
    page_path = tmp_path / "last.html"
    assert main(["lineage", str(log), "--html", str(page_path), "--last", "1"]) == 0
    page = page_path.read_text()
    assert ">other-root<" in page and ">grandchild<" not in page
    capsys.readouterr()
    assert main(["lineage", str(log), "--html", str(page_path), "--root", "nope"]) == 2
    assert "no branch 'nope'" in capsys.readouterr().out


def test_lineage_missing_log(tmp_path, capsys):
    assert main(["lineage", str(tmp_path / "none.jsonl"), "--html", "x.html"]) == 2
    assert "no such log" in capsys.readouterr().out
