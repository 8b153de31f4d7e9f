"""Does a process hold a CUDA context? Evidence gathered before any fork.

CUDA does not survive fork(): a child of a process with a CUDA context has undefined
behaviour. Evidence, strongest first: the process is among NVML's compute processes
(NVML reports host pid-namespace pids, so a sandbox's pid is first mapped to the host's
through /proc/PID/status NSpid), it has the CUDA driver library (libcuda.so) mapped, or
it has /dev/nvidia* device files open.
"""

from __future__ import annotations

import os

from gym_fork.errors import GymForkError

from .probe import GpuReport


class ForkUnsafeError(GymForkError):
    """A sandbox about to be forked holds (or shows signs of) a CUDA context."""

    code = "fork_unsafe"

    def __init__(self, message: str, *, pid: int, evidence: list[str]) -> None:
        super().__init__(message)
        self.pid = pid
        self.evidence = evidence


def host_pid(pid: int, proc: str = "/proc") -> int:
    """The pid of ``pid`` in the outermost pid namespace visible here (NSpid's first)."""
    try:
        with open(f"{proc}/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return pid


def cuda_evidence(pid: int, report: GpuReport | None, proc: str = "/proc") -> list[str]:
    """Reasons to believe ``pid`` holds a CUDA context (empty: none found).

    A context shows as an NVML compute process or an open /dev/nvidia* device. A mapped
    libcuda alone is not one (``import torch`` maps it without creating a context, seen
    on an H200: a warm parent that pre-imports torch is safe to fork), so it is only
    quoted next to real evidence."""
    evidence = []
    if report is not None and report.nvml:
        outer = host_pid(pid, proc)
        for device, process in report.processes_by_pid().get(outer, []):
            used = process.used_memory
            evidence.append(
                f"NVML lists pid {outer} as a compute process on GPU {device.index} "
                f"({device.name}, {used if used is not None else '?'} bytes)"
            )
    try:
        fd_dir = f"{proc}/{pid}/fd"
        devices = set()
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                devices.add(target)
        evidence += [f"has {dev} open" for dev in sorted(devices)]
    except OSError:
        pass
    if not evidence:
        return []  # the maps (hundreds of lines per sandbox) only matter next to evidence
    try:
        with open(f"{proc}/{pid}/maps") as f:
            libs = {line.split()[-1] for line in f if "libcuda.so" in line}
    except OSError:
        libs = set()
    return evidence + [f"maps the CUDA driver library {lib}" for lib in sorted(libs)]
