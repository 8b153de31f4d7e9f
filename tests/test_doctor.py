"""``gym-fork doctor`` only looks: it writes nothing under the cache, prints a JSON report
with a stable schema, and takes seconds (the deadline here is generous: the measured
speed is in docs/microvm.md). ``gym-fork image show`` plans without building;
``gym-fork image clear-cache`` removes images and says how much it freed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gym_fork import doctor
from gym_fork.hosts.microvm.building.kernel import KernelNotFound, find_kernel
from tests.helpers import why_no_frozen_layers

# Measured ~2 s here (2 cores); a machine 3x slower and a loaded CI runner stay well
# inside this. It is a hang guard, not a speed assertion.
DEADLINE_S = 60.0


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and mtime."""
    found = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        found[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return found


def _run_doctor(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "gym_fork", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
    )
    return done, time.monotonic() - started


def _isolated_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("GYM_FORK_") and k not in ("XDG_CACHE_HOME", "HOME")
    }
    env["HOME"] = str(tmp_path / "home")
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    (tmp_path / "home").mkdir()
    return env


def test_doctor_writes_nothing_under_a_fresh_home_and_its_json_parses(tmp_path):
    env = _isolated_env(tmp_path)
    done, seconds = _run_doctor(env, "--json")
    assert done.returncode in (0, 1), done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["schema"] == doctor.SCHEMA
    assert report["ok"] is (done.returncode == 0)
    names = [c["name"] for c in report["checks"]]
    assert len(names) == len(set(names)) and {"python", "microvm", "cache"} <= set(names)
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail", "required", "data"}, check
        assert check["status"] in doctor.STATUSES, check
        assert isinstance(check["required"], bool) and isinstance(check["data"], dict)
        assert check["detail"], check
    assert not (tmp_path / "xdg").exists(), "doctor created the XDG cache"
    assert _tree(tmp_path / "home") == {".": _tree(tmp_path / "home")["."]}
    assert seconds < DEADLINE_S


@pytest.mark.slow  # 2.0 s here
def test_doctor_reports_what_an_image_would_cost_without_building_it(tmp_path):
    """With a kernel and an existing cache (an image and a boot template of an older
    environment in it): the image is planned, not built, and nothing in the cache changes
    (not even an mtime)."""
    try:
        kernel = find_kernel()
    except KernelNotFound as exc:
        pytest.skip(f"no guest kernel here to plan an image with: {exc}")
    env = _isolated_env(tmp_path)
    cache = tmp_path / "cache"
    old = cache / "images" / "0123456789abcdef0123"
    old.mkdir(parents=True)
    (old / "image.json").write_text(json.dumps({"files": 1, "root_bytes": 4096}))
    (old / "root.erofs").write_bytes(b"\0" * 4096)
    (cache / "boot-templates").mkdir()
    (cache / "boot-templates" / f"{old.name}-x.boot").write_bytes(b"template")
    past = time.time() - 3600
    for path in [cache, *cache.rglob("*")]:
        os.utime(path, (past, past))
    before = _tree(cache)
    env.update(
        GYM_FORK_CACHE=str(cache),
        GYM_FORK_VM_KERNEL=str(kernel.vmlinuz),
        GYM_FORK_VM_MODULES=str(kernel.modules),
    )
    done, _ = _run_doctor(env, "--json")
    assert done.returncode in (0, 1), done.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert _tree(cache) == before, "doctor changed the cache"
    microvm, cache_check = checks["microvm"], checks["cache"]
    if microvm["status"] == "missing":
        pytest.skip(f"the microVM host cannot run here: {microvm['detail']}")
    data = microvm["data"]
    assert data["image_cached"] is False and data["image"] != old.name
    assert data["packed_bytes"] > 1 << 20 and data["files"] > 100
    assert data["build_estimate_s"] > 0 and "gymnasium" in data["distributions"]
    assert "no image yet" in microvm["detail"] and "MiB" in microvm["detail"]
    assert cache_check["data"]["images"] == 1


def test_the_text_report_and_exit_status_follow_the_required_checks(monkeypatch, capsys):
    results = [
        doctor.Check("python", "ok", "3.11", required=True),
        doctor.Check("kvm", "missing", "no /dev/kvm"),
    ]
    monkeypatch.setattr(doctor, "checks", lambda: list(results))
    assert doctor.run() == 0
    out = capsys.readouterr().out
    assert "kvm" in out and "no /dev/kvm" in out and "can run here" in out
    results.append(doctor.Check("C ring", "missing", "not built", required=True))
    assert doctor.run() == 1
    assert "cannot run here: C ring" in capsys.readouterr().out
    assert doctor.run(as_json=True) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False and [c["name"] for c in report["checks"]][-1] == "C ring"


def test_image_clear_cache_removes_images_and_says_how_much_it_freed(tmp_path, capsys, monkeypatch):
    from gym_fork.cli import main

    cache = tmp_path / "cache"
    image = cache / "images" / "0123456789abcdef0123"
    image.mkdir(parents=True)
    (image / "image.json").write_text("{}")
    (image / "root.erofs").write_bytes(b"x" * (3 << 20))
    past = time.time() - 3600
    os.utime(image, (past, past))
    (cache / "boot-templates").mkdir()
    (cache / "boot-templates" / f"{image.name}-x.boot").write_bytes(b"t" * (1 << 20))
    monkeypatch.setenv("GYM_FORK_CACHE", str(cache))
    monkeypatch.delenv("GYM_FORK_VM_BOOT_CACHE", raising=False)
    assert main(["image", "clear-cache"]) == 0
    out = capsys.readouterr().out
    assert "removed 1 guest image(s) and 1 boot template file(s): 4 MiB freed" in out, out
    assert list((cache / "images").iterdir()) == []


@pytest.mark.slow  # 1.7 s here
def test_image_show_plans_without_building(tmp_path):
    try:
        kernel = find_kernel()
    except KernelNotFound as exc:
        pytest.skip(f"no guest kernel here to plan an image with: {exc}")
    env = _isolated_env(tmp_path)
    env.update(
        GYM_FORK_CACHE=str(tmp_path / "cache"),
        GYM_FORK_VM_KERNEL=str(kernel.vmlinuz),
        GYM_FORK_VM_MODULES=str(kernel.modules),
    )
    done = subprocess.run(
        [sys.executable, "-m", "gym_fork", "image", "show"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "not built" in done.stdout and "gymnasium" in done.stdout, done.stdout
    assert not (tmp_path / "cache").exists()


def test_the_tmp_layers_line_says_why_a_fork_copies(monkeypatch):
    monkeypatch.setenv("GYM_FORK_TMP_LAYERS", "0")
    line = doctor._tmp_layers()
    assert line.status == "degraded" and "GYM_FORK_TMP_LAYERS=0" in line.detail
    monkeypatch.delenv("GYM_FORK_TMP_LAYERS")
    line = doctor._tmp_layers()
    assert line.status == ("degraded" if why_no_frozen_layers() else "ok"), line
