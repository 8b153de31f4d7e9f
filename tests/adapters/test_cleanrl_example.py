"""examples/ppo_cleanrl.py runs short, evaluates on branches, and leaves training alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the CleanRL example needs torch (the test extra)")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ppo_cleanrl.py"


@pytest.mark.slow
def test_short_run_prints_branch_evaluations():
    args = ["--total-timesteps", "3072", "--num-envs", "4", "--num-steps", "128"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--eval-every", "2", "--eval-episodes", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    # 6 iterations: evaluations before iterations 1, 2, 4 and 6, then a final one.
    evals = re.findall(r"^eval iteration=(\d+) .*mean_return=([\d.]+) returns=\[(.*)\]$", out, re.M)
    assert [int(it) for it, _, _ in evals] == [1, 2, 4, 6]
    for _, mean, returns in evals:
        values = [float(r) for r in returns.split(",")]
        assert len(values) == 3 and abs(sum(values) / 3 - float(mean)) < 0.6
    assert re.search(r"^eval final global_step=3072 mean_return=[\d.]+ ", out, re.M)
    # Each evaluation's witness saw the training envs' next step unchanged.
    witnessed = re.findall(r"^training envs undisturbed by the evaluation: (\w+)$", out, re.M)
    assert witnessed == ["True"] * 4
    assert len(re.findall(r"^iteration=\d+ global_step=\d+ train_return=", out, re.M)) == 6
