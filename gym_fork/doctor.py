"""``gym-fork doctor``: what this host supports and what gym_fork will use."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass


@dataclass
class Check:
    name: str
    status: str  # "ok" | "missing" | "degraded"
    detail: str
    required: bool = False  # the default configuration cannot run without it


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
    from gym_fork.hosts.microvm.accel import choose_accel
    from gym_fork.hosts.microvm.image import build_image

    try:
        image = build_image()
    except Exception as exc:
        return Check("microvm", "missing", f"the guest image cannot be built: {exc}")
    accel, why = choose_accel(image)
    return Check(
        "microvm",
        "ok" if accel == "kvm" else "degraded",
        f"kernel {image.kernel.version}, image {image.digest} ({image.files} files, "
        f"{image.root_bytes >> 20} MiB); accelerator {accel}: {why}",
    )


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


def checks() -> list[Check]:
    return [
        _python(),
        _ring(),
        _shared_memory(),
        _probe_namespaces(),
        _cgroups(),
        _kvm(),
        _qemu(),
        _microvm(),
        _gpu(),
    ]


def run() -> int:
    """Print one line per check; exit status 1 only if the default configuration cannot
    run (a required check is not ok)."""
    results = checks()
    width = max(len(c.name) for c in results)
    for c in results:
        print(f"{c.name:<{width}}  {c.status:<8}  {c.detail}")
    failed = [c for c in results if c.required and c.status != "ok"]
    if failed:
        print(f"\ngym_fork cannot run here: {', '.join(c.name for c in failed)}")
        return 1
    print("\ngym_fork can run here with its defaults.")
    return 0
