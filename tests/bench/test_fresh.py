"""gym_fork/bench/fresh.py: a measurement in a fresh interpreter."""

from __future__ import annotations

import sys

import pytest

from gym_fork.bench.fresh import last_json


def test_the_json_of_the_last_line_is_the_result():
    code = "print('warming up'); print('{\"steps\": 3}')"
    assert last_json([sys.executable, "-c", code], 30, "probe") == {"steps": 3}


def test_a_failed_measurement_names_what_and_shows_its_stderr():
    code = "import sys; sys.stderr.write('no env here'); sys.exit(2)"
    with pytest.raises(SystemExit, match="probe failed:\nno env here"):
        last_json([sys.executable, "-c", code], 30, "probe")
