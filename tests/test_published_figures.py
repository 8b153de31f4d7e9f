"""Every figure README.md, the FAQ and docs/benchmarks.md quote comes from one results file,
docs/results.json, written by benchmarks/publish.py (issue 31)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import figures  # noqa: E402
import pages  # noqa: E402

REDRAW = "redraw with `python benchmarks/publish.py --render` (or measure again without it)"


def test_every_block_on_the_pages_is_drawn_from_the_results_file() -> None:
    results = figures.load()
    stale = [name for name, (now, drawn) in pages.rendered_pages(results).items() if now != drawn]
    assert not stale, f"figure blocks differ from docs/results.json in {stale}: {REDRAW}"


def test_every_block_is_on_a_page() -> None:
    text = "".join((ROOT / name).read_text() for name in figures.CHECKED_PAGES)
    on_pages = {match.group("name") for match in figures.BLOCK.finditer(text)}
    assert on_pages == set(pages.RENDERERS), (
        f"blocks without a renderer: {sorted(on_pages - set(pages.RENDERERS))}; "
        f"renderers without a block: {sorted(set(pages.RENDERERS) - on_pages)}"
    )


def test_no_checked_page_quotes_a_figure_the_results_file_does_not_hold() -> None:
    results = figures.load()
    quoted = {
        name: figures.unheld((ROOT / name).read_text(), results) for name in figures.CHECKED_PAGES
    }
    quoted = {name: found for name, found in quoted.items() if found}
    assert not quoted, (
        f"figures outside the generated blocks that docs/results.json lacks (page: [(line, "
        f"figure)]): {quoted}; put them in a block drawn from the file, or drop them"
    )


def test_every_figure_names_its_run_and_every_run_says_how_and_where() -> None:
    results = figures.load()
    runs = results["runs"]
    for key, found in results["figures"].items():
        assert found["run"] in runs, f"{key} names run {found['run']!r}, not in the file"
        assert found["text"] and found["what"], key
    for name, run in runs.items():
        missing = {"command", "date", "head", "machine", "load_before", "load_after"} - set(run)
        assert not missing, f"run {name} lacks {sorted(missing)}"
        assert run["machine"]["cpus"] >= 1 and run["machine"]["cpu"], name
    # The pages say "medians of 3": the step figures have their three rounds' range.
    assert "range" in results["figures"]["step.cartpole_x8.fork"]


def test_a_figure_the_file_lacks_is_reported_with_its_line() -> None:
    results = {
        "runs": {},
        "figures": {"a": {"text": "1.82x", "value": 1.82, "run": "r", "what": "w"}},
    }
    page = (
        "ForkVectorEnv does 1.82x Sync's steps/s\n"
        "and 2.5x Async's, with 4.1-5.0 ms clones.\n"
        "<!-- figures:x -->\n9.9 ms inside a block is the renderer's\n<!-- /figures:x -->\n"
        "x8 and ~x2 name sizes, not figures.\n"
    )
    assert figures.unheld(page, results) == [(2, "2.5x"), (2, "4.1-5.0 ms")]


def test_a_block_that_differs_from_its_rendering_is_redrawn() -> None:
    page = (
        "before\n<!-- figures:faq-peers -->\n| stale | 9.99x |\n"
        "<!-- /figures:faq-peers -->\nafter\n"
    )
    drawn = figures.apply(page, pages.render(figures.load()))
    assert "9.99x" not in drawn and drawn.startswith("before\n") and drawn.endswith("after\n")
    assert "| workload | SyncVectorEnv |" in drawn
    with pytest.raises(KeyError):
        figures.apply("<!-- figures:nope -->\n<!-- /figures:nope -->\n", {})


def test_a_figure_the_file_lacks_renders_as_na_not_as_a_number() -> None:
    results = figures.load()
    thinned = {
        "runs": results["runs"],
        "figures": {k: v for k, v in results["figures"].items() if not k.startswith("step.")},
    }
    drawn = pages.render(thinned)["faq-peers"]
    assert "n/a" in drawn and "CartPole-v1 x8 | 1.00x | n/a |" in drawn


@pytest.mark.slow
def test_gym_fork_bench_json_becomes_the_round_trip_figures(tmp_path: Path) -> None:
    """The extractor reads what the benchmark writes today (run as a user runs it)."""
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "gym_fork", "bench", "--tiny", "-q", "--json", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = figures.from_bench(json.loads(out.read_text()))
    for key in ("round_trip.ring", "round_trip.pipe"):
        assert found[key]["value"] > 0 and found[key]["text"].endswith(" us"), found[key]


@pytest.mark.slow
def test_gymnasiums_vector_step_benchmark_becomes_figures(tmp_path: Path) -> None:
    out = tmp_path / "step.json"
    script = ROOT / "benchmarks" / "gymnasium_step.py"
    argv = [sys.executable, str(script), "--rounds", "1", "--seconds", "0.2", "--json", str(out)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = figures.from_gymnasium_step(json.loads(out.read_text()))
    for row in ("cartpole_x8", "slow100us_x8"):
        assert found[f"gymnasium_step.{row}.fork"]["value"] > 0
        assert found[f"gymnasium_step.{row}.fork_vs_sync"]["text"].endswith("x")


@pytest.mark.slow
def test_the_agent_workspace_benchmark_becomes_figures(tmp_path: Path) -> None:
    """Its JSON as the benchmark writes it today (a small workspace, one copy, one round)."""
    out = tmp_path / "agent.json"
    script = ROOT / "benchmarks" / "agent_workspace.py"
    argv = [sys.executable, str(script), "--rounds", "1", "--contenders", "fork", "--copies"]
    argv += ["1", "--mb", "1", "--files", "20", "--quiet-wait", "0", "--json", str(out)]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    found = figures.from_agent_workspace(json.loads(out.read_text()))
    for row in ("fork_x1_empty", "fork_x1_sandbox", "fork_x1_parent"):
        first, swap = found[f"agent.{row}.first_step"], found[f"agent.{row}.swap"]
        assert first["text"].endswith(" ms") and 0 < first["value"] < 10_000, first
        assert 0 < swap["value"] <= first["value"], (swap, first)
        assert float(found[f"agent.{row}.branches_per_s"]["text"]) > 0
    ratio = found["agent.x1_sandbox_vs_empty"]
    assert ratio["value"] == pytest.approx(
        found["agent.fork_x1_sandbox.first_step"]["value"]
        / found["agent.fork_x1_empty.first_step"]["value"]
    )
    assert not any("_x8_" in key or "_x64_" in key for key in found), sorted(found)


def test_the_figures_are_what_the_stored_benchmark_output_gives() -> None:
    """Nobody typed a figure in: each is re-derived from the JSON its benchmark wrote."""
    results = figures.load()
    assert set(results["raw"]) == set(results["runs"])
    assert results["figures"] == figures.extracted(results), REDRAW
