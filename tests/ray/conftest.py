"""One loopback Ray cluster per test module, torn down with a check for leftovers."""

from __future__ import annotations

import os

# Before anything imports ray: keep ray.init(address="127.0.0.1:...") on loopback (see
# gym_fork/ray/cluster.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "leaks_checked_inside: the test (or its module fixture) checks for leftover "
        "processes itself; the autouse per-test descendant check is skipped",
    )


def pytest_collection_modifyitems(config, items):
    """Every test here starts a loopback Ray cluster: marked ``ray`` (the fast loop skips
    them)."""
    import pytest

    for item in items:
        if "tests/ray/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.ray)
