"""Every test must leave no sandbox process, fd or shared-memory file behind."""

from __future__ import annotations

import gc
import os
import tempfile

import pytest

# Tests write their provenance to a throw-away log, not the user's state directory.
os.environ.setdefault(
    "GYM_FORK_LINEAGE_LOG", os.path.join(tempfile.mkdtemp(prefix="gym_fork-test-"), "lineage.jsonl")
)

from tests.helpers import (
    descendants,
    gym_fork_cgroups,
    gym_fork_scratch_dirs,
    gym_fork_shm_files,
    open_fds,
    wait_until,
)


@pytest.fixture(autouse=True)
def no_leaks(request):
    if request.node.get_closest_marker("leaks_checked_inside"):
        yield
        return
    gc.collect()
    procs_before, fds_before, shm_before = descendants(), open_fds(), gym_fork_shm_files()
    scratch_before = gym_fork_scratch_dirs()
    cgroups_before = gym_fork_cgroups()
    yield
    gc.collect()
    assert wait_until(lambda: descendants() <= procs_before), (
        f"leaked processes: {descendants() - procs_before}"
    )
    assert wait_until(lambda: open_fds() <= fds_before), f"leaked fds: {open_fds() - fds_before}"
    assert gym_fork_shm_files() <= shm_before
    assert wait_until(lambda: gym_fork_scratch_dirs() <= scratch_before), (
        f"leaked scratch dirs: {gym_fork_scratch_dirs() - scratch_before}"
    )
    assert wait_until(lambda: gym_fork_cgroups() <= cgroups_before), (
        f"leaked cgroups: {gym_fork_cgroups() - cgroups_before}"
    )
