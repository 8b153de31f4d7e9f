"""GPU check for an NVIDIA machine: run it there, record its output in docs/gpu.md.

    python3 benchmarks/gpu_check.py          # needs torch (CUDA build) or cuda-python

1. a sandbox that initialises CUDA is refused for fork (ForkUnsafeError, NVML evidence);
2. gpu_fork_policy="clean": a warm parent that initialises CUDA is replaced by clean
   launches, which work;
3. NVML reports per-sandbox GPU memory (envs.stats());
4. clone time from a CPU-only warm parent whose sandboxes initialise CUDA after the fork,
   against a cold start (build env + init CUDA in a fresh process).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.gpu import ForkUnsafeError, probe


class CudaEnv(gym.Env):
    """CartPole-sized env that can hold a CUDA tensor (torch)."""

    def __init__(self, cuda_at_init: bool = False):
        self.observation_space = gym.spaces.Box(-1, 1, (4,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.tensor = None
        if cuda_at_init:
            self.init_cuda()

    def init_cuda(self, mb: int = 64):
        import torch

        self.tensor = torch.zeros(mb * 2**18, device="cuda")
        torch.cuda.synchronize()
        return float(self.tensor.sum())

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        return np.zeros(4, np.float32), 1.0, False, False, {}


def main() -> None:
    report = probe()
    print(
        "probe:",
        report.nvml,
        report.reason or "",
        report.driver_version,
        [f"{d.name} {d.uuid}" for d in report.devices],
    )
    if not report.nvml:
        print("no NVML here: nothing to check")
        return

    # 1 + 3: a sandbox that initialised CUDA is refused for fork, and NVML sees its memory.
    envs = ForkVectorEnv([CudaEnv, CudaEnv], envs_per_worker=1, lineage_log=False)
    envs.reset(seed=0)
    envs.call("init_cuda")
    time.sleep(0.5)
    print("stats (per-sandbox GPU memory):", [(r["index"], r["gpu_memory"]) for r in envs.stats()])
    try:
        envs.fork("must-refuse", indices=[0])
        print("FAIL: fork of a CUDA sandbox was not refused")
    except ForkUnsafeError as exc:
        print("refused as expected:", exc.evidence)
    envs.close()

    # 2: clean fallback for a warm parent with CUDA.
    try:
        ForkVectorEnv.from_parent(lambda: CudaEnv(True), 2, lineage_log=False)
        print("FAIL: a CUDA warm parent was not refused")
    except ForkUnsafeError as exc:
        print("warm parent refused as expected:", exc.evidence[:1])
    envs = ForkVectorEnv.from_parent(
        lambda: CudaEnv(True), 2, gpu_fork_policy="clean", lineage_log=False
    )
    envs.reset(seed=0)
    print(
        "clean launch works:",
        envs.step(np.array([0, 1]))[1],
        [e["event"] for e in envs.lineage.record.events],
    )
    envs.close()

    # 4: CPU-only warm parent, CUDA initialised after the fork, against a cold start.
    envs = ForkVectorEnv.from_parent(CudaEnv, 1, lineage_log=False)
    times = []
    for i in range(10):
        start = time.perf_counter()
        envs.reset(seed=i)  # a fresh clone
        envs.call("init_cuda", 1)
        times.append(time.perf_counter() - start)
    envs.close()
    cold = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; sys.path.insert(0, 'benchmarks');"
                "from gpu_check import CudaEnv; CudaEnv().init_cuda(1)",
            ],
            check=True,
        )
        cold.append(time.perf_counter() - start)
    print(
        f"clone + CUDA init after fork: p50 {statistics.median(times) * 1e3:.1f} ms; "
        f"cold process + CUDA init: p50 {statistics.median(cold) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
