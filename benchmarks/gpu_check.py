"""GPU check for an NVIDIA machine: run it there, record its output in docs/gpu.md.

    python3 benchmarks/gpu_check.py          # needs torch (CUDA build) and nvidia-ml-py
    python3 benchmarks/gpu_check.py --cpu    # plumbing only, no GPU: checks 1-3 must FAIL

1. a sandbox that initialises CUDA is refused for fork (ForkUnsafeError, NVML evidence),
   while a fork of a CPU-only sandbox works;
2. gpu_fork_policy="clean": a warm parent that initialises CUDA is refused by default and
   replaced by clean launches with "clean", which work;
3. NVML reports per-sandbox GPU memory (envs.stats());
4. clone time from a CPU-only warm parent whose sandboxes initialise CUDA after the fork,
   against a cold start (build env + init CUDA in a fresh process); 4b: the same with a
   warm parent that imported torch but made no CUDA context (on the H200 it was refused:
   `import torch` maps libcuda.so, see docs/gpu.md).

Each check prints ``CHECK n ...: PASS`` or ``FAIL`` (with the traceback) and the others
still run; the exit status is 1 when any check failed. If a check raises under the
default isolation (a kernel without a layer gym_fork uses, such as gVisor), the exception
(other than ForkUnsafeError, a verdict) is printed and that check runs again with
``namespaces=False``, kept for the later checks if that run raised nothing.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.gpu import ForkUnsafeError, probe

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
TIMEOUT = 90.0  # seconds any one call may take (bounds construction too)
CLONE_BUDGET = 60.0  # seconds for check 4's clones (at least 3, at most 10)


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

        self.tensor = torch.ones(mb * 2**18, device=DEVICE)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return float(self.tensor.sum())  # mb * 2**18 when the device computed it

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(4, np.float32), {}

    def step(self, action):
        return np.zeros(4, np.float32), 1.0, False, False, {}


def import_torch(env) -> None:
    """A warmup that imports torch without creating a CUDA context (lazy init)."""
    import torch  # noqa: F401


def environment() -> None:
    print("python:", sys.version.split()[0], sys.executable)
    print("kernel:", platform.uname().release, platform.machine())
    try:
        import torch

        cuda = torch.cuda.is_available()
        print(
            "torch:",
            torch.__version__,
            "cuda available:",
            cuda,
            torch.cuda.get_device_name(0) if cuda else "",
        )
    except Exception as exc:  # torch missing or broken: the checks will say so
        print("torch: unavailable:", type(exc).__name__, exc)


def nvml_processes() -> str:
    """NVML's compute processes, read directly (probe() hides a failing query)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    out.append(f"GPU {i}: " + str([(p.pid, p.usedGpuMemory) for p in procs]))
                except Exception as exc:
                    out.append(f"GPU {i}: query failed: {type(exc).__name__}: {exc}")
            return "; ".join(out)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:
        return f"NVML failed: {type(exc).__name__}: {exc}"


class Run:
    def __init__(self) -> None:
        self.options: dict = {"lineage_log": False, "timeout": TIMEOUT}
        self.fallback: str | None = None
        self.results: dict[str, bool] = {}

    def vector(self, *args, parent: bool = False, **kwargs) -> ForkVectorEnv:
        make = ForkVectorEnv.from_parent if parent else ForkVectorEnv
        return make(*args, **self.options, **kwargs)

    def check(self, name: str, fn) -> None:
        """Run one check; if it raises under the default isolation (an exception other
        than ForkUnsafeError, e.g. a layer this kernel lacks), print why and run it again
        with namespaces=False, which the later checks keep if that run raised nothing."""
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as exc:
            ok, detail = False, f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            if "namespaces" not in self.options and not isinstance(exc, ForkUnsafeError):
                print(f"CHECK {name}: raised under the default isolation: {detail}")
                print("  retrying with namespaces=False (every namespace layer declined)")
                self.options["namespaces"] = False
                try:
                    ok, detail = fn()
                    self.fallback = f"check {name!r} raised {type(exc).__name__}: {exc}"
                    detail += " [with namespaces=False]"
                except Exception as again:
                    ok, detail = False, f"{type(again).__name__}: {again} (namespaces=False)"
                    traceback.print_exc()
                    del self.options["namespaces"]
        took = time.perf_counter() - start
        self.results[name] = ok
        print(f"CHECK {name}: {'PASS' if ok else 'FAIL'} ({took:.1f} s) {detail}", flush=True)

    # -- 1 + 3 -----------------------------------------------------------------------
    def refuse_and_stats(self):
        envs = self.vector([CudaEnv, CudaEnv], envs_per_worker=1)
        try:
            print("isolation:", envs.isolation)
            envs.reset(seed=0)
            branch = envs.fork("cpu-ok", indices=[0])  # no CUDA yet: fork must work
            branch.reset(seed=1)
            branch.step(np.array([1]))
            branch.close()
            print("fork of a CPU-only sandbox: ok")
            print("init_cuda in both sandboxes:", envs.call("init_cuda"))
            time.sleep(0.5)
            rows = envs.stats()
            print("sandbox pids:", envs.worker_pids)
            print("NVML compute processes:", nvml_processes())
            print(
                "stats (index, pid, gpu_memory, rss):",
                [(r["index"], r["pid"], r["gpu_memory"], r["rss"]) for r in rows],
            )
            self.stats_ok = all((r["gpu_memory"] or 0) > 0 for r in rows)
            try:
                envs.fork("must-refuse", indices=[0])
                return False, "fork of a CUDA sandbox was NOT refused"
            except ForkUnsafeError as exc:
                nvml = any(e.startswith("NVML") for e in exc.evidence)
                return True, f"refused, NVML evidence: {nvml}; evidence: {exc.evidence}"
        finally:
            envs.close()

    def stats(self):
        ok = getattr(self, "stats_ok", None)
        if ok is None:
            return False, "not measured (check 1 failed before envs.stats())"
        return ok, "every CUDA sandbox has gpu_memory > 0" if ok else "gpu_memory missing"

    # -- 2 -----------------------------------------------------------------------------
    def clean_fallback(self):
        try:
            envs = self.vector(lambda: CudaEnv(True), 2, parent=True)
            envs.close()
            return False, "a CUDA warm parent was NOT refused"
        except ForkUnsafeError as exc:
            print("warm parent refused as expected:", exc.evidence)
        envs = self.vector(lambda: CudaEnv(True), 2, parent=True, gpu_fork_policy="clean")
        try:
            envs.reset(seed=0)
            rewards = envs.step(np.array([0, 1]))[1]
            sums = envs.call("init_cuda", 1)
            events = [e["event"] for e in envs.lineage.record.events]
            ok = "clean_launch" in events and list(rewards) == [1.0, 1.0]
            return ok, f"rewards {list(rewards)}, CUDA sums {sums}, lineage events {events}"
        finally:
            envs.close()

    # -- 4 -----------------------------------------------------------------------------
    def clone_timing(self, warmup=None, cold: bool = True):
        envs = self.vector(CudaEnv, 1, parent=True, warmup=warmup)
        times = []
        try:
            begin = time.perf_counter()
            for i in range(10):
                if i >= 3 and time.perf_counter() - begin > CLONE_BUDGET:
                    break
                start = time.perf_counter()
                envs.reset(seed=i)  # a fresh clone of the CPU-only warm parent
                (total,) = envs.call("init_cuda", 1)
                times.append(time.perf_counter() - start)
                assert total == 2**18, total
        finally:
            envs.close()
        ms = [round(t * 1e3, 1) for t in times]
        clone = f"clone + CUDA init after fork: p50 {statistics.median(times) * 1e3:.1f} ms"
        if not cold:
            return True, f"{clone} (all: {ms})"
        cold = []
        code = (
            "import sys; sys.path.insert(0, 'benchmarks');"
            "from gpu_check import CudaEnv; CudaEnv().init_cuda(1)"
        )
        for _ in range(3):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            cold.append(time.perf_counter() - start)
        cold_ms = [round(t * 1e3, 1) for t in cold]
        return True, (
            f"{clone} (all: {ms}); cold process + CUDA init: "
            f"p50 {statistics.median(cold) * 1e3:.1f} ms (all: {cold_ms})"
        )


def main(argv: list[str]) -> int:
    global DEVICE
    if "--cpu" in argv:
        DEVICE = os.environ["GPU_CHECK_DEVICE"] = "cpu"
        print("--cpu: plumbing only; checks 1-3 are expected to FAIL (no CUDA context)")
    environment()
    report = probe()
    print(
        "probe:",
        report.nvml,
        report.reason or "",
        report.driver_version,
        report.cuda_driver_version,
        [f"{d.name} {d.uuid} {d.memory_total >> 20} MiB" for d in report.devices],
    )
    if not report.nvml and DEVICE == "cuda":
        print("no NVML here: nothing to check")
        return 0
    run = Run()
    run.check("1 refuse fork of a CUDA sandbox", run.refuse_and_stats)
    run.check("2 clean fallback for a CUDA warm parent", run.clean_fallback)
    run.check("3 per-sandbox GPU memory from NVML", run.stats)
    run.check("4 clone + CUDA init vs cold start", run.clone_timing)
    run.check(
        "4b same, warm parent imported torch (no CUDA context)",
        lambda: run.clone_timing(warmup=import_torch, cold=False),
    )
    print("options used:", run.options, "| fallback:", run.fallback or "none")
    failed = [name for name, ok in run.results.items() if not ok]
    print("SUMMARY:", "all checks passed" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
