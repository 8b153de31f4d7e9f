"""Which accelerator boots the guest kernel here: KVM where it really works, else TCG.

``/dev/kvm`` existing is not enough: on hosts whose KVM is a paravirtual variant (PVM)
a stock guest kernel never reaches init. So the verdict comes from booting the guest's
own kernel and initramfs under KVM to ``poweroff`` within a deadline, once per
(kernel, QEMU, host kernel), cached. ``GYM_FORK_VM_ACCEL=kvm|tcg`` overrides it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

from gym_fork import knobs
from gym_fork.hosts.microvm.building.image import GuestImage
from gym_fork.hosts.microvm.machine import qemu_binary
from gym_fork.hosts.microvm.paths import cache_root

PROBE_DEADLINE_S = 20.0  # TCG reaches init in ~4 s here; hardware KVM in well under 1 s


def _probe_key(image: GuestImage) -> str:
    binary = qemu_binary() or "none"
    st = os.stat(binary) if binary != "none" else None
    return "|".join(
        [
            str(image.kernel.vmlinuz),
            str(image.initramfs),
            binary,
            str(st.st_mtime_ns if st else 0),
            os.uname().release,
        ]
    )


def probe_kvm(image: GuestImage) -> dict:
    """Boot the guest kernel under KVM to a poweroff; the verdict and why."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return {"kvm": False, "why": "/dev/kvm is missing or not accessible"}
    binary = qemu_binary()
    if binary is None:
        return {"kvm": False, "why": "qemu-system-x86_64 is not installed"}
    started = time.perf_counter()
    args = [
        binary,
        "-accel",
        "kvm",
        "-cpu",
        "host",
        "-M",
        "q35",
        "-m",
        "128M",
        "-nodefaults",
        "-no-reboot",
        "-display",
        "none",
        "-kernel",
        str(image.kernel.vmlinuz),
        "-initrd",
        str(image.initramfs),
        "-append",
        "quiet panic=-1 rdinit=/bin/busybox -- poweroff -f",
    ]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=PROBE_DEADLINE_S)
    except subprocess.TimeoutExpired:
        return {
            "kvm": False,
            "why": f"a guest kernel did not boot under KVM within {PROBE_DEADLINE_S:.0f} s "
            "(a paravirtual KVM such as PVM emulates guest kernel code)",
        }
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        return {"kvm": False, "why": f"QEMU -accel kvm failed: {first[:200]}"}
    # The reason goes into provenance: no timing in it, so that it stays the same.
    return {"kvm": True, "why": "a guest kernel boots under KVM", "probe_s": round(seconds, 2)}


def _verdicts_path():
    return cache_root() / "accel.json"


def cached_verdict(image: GuestImage) -> dict | None:
    """The cached probe verdict for ``image`` (``None``: not probed yet); reads only."""
    try:
        cached = json.loads(_verdicts_path().read_text())
    except (OSError, ValueError):
        return None
    verdict = cached.get(_probe_key(image)) if isinstance(cached, dict) else None
    return verdict if isinstance(verdict, dict) and "kvm" in verdict else None


def choose_accel(image: GuestImage) -> tuple[str, str]:
    """``("kvm" | "tcg", reason)``: forced by GYM_FORK_VM_ACCEL, else the cached probe."""
    forced = knobs.given("GYM_FORK_VM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced, "GYM_FORK_VM_ACCEL"
    verdict = cached_verdict(image)
    if verdict is None:
        verdict = probe_kvm(image)
        path = _verdicts_path()
        try:
            cached = json.loads(path.read_text())
        except (OSError, ValueError):
            cached = {}
        if not isinstance(cached, dict):
            cached = {}
        cached[_probe_key(image)] = verdict
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return ("kvm" if verdict["kvm"] else "tcg"), verdict["why"]
