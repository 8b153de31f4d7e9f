"""``probe()``: what NVML says about this host's GPUs, never raising on the default path."""

from __future__ import annotations

import contextlib
import ctypes
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

_NVML_LIBRARY = "libnvidia-ml.so.1"  # the name pynvml loads on Linux


@dataclass(frozen=True)
class GpuProcess:
    """A process holding a compute context on a device (``pid`` as NVML reports it: a
    pid of the host's pid namespace)."""

    pid: int
    used_memory: int | None


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuReport:
    """The host's GPU state; ``nvml`` False means no usable driver, and ``reason`` why."""

    nvml: bool
    reason: str = ""
    driver_version: str | None = None
    cuda_driver_version: int | None = None
    devices: tuple[DeviceInfo, ...] = field(default_factory=tuple)

    def processes_by_pid(self) -> dict[int, list[tuple[DeviceInfo, GpuProcess]]]:
        out: dict[int, list[tuple[DeviceInfo, GpuProcess]]] = {}
        for device in self.devices:
            for proc in device.processes:
                out.setdefault(proc.pid, []).append((device, proc))
        return out

    def provenance(self) -> dict[str, Any] | None:
        """What the baseline id depends on: driver and device identities (no usage)."""
        if not self.nvml:
            return None
        return {
            "driver": self.driver_version,
            "cuda_driver": self.cuda_driver_version,
            "devices": [f"{d.name} {d.uuid}" for d in self.devices],
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# Why NVML's library could not be loaded, once found (a driver installed meanwhile is
# seen by the next process).
_LIBRARY_MISSING = ""


def _missing_library() -> str:
    """Why NVML cannot load here ("" if it may): without its library, importing pynvml
    (~15 ms of class building, every vector env's construction) buys nothing. Where
    pynvml is imported already (or is a test's stand-in) it is asked instead."""
    global _LIBRARY_MISSING
    if "pynvml" in sys.modules or not sys.platform.startswith("linux"):
        return ""
    if _LIBRARY_MISSING:  # a failed dlopen searches every library path: ~0.1 ms a fork
        return _LIBRARY_MISSING
    try:
        ctypes.CDLL(_NVML_LIBRARY)  # what pynvml loads next (and finds loaded)
    except OSError as exc:
        _LIBRARY_MISSING = f"NVML unavailable: {_NVML_LIBRARY} cannot be loaded ({exc})"
        return _LIBRARY_MISSING
    return ""


def probe() -> GpuReport:
    """Query NVML (nvidia-ml-py). Without the package, the library or a device, the
    report says "no GPU" and why; this path raises nothing and takes milliseconds."""
    missing = _missing_library()
    if missing:
        return GpuReport(nvml=False, reason=missing)
    try:
        import pynvml
    except ImportError:
        return GpuReport(nvml=False, reason="nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return GpuReport(nvml=False, reason=f"NVML unavailable: {type(exc).__name__}: {exc}")
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda = int(pynvml.nvmlSystemGetCudaDriverVersion())
        except Exception:
            cuda = None
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception:
                procs = []
            devices.append(
                DeviceInfo(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory_total=int(memory.total),
                    memory_used=int(memory.used),
                    processes=tuple(
                        GpuProcess(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in procs
                    ),
                )
            )
        return GpuReport(
            nvml=True, driver_version=driver, cuda_driver_version=cuda, devices=tuple(devices)
        )
    except Exception as exc:
        return GpuReport(nvml=False, reason=f"NVML query failed: {type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
