"""``gym-fork doctor``: what this host supports and what gym_fork will use.

It only looks: no guest image is built, no accelerator probed, nothing written under
the cache (where the microVM host would build something, the check says what it would
cost). ``--json`` prints :data:`SCHEMA`: ``{"schema", "gym_fork", "ok", "checks": [{"name",
"status", "detail", "required", "data"}]}``, status one of ``ok``, ``degraded``,
``missing``; ``data`` holds the figures behind the detail (may be empty).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from gym_fork import knobs

SCHEMA = "gym_fork.doctor/1"
STATUSES = ("ok", "degraded", "missing")


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    status: str  # one of STATUSES
    detail: str
    required: bool = False  # the default configuration cannot run without it
    data: dict[str, Any] = field(default_factory=dict)


def _probe_namespaces() -> Check:
    code = (
        "import os, sys\n"
        "from gym_fork.system import namespaces as ns\n"
        "done = []\n"
        "for name, flag in [('mount', ns.CLONE_NEWNS), ('ipc', ns.CLONE_NEWIPC),"
        " ('uts', ns.CLONE_NEWUTS), ('net', ns.CLONE_NEWNET), ('pid', ns.CLONE_NEWPID)]:\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            ns.unshare(flag); os._exit(0)\n"
        "        except OSError:\n"
        "            os._exit(1)\n"
        "    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0: done.append(name)\n"
        "print(' '.join(done))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    have = out.stdout.split()
    wanted = ["mount", "ipc", "uts", "net"]
    missing = [n for n in wanted if n not in have]
    detail = f"unshare works for: {', '.join(have) or 'none'}"
    if not missing:
        return Check(
            "namespaces",
            "ok",
            detail + " (a pid namespace per tree, the warm parent its init)",
        )
    return Check(
        "namespaces",
        "degraded",
        f"{detail}; missing {', '.join(missing)}: sandboxes "
        "run without those layers (needs root or unprivileged user namespaces)",
    )


def _cgroups() -> Check:
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return Check(
            "cgroups", "ok", "v2 present: memory and process limits use cgroups and rlimits"
        )
    if os.path.isdir("/sys/fs/cgroup/memory"):
        return Check(
            "cgroups", "ok", "v1 present: memory and process limits use cgroups and rlimits"
        )
    return Check("cgroups", "missing", "no cgroup filesystem; limits use rlimits")


def _shared_memory() -> Check:
    try:
        fd = os.memfd_create("gym_fork-doctor", os.MFD_CLOEXEC)
        os.close(fd)
    except (OSError, AttributeError) as exc:
        return Check("shared memory", "missing", f"memfd_create failed: {exc}", required=True)
    shm = shutil.disk_usage("/dev/shm").total if os.path.isdir("/dev/shm") else 0
    return Check(
        "shared memory",
        "ok",
        f"memfd works (rings and slabs); /dev/shm {shm / 2**30:.1f} GiB (not used by gym_fork)",
        required=True,
    )


def _ring() -> Check:
    try:
        from gym_fork.transport.channel import Channel

        channel = Channel.create("doctor", 4096)
        channel.close()
    except Exception as exc:
        return Check("C ring", "missing", f"{exc} (reinstall: pip install -e .)", required=True)
    return Check("C ring", "ok", "compiled cffi extension gym_fork._ring loads", required=True)


def _kvm() -> Check:
    if not os.path.exists("/dev/kvm"):
        return Check("kvm", "missing", "no /dev/kvm: a microVM host would use TCG emulation")
    pvm = os.path.isdir("/sys/module/kvm_pvm")
    if pvm:
        return Check(
            "kvm",
            "degraded",
            "/dev/kvm is PVM (paravirtual, nested): stock guest "
            "kernels do not boot under it; a microVM host would use TCG",
        )
    return Check("kvm", "ok", "/dev/kvm present (hardware virtualization)")


def _qemu() -> Check:
    path = shutil.which("qemu-system-x86_64")
    if path:
        return Check("qemu", "ok", path)
    return Check(
        "qemu", "missing", "qemu-system-x86_64 not found (apt-get install qemu-system-x86)"
    )


def _microvm() -> Check:
    from gym_fork.hosts.microvm.requirements import INSTALL_HINT, missing_requirements

    missing = missing_requirements()
    if missing:
        return Check(
            "microvm", "missing", f"host='microvm' needs {'; '.join(missing)}: {INSTALL_HINT}"
        )
    from gym_fork.hosts.microvm.building.image import plan_image

    try:
        plan = plan_image()
    except Exception as exc:
        return Check("microvm", "missing", f"a guest image cannot be planned: {exc}")
    data: dict[str, Any] = {
        "kernel": plan.kernel.version,
        "image": plan.digest,
        "image_cached": plan.cached,
        "files": plan.files,
        "packed_bytes": plan.packed_bytes,
        "distributions": list(plan.selection.distributions),
    }
    size = f"{plan.files} files, {plan.packed_bytes / 2**20:.0f} MiB"
    if plan.cached:
        image_part = f"image {plan.digest} cached ({size})"
    else:
        estimate = plan.estimate_s()
        data["build_estimate_s"] = round(estimate, 1)
        image_part = (
            f"no image yet: the first microVM env packs {size} "
            f"({len(plan.selection.distributions) or 'all'} distributions) in ~{estimate:.0f} s"
        )
    if not _boot_template_cached(plan.digest):
        image_part += ", then boots it once (~15-50 s under TCG, ~1 s under KVM)"
    accel, why = _accelerator(plan.guest_image())
    data["accelerator"] = accel
    return Check(
        "microvm",
        "degraded" if accel == "tcg" else "ok",
        f"kernel {plan.kernel.version}; {image_part}; accelerator {accel}: {why}",
        data=data,
    )


def _boot_template_cached(digest: str) -> bool:
    from gym_fork.hosts.microvm import template_cache

    directory = template_cache.cache_dir()
    return template_cache.enabled() and any(directory.glob(f"{digest}-*{template_cache.SUFFIX}"))


def _accelerator(image) -> tuple[str, str]:
    """What the host would choose, from the cached verdict only (the probe boots a VM)."""
    from gym_fork.hosts.microvm.accel import cached_verdict

    forced = knobs.given("GYM_FORK_VM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced, "GYM_FORK_VM_ACCEL"
    verdict = cached_verdict(image)
    if verdict is not None:
        return ("kvm" if verdict["kvm"] else "tcg"), verdict["why"]
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg", "/dev/kvm is missing or not accessible"
    return "unknown", (
        "not probed yet: the first microVM env boots the guest kernel under KVM once "
        "(up to 20 s) and keeps the verdict"
    )


def _cache() -> Check:
    from gym_fork.hosts.microvm import template_cache
    from gym_fork.hosts.microvm.building import image_cache
    from gym_fork.hosts.microvm.paths import cache_root

    images = image_cache.images_by_use()
    image_bytes = sum(image_cache.disk_bytes(p) for p in images)
    boot_bytes = image_cache.disk_bytes(template_cache.cache_dir())
    kernel_bytes = image_cache.disk_bytes(cache_root() / "kernels")
    try:
        bound = image_cache.bound_bytes()
    except ValueError as exc:
        return Check("cache", "degraded", str(exc))
    detail = (
        f"{cache_root()}: {len(images)} image(s) {image_bytes / 2**30:.2f} GiB "
        f"(bound {bound / 2**30:.1f} GiB, GYM_FORK_VM_IMAGE_CACHE_MB), boot templates "
        f"{boot_bytes / 2**30:.2f} GiB, kernels {kernel_bytes / 2**30:.2f} GiB; "
        "`gym-fork image clear-cache` removes images and boot templates"
    )
    data = {
        "path": str(cache_root()),
        "images": len(images),
        "image_bytes": image_bytes,
        "bound_bytes": bound,
        "boot_template_bytes": boot_bytes,
        "kernel_bytes": kernel_bytes,
    }
    return Check("cache", "ok", detail, data=data)


def _gpu() -> Check:
    from gym_fork.gpu import probe

    report = probe()
    if not report.nvml:
        return Check("gpu", "missing", f"no GPU: {report.reason} (CUDA-fork checks still run)")
    devices = ", ".join(f"{d.index}: {d.name}" for d in report.devices) or "no devices"
    return Check(
        "gpu",
        "ok",
        f"NVML driver {report.driver_version}, CUDA driver {report.cuda_driver_version}; {devices}",
    )


def _python() -> Check:
    ok = sys.version_info >= (3, 11)
    return Check("python", "ok" if ok else "missing", sys.version.split()[0], required=True)


def _tmp_layers() -> Check:
    from gym_fork.hosts.process.layers import TmpLayers
    from gym_fork.system.isolation import IsolationConfig

    why = TmpLayers(IsolationConfig()).off
    if why:
        return Check("tmp layers", "degraded", f"a fork copies a sandbox's /tmp writes: {why}")
    return Check("tmp layers", "ok", "a fork freezes a sandbox's /tmp writes into a shared layer")


def checks() -> list[Check]:
    """Every check, in the order they are printed."""
    return [
        _python(),
        _ring(),
        _shared_memory(),
        _probe_namespaces(),
        _cgroups(),
        _tmp_layers(),
        _kvm(),
        _qemu(),
        _microvm(),
        _cache(),
        _gpu(),
    ]


def report(results: list[Check]) -> dict[str, Any]:
    """The ``--json`` document for ``results``."""
    from gym_fork._version import __version__

    return {
        "schema": SCHEMA,
        "gym_fork": __version__,
        "ok": not _failed(results),
        "checks": [asdict(c) for c in results],
    }


def _failed(results: list[Check]) -> list[Check]:
    return [c for c in results if c.required and c.status != "ok"]


def run(*, as_json: bool = False) -> int:
    """Print one line per check (or the JSON report); exit status 1 only if the
    default configuration cannot run (a required check is not ok)."""
    results = checks()
    failed = _failed(results)
    if as_json:
        print(json.dumps(report(results), indent=1))
        return 1 if failed else 0
    width = max(len(c.name) for c in results)
    for c in results:
        print(f"{c.name:<{width}}  {c.status:<8}  {c.detail}")
    if failed:
        print(f"\ngym_fork cannot run here: {', '.join(c.name for c in failed)}")
        return 1
    print("\ngym_fork can run here with its defaults.")
    return 0
