"""GPU awareness without a GPU: the no-NVML path for real, the rest with a fake NVML at
the pynvml function boundary."""

from __future__ import annotations

import subprocess
import sys
import time
import types

import gymnasium as gym
import numpy as np
import pytest

from gym_fork import ForkVectorEnv
from gym_fork.gpu import ForkUnsafeError, cuda_evidence, host_pid, probe


def test_probe_without_a_driver_says_no_gpu_fast_and_raises_nothing():
    start = time.perf_counter()
    report = probe()
    assert time.perf_counter() - start < 2.0
    if report.nvml:
        pytest.skip("this host has a working NVML driver; the no-GPU path is not reachable")
    assert report.reason and report.devices == () and report.provenance() is None


class FakeNVML(types.ModuleType):
    """The pynvml functions gym_fork calls, answering for one device."""

    def __init__(self, compute_pids):
        super().__init__("pynvml")
        self.compute_pids = compute_pids

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlDeviceGetCount(self):
        return 1

    def nvmlDeviceGetHandleByIndex(self, index):
        return ("handle", index)

    def nvmlDeviceGetName(self, handle):
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, handle):
        return "GPU-0f1e2d3c"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=141 << 30, used=5 << 30)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return [types.SimpleNamespace(pid=p, usedGpuMemory=512 << 20) for p in self.compute_pids]


@pytest.fixture
def fake_nvml(monkeypatch):
    fake = FakeNVML([])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_probe_reports_devices_processes_and_provenance(fake_nvml):
    fake_nvml.compute_pids[:] = [4242]
    report = probe()
    assert report.nvml and report.driver_version == "550.54.15"
    assert report.cuda_driver_version == 12040
    (device,) = report.devices
    assert device.name == "NVIDIA H200" and device.uuid == "GPU-0f1e2d3c"
    assert device.processes[0].pid == 4242 and device.processes[0].used_memory == 512 << 20
    assert report.provenance()["devices"] == ["NVIDIA H200 GPU-0f1e2d3c"]


def test_namespace_pids_are_mapped_to_host_pids_for_nvml(tmp_path, fake_nvml):
    # A sandbox in a pid namespace: pid 7 inside, 4242 on the host (NSpid: outer first).
    proc = tmp_path / "proc"
    (proc / "7" / "fd").mkdir(parents=True)
    (proc / "7" / "status").write_text("Name:\tpython\nNSpid:\t4242\t7\n")
    (proc / "7" / "maps").write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcuda.so.550.54\n")
    assert host_pid(7, str(proc)) == 4242
    fake_nvml.compute_pids[:] = [4242]
    evidence = cuda_evidence(7, probe(), str(proc))
    assert any("NVML lists pid 4242" in e for e in evidence)
    assert any("libcuda.so" in e for e in evidence)


def test_a_mapped_cuda_library_alone_is_not_a_context(tmp_path, fake_nvml):
    # `import torch` maps libcuda without creating a context (seen on an H200): such a
    # warm parent is safe to fork; an open /dev/nvidia* device is a context.
    proc = tmp_path / "proc"
    (proc / "9" / "fd").mkdir(parents=True)
    (proc / "9" / "status").write_text("Name:\tpython\nNSpid:\t9\n")
    (proc / "9" / "maps").write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libcuda.so.580.1\n")
    assert cuda_evidence(9, probe(), str(proc)) == []
    (proc / "9" / "fd" / "5").symlink_to("/dev/nvidiactl")
    evidence = cuda_evidence(9, probe(), str(proc))
    assert evidence[0] == "has /dev/nvidiactl open" and "libcuda.so" in evidence[1]


def cartpole():
    return gym.make("CartPole-v1")


def test_fork_of_a_sandbox_listed_by_nvml_is_refused_with_the_evidence(fake_nvml):
    envs = ForkVectorEnv([cartpole] * 2, envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        victim = envs.worker_pids[1]
        fake_nvml.compute_pids[:] = [victim]
        with pytest.raises(ForkUnsafeError, match=f"pid {victim}") as info:
            envs.fork("gpu-branch", indices=[1])
        assert info.value.pid == victim and "NVML lists" in info.value.evidence[0]
        branch = envs.fork("cpu-branch", indices=[0])  # a clean sandbox still forks
        assert branch.lineage.record.gpu_memory_created == 0
        fake_nvml.compute_pids[:] = [victim, branch.worker_pids[0]]
        branch.close()
        assert branch.lineage.record.gpu_memory_closed == 512 << 20
        gpu = [row["gpu_memory"] for row in envs.stats()]
        assert gpu == [None, 512 << 20]
    finally:
        envs.close()


class _ListsTheWarmParent(FakeNVML):
    """Lists every process below the test process: the warm parent among them (it is a
    grandchild: pid 1 of its tree's pid namespace, below the process that made it)."""

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        from tests.helpers import descendants

        return [types.SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in descendants()]


def test_a_warm_parent_holding_cuda_is_refused_or_replaced_by_a_clean_launch(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", _ListsTheWarmParent([]))
    with pytest.raises(ForkUnsafeError, match="warm parent"):
        ForkVectorEnv.from_parent(cartpole, 2, lineage_log=False)
    log = tmp_path / "lineage.jsonl"
    envs = ForkVectorEnv.from_parent(cartpole, 2, gpu_fork_policy="clean", lineage_log=log)
    try:
        monkeypatch.setitem(sys.modules, "pynvml", FakeNVML([]))
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (2, 4)
        envs.step(np.array([0, 1]))
        events = [e["event"] for e in envs.lineage.record.events]
        assert "clean_launch" in events
        assert envs.lineage.tree.inputs["gpu"]["driver"] == "550.54.15"
    finally:
        envs.close()


def test_stats_report_memory_per_sub_env():
    envs = ForkVectorEnv([cartpole] * 3, envs_per_worker=1, lineage_log=False)
    try:
        rows = envs.stats()
        assert [r["index"] for r in rows] == [0, 1, 2]
        assert all(r["rss"] > 0 and 0 < r["pss"] <= r["rss"] for r in rows)
    finally:
        envs.close()


@pytest.mark.slow  # 2.0 s here
def test_doctor_reports_every_layer_and_exits_zero_here():
    out = subprocess.run(
        [sys.executable, "-m", "gym_fork", "doctor"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    layers = ("python", "C", "shared", "namespaces", "cgroups", "kvm", "qemu", "microvm", "gpu")
    checks = [line for line in out.stdout.splitlines() if line.split()[:1] and line[0] != " "]
    checks = [line for line in checks if line.split()[0] in layers]
    assert [line.split()[0] for line in checks] == list(layers)  # each once, in order
    for line in checks:
        assert line.split()[-1] and any(s in line for s in (" ok ", " missing ", " degraded "))
