"""The GPU fork probe's plumbing, without a GPU (``--host``: host memory, no-op calls).

The probe is a one-shot device check (docs/gpu.md); this keeps it runnable where no
device is: every step answers, a forked child and its parent diverge, nothing is left.
"""

import json
import os
import subprocess
import sys

import pytest

PROBE = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu_fork_probe.py")


@pytest.mark.slow  # 5 s here
def test_the_probe_branches_a_host_memory_target_and_leaves_nothing(tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run(
        [sys.executable, PROBE, "--host", "--children", "2", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outcome = json.loads(out.read_text())
    for trial in ("fork_parent_first", "fork_child_first"):
        log = outcome[trial]
        assert log["diverged"] is True, log
        assert log["child_pointer"] == log["parent_pointer"], log
    rows = outcome["fan_out"]["rows"]
    assert len(rows) == 2 and all(row["exact"] for row in rows), rows
    assert outcome["fan_out"]["parent_exact"] is True
    assert outcome["left_alive"] == [] and outcome["target_stderr"] == {}
