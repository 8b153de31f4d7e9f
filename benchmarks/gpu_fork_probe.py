"""Probe: can a process that holds CUDA state be branched with the driver's checkpoint API?

    python3 benchmarks/gpu_fork_probe.py [--json OUT] [--criu DIR] [--children N]
    python3 benchmarks/gpu_fork_probe.py --host    # no GPU: plumbing only (see below)

A *target* process (this file, ``--target``) makes a CUDA context through the driver API
(ctypes on libcuda, no framework: torch marks a forked child "bad fork" by itself), fills
a 64 MiB device buffer with a known pattern, loads a PTX kernel and runs it. Then:

  fork      lock + checkpoint the target (its device memory moved into driver-owned host
            memory), ``fork()`` it, restore and unlock the parent and the child (parent
            first, then child first in a second trial): does each run its kernel, see its
            own buffer at the same device address, diverge from the other, and exit
            cleanly? Then, if that held, one checkpoint and ``--children`` forks, each
            child restored in turn (times per child).
  criu      (with ``--criu DIR``: a directory holding ``usr/sbin/criu``, its libraries and a
            loader in ``usr/lib/x86_64-linux-gnu``: Debian's packages unpacked)
            the checkpointed target dumped once with CRIU and restored twice, each copy in
            fresh pid and mount namespaces, then its GPU state restored.

Every checkpoint call runs in a helper process (``--call``) under a deadline, so a call
that hangs in the driver is reported, not waited on. Times are wall-clock milliseconds,
against a cold target (interpreter start to its first kernel). GPU memory per process
from NVML. The outcome is printed as one JSON document (and written to ``--json``);
docs/gpu.md records it. ``--host`` runs the same steps with a host-memory buffer and
no-op checkpoint calls: it checks this script's plumbing on a machine without a GPU and
says nothing about CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

N_WORDS = 16 * 2**20  # 64 MiB of uint32
CALL_DEADLINE_S = 30.0
REPLY_DEADLINE_S = 120.0
STATES = {
    0: "running",
    1: "locked",
    2: "checkpointed",
    3: "failed",
    4: "checkpointing",
    5: "restoring",
}

# x[i] += v for i < n: one global load and store per thread.
PTX = rb"""
.version 7.0
.target sm_50
.address_size 64
.visible .entry add_value(.param .u64 buf, .param .u32 n, .param .u32 v)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<5>;
    ld.param.u64 %rd1, [buf];
    ld.param.u32 %r1, [n];
    ld.param.u32 %r2, [v];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r6, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r6, 4;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.u32 %r7, [%rd4];
    add.u32 %r7, %r7, %r2;
    st.global.u32 [%rd4], %r7;
DONE:
    ret;
}
"""


# --- the driver -------------------------------------------------------------------------


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(cuda, result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUresult {result} ({(name.value or b'?').decode()})")


class GpuBuffer:
    """A CUDA context on device 0, a 64 MiB buffer and the add kernel (driver API)."""

    def __init__(self, initial):
        self.cuda = cuda = _driver()
        _check(cuda, cuda.cuInit(0), "cuInit")
        device, self.context = ctypes.c_int(), ctypes.c_void_p()
        _check(cuda, cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        _check(cuda, cuda.cuDevicePrimaryCtxRetain(ctypes.byref(self.context), device), "ctx")
        _check(cuda, cuda.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        self.pointer = ctypes.c_uint64()
        _check(cuda, cuda.cuMemAlloc_v2(ctypes.byref(self.pointer), N_WORDS * 4), "cuMemAlloc")
        module, self.function = ctypes.c_void_p(), ctypes.c_void_p()
        _check(cuda, cuda.cuModuleLoadData(ctypes.byref(module), PTX), "cuModuleLoadData")
        _check(
            cuda,
            cuda.cuModuleGetFunction(ctypes.byref(self.function), module, b"add_value"),
            "cuModuleGetFunction",
        )
        _check(
            cuda,
            cuda.cuMemcpyHtoD_v2(self.pointer, initial.ctypes.data, N_WORDS * 4),
            "cuMemcpyHtoD",
        )

    def add(self, value: int) -> None:
        cuda = self.cuda
        buf, n, v = self.pointer, ctypes.c_uint32(N_WORDS), ctypes.c_uint32(value)
        params = (ctypes.c_void_p * 3)(
            ctypes.cast(ctypes.byref(buf), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(n), ctypes.c_void_p),
            ctypes.cast(ctypes.byref(v), ctypes.c_void_p),
        )
        blocks = (N_WORDS + 255) // 256
        _check(
            cuda,
            cuda.cuLaunchKernel(self.function, blocks, 1, 1, 256, 1, 1, 0, None, params, None),
            "cuLaunchKernel",
        )
        _check(cuda, cuda.cuCtxSynchronize(), "cuCtxSynchronize")

    def read(self, out) -> None:
        _check(
            self.cuda,
            self.cuda.cuMemcpyDtoH_v2(out.ctypes.data, self.pointer, N_WORDS * 4),
            "cuMemcpyDtoH",
        )


class HostBuffer:
    """``--host``: the same operations on host memory (plumbing checks without a GPU)."""

    def __init__(self, initial):
        self.data = initial.copy()
        self.pointer = ctypes.c_uint64(self.data.ctypes.data)

    def add(self, value: int) -> None:
        self.data += value

    def read(self, out) -> None:
        out[:] = self.data


# --- the target -------------------------------------------------------------------------


def _put(directory: str, name: str, document: dict) -> None:
    partial = os.path.join(directory, f".{name}.{os.getpid()}")
    with open(partial, "w") as f:
        json.dump(document, f)
    os.rename(partial, os.path.join(directory, name))


def _take(directory: str, name: str) -> dict | None:
    path = os.path.join(directory, name)
    try:
        with open(path) as f:
            document = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    os.unlink(path)
    return document


def serve(io: str, host: bool) -> None:
    """The target: commands from ``io``/cmd, replies to ``io``/out; polls every 2 ms
    (files, not pipes or sockets, so that CRIU's copies need nothing but a path)."""
    import numpy as np

    started = time.perf_counter()
    initial = np.arange(N_WORDS, dtype=np.uint32)
    buffer = (HostBuffer if host else GpuBuffer)(initial)
    buffer.add(1)
    scratch = np.empty(N_WORDS, dtype=np.uint32)
    _put(io, "out", {"seq": 0, "pid": os.getpid(), "ready_s": time.perf_counter() - started})
    while True:
        command = _take(io, "cmd")
        if command is None:
            time.sleep(0.002)
            continue
        op, reply = command["op"], {"seq": command["seq"], "pid": os.getpid()}
        t0 = time.perf_counter()
        try:
            if op == "add":
                buffer.add(int(command["value"]))
            elif op == "read":
                buffer.read(scratch)
                reply.update(
                    total=int(scratch.sum(dtype=np.uint64)),
                    first=int(scratch[0]),
                    last=int(scratch[-1]),
                    pointer=buffer.pointer.value,
                )
            elif op == "fork":
                child = os.fork()
                if child == 0:
                    io = os.path.join(os.path.dirname(io), f"child-{os.getpid()}")
                    os.makedirs(io, exist_ok=True)
                    _put(io, "out", {"seq": 0, "pid": os.getpid(), "ready_s": 0.0})
                    continue
                reply["child"] = child
                reply["io"] = os.path.join(os.path.dirname(io), f"child-{child}")
            elif op == "exit":
                _put(io, "out", reply)
                os._exit(0)
        except Exception as exc:  # reported to the controller: the probe's outcome
            reply["error"] = f"{type(exc).__name__}: {exc}"
        reply["ms"] = (time.perf_counter() - t0) * 1e3
        _put(io, "out", reply)


# --- one checkpoint call, in its own process ----------------------------------------------


def call(op: str, pid: int, host: bool) -> dict:
    """``--call``: one of lock/checkpoint/restore/unlock/state on ``pid``, timed."""
    if host:
        return {"ok": True, "ms": 0.0, "state": "running"}
    cuda = _driver()
    _check(cuda, cuda.cuInit(0), "cuInit")
    t0 = time.perf_counter()
    args = (ctypes.c_uint64 * 8)()  # every *Args struct is 64 bytes; zero = defaults
    if op == "lock":
        ctypes.cast(args, ctypes.POINTER(ctypes.c_uint32))[0] = 10_000  # timeoutMs
        result = cuda.cuCheckpointProcessLock(pid, ctypes.byref(args))
    elif op == "checkpoint":
        result = cuda.cuCheckpointProcessCheckpoint(pid, None)
    elif op == "restore":
        result = cuda.cuCheckpointProcessRestore(pid, None)
    elif op == "unlock":
        result = cuda.cuCheckpointProcessUnlock(pid, None)
    elif op == "state":
        result = 0
    else:
        raise SystemExit(f"unknown call {op!r}")
    ms = (time.perf_counter() - t0) * 1e3
    out: dict = {"ok": result == 0, "ms": ms}
    if result:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(result, ctypes.byref(name))
        out["error"] = f"CUresult {result} ({(name.value or b'?').decode()})"
    state, tid = ctypes.c_int(-1), ctypes.c_int(-1)
    got = cuda.cuCheckpointProcessGetState(pid, ctypes.byref(state))
    out["state"] = STATES.get(state.value, state.value) if got == 0 else f"CUresult {got}"
    got = cuda.cuCheckpointProcessGetRestoreThreadId(pid, ctypes.byref(tid))
    out["restore_tid"] = tid.value if got == 0 else f"CUresult {got}"
    return out


# --- the controller -----------------------------------------------------------------------


class Probe:
    """Drives targets and checkpoint calls; every wait has a deadline."""

    def __init__(self, host: bool, base: str):
        self.host, self.base = host, base
        self.seq = 0
        self.spawned: list[subprocess.Popen] = []
        self.pids: set[int] = set()

    def run_call(self, op: str, pid: int) -> dict:
        command = [sys.executable, __file__, "--call", op, str(pid)] + ["--host"] * self.host
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=CALL_DEADLINE_S)
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": f"no answer in {CALL_DEADLINE_S:.0f} s"}
        if done.returncode:
            return {"ok": False, "error": (done.stderr or done.stdout)[-800:]}
        return json.loads(done.stdout)

    def spawn(self, name: str, io: str | None = None) -> tuple[int, str, float]:
        io = io or os.path.join(self.base, name)
        os.makedirs(io, exist_ok=True)
        t0 = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, __file__, "--target", io] + ["--host"] * self.host,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.base, f"{name}.err"), "w"),  # noqa: SIM115
            start_new_session=True,
        )
        self.spawned.append(process)
        ready = self.wait(io, 0)
        self.pids.add(ready["pid"])
        return ready["pid"], io, (time.perf_counter() - t0) * 1e3

    def wait(self, io: str, seq: int) -> dict:
        deadline = time.monotonic() + REPLY_DEADLINE_S
        while time.monotonic() < deadline:
            reply = _take(io, "out")
            if reply is not None and reply["seq"] == seq:
                return reply
            time.sleep(0.002)
        raise TimeoutError(f"no reply {seq} in {io} within {REPLY_DEADLINE_S:.0f} s")

    def ask(self, io: str, op: str, **fields) -> dict:
        self.seq += 1
        _put(io, "cmd", {"seq": self.seq, "op": op, **fields})
        reply = self.wait(io, self.seq)
        if "child" in reply:
            self.pids.add(reply["child"])
            self.wait(reply["io"], 0)
        return reply

    def gpu_memory(self) -> dict:
        if self.host:
            return {}
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            listed = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            return {p.pid: p.usedGpuMemory for p in listed if p.pid in self.pids}
        except Exception as exc:
            return {"error": repr(exc)}

    def close(self) -> list[int]:
        """Kill every target and child this probe made; the pids still alive after."""
        for pid in self.pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.spawned:  # each leads its own session: CRIU's restorers too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        time.sleep(0.2)
        return [
            pid for pid in self.pids if os.path.exists(f"/proc/{pid}/stat") and not _zombie(pid)
        ]


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def expected(added: int) -> dict:
    """What ``read`` returns after the initial +1 and ``added`` more."""
    total = N_WORDS * (N_WORDS - 1) // 2 + N_WORDS * (1 + added)
    return {"total": total, "first": 1 + added, "last": N_WORDS - 1 + 1 + added}


def verify(reply: dict, added: int) -> bool:
    want = expected(added)
    return "error" not in reply and all(reply.get(k) == v for k, v in want.items())


def fork_trial(probe: Probe, child_first: bool) -> dict:
    """Checkpoint, fork, restore both (in the order asked); see both run and diverge."""
    log: dict = {"order": "child first" if child_first else "parent first"}
    pid, io, log["cold_ms"] = probe.spawn(f"fork-{int(child_first)}")
    log["before"] = verify(probe.ask(io, "read"), 0)
    log["memory_before"] = probe.gpu_memory()
    log["lock"] = probe.run_call("lock", pid)
    log["checkpoint"] = probe.run_call("checkpoint", pid)
    if not log["checkpoint"].get("ok"):
        return log
    log["memory_checkpointed"] = probe.gpu_memory()
    forked = probe.ask(io, "fork")
    log["fork_ms"] = forked["ms"]
    child, child_io = forked["child"], forked["io"]
    log["child_state"] = probe.run_call("state", child)

    def bring_back(who: str, target: int, target_io: str, value: int) -> None:
        log[f"{who}_restore"] = probe.run_call("restore", target)
        if not log[f"{who}_restore"].get("ok"):
            return
        log[f"{who}_unlock"] = probe.run_call("unlock", target)
        if not log[f"{who}_unlock"].get("ok"):
            return
        read = probe.ask(target_io, "read")
        log[f"{who}_sees_checkpointed_buffer"] = verify(read, 0)
        log[f"{who}_pointer"] = read.get("pointer")
        added = probe.ask(target_io, "add", value=value)
        log[f"{who}_first_kernel_ms"] = added["ms"]
        log[f"{who}_kernel_error"] = added.get("error")
        log[f"{who}_after_own_kernel"] = verify(probe.ask(target_io, "read"), value)

    order = [("child", child, child_io, 7), ("parent", pid, io, 5)]
    for who, target, target_io, value in order if child_first else order[::-1]:
        bring_back(who, target, target_io, value)
    if log.get("child_after_own_kernel") and log.get("parent_after_own_kernel"):
        log["diverged"] = verify(probe.ask(io, "read"), 5) and verify(
            probe.ask(child_io, "read"), 7
        )
        log["memory_after"] = probe.gpu_memory()
        log["child_exit"] = probe.ask(child_io, "exit").get("error", "ok")
    return log


def fan_out_trial(probe: Probe, children: int) -> dict:
    """One checkpoint, ``children`` forks, each restored: the times per child."""
    log: dict = {"children": children}
    pid, io, log["cold_ms"] = probe.spawn("fan-out")
    lock, checkpoint = probe.run_call("lock", pid), probe.run_call("checkpoint", pid)
    log["lock_ms"], log["checkpoint_ms"] = lock.get("ms"), checkpoint.get("ms")
    if not checkpoint.get("ok"):
        log["error"] = checkpoint
        return log
    rows = []
    for k in range(children):
        forked = probe.ask(io, "fork")
        restore = probe.run_call("restore", forked["child"])
        unlock = probe.run_call("unlock", forked["child"])
        added = probe.ask(forked["io"], "add", value=k + 2)
        rows.append(
            {
                "fork_ms": forked["ms"],
                "restore_ms": restore.get("ms"),
                "restore_error": restore.get("error"),
                "unlock_ms": unlock.get("ms"),
                "first_kernel_ms": added["ms"],
                "exact": verify(probe.ask(forked["io"], "read"), k + 2),
            }
        )
    log["rows"] = rows
    log["parent_restore"] = probe.run_call("restore", pid)
    log["parent_unlock"] = probe.run_call("unlock", pid)
    log["parent_exact"] = verify(probe.ask(io, "read"), 0)
    log["memory"] = probe.gpu_memory()
    return log


def criu_trial(probe: Probe, criu_dir: str, copies: int = 2) -> dict:
    """CRIU: dump the checkpointed target once, restore ``copies`` copies, each in fresh
    pid + mount namespaces whose io path is bound to the copy's own folder."""
    log: dict = {}
    libraries = os.path.join(criu_dir, "usr/lib/x86_64-linux-gnu")
    # run through the carried loader: the carried libc need not match the machine's
    criu = [os.path.join(libraries, "ld-linux-x86-64.so.2"), "--library-path", libraries,
            os.path.join(criu_dir, "usr/sbin/criu")]  # fmt: skip
    env = dict(os.environ)
    check = subprocess.run([*criu, "check"], capture_output=True, text=True, timeout=60)
    log["criu_check"] = (check.stdout + check.stderr)[-600:]
    shared_io = os.path.join(probe.base, "criu-io")
    pid, _io, log["cold_ms"] = probe.spawn("criu", io=shared_io)
    log["lock"] = probe.run_call("lock", pid)
    log["checkpoint"] = probe.run_call("checkpoint", pid)
    images = os.path.join(probe.base, "criu-images")
    os.makedirs(images)
    t0 = time.perf_counter()
    dump = subprocess.run(
        [*criu, "dump", "-t", str(pid), "-D", images, "--leave-running", "-v2",
         "-o", "dump.log", "--file-locks"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    log["dump_ms"] = (time.perf_counter() - t0) * 1e3
    log["dump_rc"] = dump.returncode
    if dump.returncode:
        log["dump_log"] = _tail(os.path.join(images, "dump.log"))
        return log
    log["parent_restore"] = probe.run_call("restore", pid)
    log["parent_unlock"] = probe.run_call("unlock", pid)
    rows = []
    for k in range(copies):
        own = os.path.join(probe.base, f"criu-copy-{k}")
        os.makedirs(own)
        script = (
            f"mount --bind {own} {shared_io} && exec {' '.join(criu)} restore -D {images} "
            f"-v2 -o restore-{k}.log --file-locks"
        )
        t0 = time.perf_counter()
        restorer = subprocess.Popen(
            ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--propagation", "private",
             "sh", "-c", script],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        probe.spawned.append(restorer)
        host_pid = _find_restored(pid, restorer, probe.pids, deadline_s=60)
        row: dict = {"criu_restore_ms": (time.perf_counter() - t0) * 1e3, "host_pid": host_pid}
        if host_pid is None:
            row["restore_log"] = _tail(os.path.join(images, f"restore-{k}.log"))
            rows.append(row)
            break
        probe.pids.add(host_pid)
        row["restore"] = probe.run_call("restore", host_pid)
        row["unlock"] = probe.run_call("unlock", host_pid)
        row["sees_checkpointed_buffer"] = verify(probe.ask(own, "read"), 0)
        added = probe.ask(own, "add", value=10 + k)
        row["first_kernel_ms"], row["kernel_error"] = added["ms"], added.get("error")
        row["exact"] = verify(probe.ask(own, "read"), 10 + k)
        rows.append(row)
    log["copies"] = rows
    log["parent_exact"] = verify(probe.ask(shared_io, "read"), 0)
    log["memory"] = probe.gpu_memory()
    return log


def _find_restored(original_pid: int, restorer, known: set, deadline_s: float) -> int | None:
    """The host pid, not in ``known``, of a process whose innermost pid is ``original_pid``
    in a child pid namespace (a CRIU copy), waiting up to ``deadline_s`` while
    ``restorer`` runs."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and restorer.poll() is None:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status") as f:
                    line = next(x for x in f if x.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue
            ids = line.split()[1:]
            if len(ids) == 2 and ids[1] == str(original_pid) and int(entry) not in known:
                return int(entry)
        time.sleep(0.05)
    return None


def _tail(path: str, chars: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError as exc:
        return repr(exc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", action="store_true", help="no GPU: plumbing only")
    parser.add_argument("--json", help="write the outcome here too")
    parser.add_argument("--criu", help="a folder holding usr/sbin/criu and its libraries")
    parser.add_argument("--children", type=int, default=4)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--call", nargs=2, help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.target:
        serve(options.target, options.host)
        return 0
    if options.call:
        print(json.dumps(call(options.call[0], int(options.call[1]), options.host)))
        return 0

    base = tempfile.mkdtemp(prefix="gpu_fork_probe-")
    probe = Probe(options.host, base)
    outcome: dict = {"host": options.host, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not options.host:
        smi = shutil.which("nvidia-smi")
        if smi:
            outcome["nvidia_smi"] = subprocess.run(
                [smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30,
            ).stdout.strip()  # fmt: skip
    trials = [("fork_parent_first", lambda: fork_trial(probe, child_first=False)),
              ("fork_child_first", lambda: fork_trial(probe, child_first=True))]  # fmt: skip
    branched = ("fork_parent_first", "fork_child_first")
    trials.append(("fan_out", lambda: fan_out_trial(probe, options.children)))
    if options.criu:
        trials.append(("criu", lambda: criu_trial(probe, options.criu)))
    for name, trial in trials:
        if name == "fan_out" and not any(
            outcome[b].get("child_after_own_kernel") for b in branched
        ):
            outcome[name] = {"skipped": "no forked child ran its kernel after a restore"}
            continue
        t0 = time.perf_counter()
        try:
            outcome[name] = trial()
        except Exception as exc:  # one trial's failure is an outcome; the next still runs
            outcome[name] = {"raised": f"{type(exc).__name__}: {exc}"}
        outcome[name]["trial_s"] = round(time.perf_counter() - t0, 2)
        print(name, json.dumps(outcome[name], default=str), flush=True)
    outcome["left_alive"] = probe.close()
    errors = {}
    for name in os.listdir(base):
        if name.endswith(".err") and os.path.getsize(os.path.join(base, name)):
            errors[name] = _tail(os.path.join(base, name), 800)
    outcome["target_stderr"] = errors
    document = json.dumps(outcome, indent=1, default=str)
    print(document)
    if options.json:
        with open(options.json, "w") as f:
            f.write(document)
    shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
