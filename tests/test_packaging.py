"""The package as a packager ships it: sdist and wheel from ``python -m build``, the wheel
installed into a fresh venv away from the source tree, and its commands run from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds an sdist and a wheel, installs one in a fresh venv

ROOT = Path(__file__).resolve().parents[1]
OFFLINE = ("--no-deps", "--no-index", "-q")

pytest.importorskip("build", reason="needs the `build` package (the test extra has it)")


def _copy_of_the_tree(target: Path) -> Path:
    """The files git tracks (or, outside a checkout, the tree without build outputs),
    copied: building writes its egg-info and build/ into the source, which must not
    change under the suite (the microVM image packs the working directory)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, timeout=60
    )
    if listed.returncode != 0:
        skip = shutil.ignore_patterns(".venv", "build", "dist", "*.egg-info", "__pycache__")
        shutil.copytree(ROOT, target, ignore=skip)
        return target
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = ROOT / name
        if path.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / name)
    return target


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    source = _copy_of_the_tree(tmp_path_factory.mktemp("source") / "gym_fork")
    # --no-isolation: the build requirements are those of this venv (no index needed);
    # the wheel is built from the sdist, so a file missing from the sdist fails here.
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_sdist_holds_what_building_needs_and_the_wheel_is_abi3(dist):
    (sdist,) = dist.glob("gym_fork-*.tar.gz")
    (wheel,) = dist.glob("gym_fork-*.whl")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"ext/build_ring.py", "ext/gf_ring.c", "ext/gf_ring.h", "LICENSE"} <= names
    assert {"CHANGELOG.md", "gym_fork/py.typed", "README.md"} <= names
    # no test file cut off from its conftest and helpers (setuptools adds tests/test*.py)
    assert not [n for n in names if n.startswith("tests/")], sorted(names)
    assert "-cp311-abi3-" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as zipped:
        inside = zipped.namelist()
        metadata = zipped.read(next(n for n in inside if n.endswith(".dist-info/METADATA")))
    assert "gym_fork/py.typed" in inside
    assert any(n.startswith("gym_fork/_ring") and n.endswith(".abi3.so") for n in inside)
    text = metadata.decode()
    import gym_fork

    assert f"Version: {gym_fork.__version__}" in text
    assert "License-Expression: MIT" in text and "Classifier: Typing :: Typed" in text


def test_the_wheel_installed_in_a_fresh_venv_runs_the_demo(dist, tmp_path):
    (wheel,) = dist.glob("gym_fork-*.whl")
    venv = tmp_path / "venv"
    # No pip of its own (ensurepip takes ~10 s): this venv's pip installs into it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    # Dependencies come from this venv's site-packages, appended after the fresh venv's
    # own (a .pth line is a path, not a site dir: this venv's editable gym_fork finder is
    # not activated), so the gym_fork imported is the installed wheel's.
    fresh_site = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True,
    ).strip()
    Path(fresh_site, "deps_from_test_venv.pth").write_text(sysconfig.get_paths()["purelib"])
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", *OFFLINE, str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    where = subprocess.run(
        [str(python), "-c", "import gym_fork, os; print(os.path.dirname(gym_fork.__file__))"],
        **run,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.strip().startswith(fresh_site), where.stdout  # not the source tree
    version = subprocess.run([str(venv / "bin" / "gym-fork"), "--version"], **run)
    import gym_fork

    assert version.returncode == 0 and version.stdout.strip() == f"gym-fork {gym_fork.__version__}"
    demo = subprocess.run([str(venv / "bin" / "gym-fork"), "demo"], **run)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "ForkVectorEnv" in demo.stdout
    # why a 5 us env is faster in-process, and where ForkVectorEnv wins, from the same run
    assert "CartPole's step is ~5 us" in demo.stdout or "Even at CartPole's" in demo.stdout
    assert "With 1 ms of work per step" in demo.stdout and "x Sync" in demo.stdout
