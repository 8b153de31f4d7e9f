"""Warm parents import what building env_fns[0] imports, so sandboxes share it."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import gymnasium as gym
import pytest

from gym_fork import ForkVectorEnv

pytestmark = pytest.mark.process_only
LAZY = "gf_lazily_imported"  # a package only the env_fns import (never the controller)


@pytest.fixture(autouse=True)
def lazy_library(tmp_path_factory, monkeypatch):
    """LAZY as an installed library: a directory on the user's PYTHONPATH (the
    pre-import imports installed packages only, never a script next to the program)."""
    library = tmp_path_factory.getbasetemp() / "preimport-library"
    if not library.exists():
        (library / LAZY).mkdir(parents=True)
        (library / LAZY / "__init__.py").write_text("VALUE = 42\n")
        time.sleep(0.1)  # older than any build: the pre-import checks file times
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(library), os.environ.get("PYTHONPATH", "")])
    )
    monkeypatch.syspath_prepend(str(library))
    yield
    sys.modules.pop(LAZY, None)


class Probe(gym.Env):
    """Remembers whether LAZY was imported in its process before it was built."""

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, imported_before_build: bool):
        self.imported_before_build = imported_before_build

    def reset(self, *, seed=None, options=None):
        return 0, {}

    def step(self, action):
        return 0, 0.0, False, False, {}


def lazy_env():
    before = LAZY in sys.modules
    __import__(LAZY)
    return Probe(before)


def slow_lazy_env():
    before = LAZY in sys.modules
    __import__(LAZY)
    time.sleep(0.6)
    return Probe(before)


def hostile_env():
    """In the throw-away build (the process that holds no ring memfd): scribbles on
    every fd it inherited and plants names that are no modules."""
    fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    targets = []
    for fd in fds:
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    if not any(t.startswith("/memfd:") for t in targets):
        for fd in range(3, 256):
            with contextlib.suppress(OSError):
                os.write(fd, b"\xff" * 64)
    sys.modules["os; rm -rf /"] = sys
    sys.modules["gym_fork_no_such_module"] = sys
    return lazy_env()


def confinement_env(directory):
    def make():
        with open("/proc/self/status") as f:
            status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
        with open(os.path.join(directory, f"{os.getpid()}-{time.monotonic_ns()}"), "w") as f:
            f.write(status["CapEff"].strip() + " " + status["Seccomp"].strip())
        return lazy_env()

    return make


def built_before(fns, **kwargs) -> list[bool]:
    assert LAZY not in sys.modules  # the controller never imports it
    envs = ForkVectorEnv(fns, envs_per_worker=1, **kwargs)
    try:
        envs.reset(seed=0)
        return list(envs.get_attr("imported_before_build"))
    finally:
        envs.close()


@pytest.mark.slow  # 1.3 s here
def test_sandboxes_find_the_env_modules_imported_by_their_warm_parent():
    assert built_before([lazy_env] * 3) == [True] * 3
    # A later vector env of the same env_fns: imported from the controller's record.
    assert built_before([lazy_env] * 3) == [True] * 3


def test_preimport_off_leaves_imports_to_each_sandbox(monkeypatch):
    monkeypatch.setenv("GYM_FORK_PREIMPORT", "0")
    assert built_before([lazy_env] * 2) == [False] * 2


@pytest.mark.slow  # 1.0 s here
def test_an_env_too_slow_to_build_twice_is_not_waited_for(monkeypatch):
    monkeypatch.setenv("GYM_FORK_PREIMPORT_SECONDS", "0.1")
    assert built_before([slow_lazy_env] * 2) == [False] * 2


def test_a_hostile_throw_away_build_cannot_confuse_the_warm_parent():
    # Its scribbles reach no socket of the controller's; its bogus names are skipped.
    assert built_before([hostile_env] * 2) == [True] * 2
    assert "gym_fork_no_such_module" not in sys.modules


def test_the_throw_away_build_is_confined_like_a_sandbox(tmp_path):
    tmp_path.chmod(0o1777)  # written by sandboxes, which run as an unprivileged uid
    built_before([confinement_env(str(tmp_path))] * 2, private_tmp=False)
    reports = [p.read_text() for p in tmp_path.iterdir()]
    assert len(reports) == 3, reports  # two sandboxes and the throw-away build
    assert all(r == "0000000000000000 2" for r in reports), reports


def script_env(directory: str):
    """Imports a script that sits next to the program (on sys.path, not installed):
    its top-level code records the pid of every process that runs it."""

    def make():
        __import__("gf_user_script")
        return Probe(False)

    return make


def test_a_script_of_the_user_never_runs_in_the_warm_parent(tmp_path, monkeypatch):
    scripts, seen = tmp_path / "scripts", tmp_path / "seen"
    scripts.mkdir()
    seen.mkdir(mode=0o1777)
    seen.chmod(0o1777)  # written by sandboxes, which run as an unprivileged uid
    (scripts / "gf_user_script.py").write_text(
        f"import os\nopen(os.path.join({str(seen)!r}, str(os.getpid())), 'w').close()\n"
    )
    time.sleep(0.1)
    monkeypatch.syspath_prepend(str(scripts))
    envs = ForkVectorEnv([script_env(str(seen))] * 2, envs_per_worker=1, private_tmp=False)
    try:
        envs.reset(seed=0)
    finally:
        envs.close()
        sys.modules.pop("gf_user_script", None)
    pids = {int(p.name) for p in seen.iterdir()}
    assert len(pids) == 3, pids  # the throw-away build and the two sandboxes
    assert 1 not in pids  # never the warm parent (pid 1 of the tree)
