"""Every Python block of README.md runs as pasted, as a script of its own (a fresh
interpreter, the way a user pastes it into a file and runs it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.slow  # 2.6 s here
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_block_runs_as_pasted(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(BLOCKS[index])
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, BLOCKS[index] + proc.stdout[-2000:] + proc.stderr[-3000:]
