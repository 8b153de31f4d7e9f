"""GPU awareness: NVML probe, CUDA-context detection before fork, per-sandbox GPU memory."""

from gym_fork.gpu.cuda import ForkUnsafeError, cuda_evidence, host_pid
from gym_fork.gpu.probe import DeviceInfo, GpuProcess, GpuReport, probe

__all__ = [
    "DeviceInfo",
    "ForkUnsafeError",
    "GpuProcess",
    "GpuReport",
    "cuda_evidence",
    "host_pid",
    "probe",
]
