"""Every test must leave no sandbox process, fd or shared-memory file behind."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import tempfile

import pytest

from tests.helpers import (
    descendants,
    gym_fork_cgroups,
    gym_fork_scratch_dirs,
    gym_fork_shm_files,
    marked_processes,
    open_fds,
    wait_until,
)


def pytest_collection_modifyitems(config, items):
    """Under GYM_FORK_HOST=microvm (the suites re-run against VMs), tests that need
    what only the process host has are skipped, each with its reason printed."""
    if os.environ.get("GYM_FORK_HOST") != "microvm":
        return
    reasons = {
        "host_files": "microVM sandboxes do not see the host's files (they have their own disk)",
        "process_only": "checks a property of the process host",
    }
    for item in items:
        for marker, reason in reasons.items():
            if item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"host='microvm': {reason}"))


@pytest.fixture
def ctrl_c():
    """Send this process a real Ctrl-C (SIGINT), handled as Python does by default (a
    test runner may start with SIGINT ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield lambda: os.kill(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(autouse=True, scope="session")
def tmp_paths_readable_by_sandboxes(tmp_path_factory):
    """Sandboxes run as an unprivileged uid (gym_fork/system/identity.py): pytest's
    tmp_path lies in /tmp/pytest-of-root, which only root may enter. Tests hand sandboxes
    files there as a user hands them a dataset: let other users in (not list)."""
    base = tmp_path_factory.getbasetemp()
    top = os.path.realpath(tempfile.gettempdir())
    # Every level up to the temp dir: under pytest-xdist the base is one deeper
    # (pytest-of-root/pytest-N/popen-gwK).
    for directory in (base, *base.parents):
        if os.path.realpath(directory) == top:
            break
        _let_others_enter(directory)
    yield


@pytest.fixture(autouse=True)
def tmp_path_writable_by_sandboxes(request):
    """Each test's own tmp_path (made 0700 by pytest) is where tests let sandboxes
    write (with private_tmp=False or writable_paths): /tmp's mode, 1777."""
    if "tmp_path" in request.fixturenames:
        request.getfixturevalue("tmp_path").chmod(0o1777)
    yield


def _let_others_enter(directory) -> None:
    os.chmod(directory, os.stat(directory).st_mode | 0o011)


@pytest.fixture(autouse=True, scope="session")
def throwaway_lineage_log():
    """Tests write their provenance to a throw-away log, not the user's state directory."""
    if "GYM_FORK_LINEAGE_LOG" in os.environ:
        yield
        return
    directory = tempfile.mkdtemp(prefix="gym_fork-test-")
    os.environ["GYM_FORK_LINEAGE_LOG"] = os.path.join(directory, "lineage.jsonl")
    yield
    del os.environ["GYM_FORK_LINEAGE_LOG"]
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leaks(request):
    if request.node.get_closest_marker("leaks_checked_inside"):
        yield
        return
    gc.collect()
    procs_before, fds_before, shm_before = descendants(), open_fds(), gym_fork_shm_files()
    marked_before = marked_processes()
    scratch_before = gym_fork_scratch_dirs()
    cgroups_before = gym_fork_cgroups()
    yield
    gc.collect()
    assert wait_until(lambda: descendants() <= procs_before), (
        f"leaked processes: {descendants() - procs_before}"
    )
    assert wait_until(lambda: marked_processes() <= marked_before), (
        f"leaked sandbox processes (found by marker): {marked_processes() - marked_before}"
    )
    assert wait_until(lambda: open_fds() <= fds_before), f"leaked fds: {open_fds() - fds_before}"
    assert gym_fork_shm_files() <= shm_before
    assert wait_until(lambda: gym_fork_scratch_dirs() <= scratch_before), (
        f"leaked scratch dirs: {gym_fork_scratch_dirs() - scratch_before}"
    )
    assert wait_until(lambda: gym_fork_cgroups() <= cgroups_before), (
        f"leaked cgroups: {gym_fork_cgroups() - cgroups_before}"
    )
