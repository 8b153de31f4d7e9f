"""Branching an agent's workspace: fork + first step against copying it (``cp -a``).

    .venv/bin/python benchmarks/agent_workspace.py [--rounds 3] [--json OUT]

The env is examples/agent_workspace.py's ``WorkspaceEnv`` (a Text env of files and
commands). Its workspace is empty, or ``--mb`` MB in ``--files`` files (default 200 MB,
10,000 files) written by the source sandbox into its private /tmp ("sandbox"), or written
by the warm parent before any sandbox exists ("parent": ``from_parent``'s warmup; that
layer is every sandbox's shared lower layer). Then:

  fork       ``fork(indices=[0], copies=k)`` of the running source + one step of every
             copy ("ls"), the source writing a note before each fork (as an agent does
             between branch points: every fork freezes): the time to the branches'
             first step, the fork call alone, the layer helper's freeze of the source's
             /tmp writes into a shared layer (gym_fork/system/frozen_layers.py), and the
             swap as the source lives it (its wait for its new layer, which it forks
             its clones meanwhile, its files reopened there, the frozen one sealed: the
             source's clock, as it says; the first swap of a host, which also waits for
             the helper to start, apart)
  copy fork  the same with ``GYM_FORK_TMP_LAYERS=0``: each clone copies the source's
             /tmp writes (what a fork did before frozen layers)
  cp -a      what a user does without a fork: k fresh sandboxes (clones of the warm
             parent, ``reset_mode="clone"``) whose reset copies the same workspace with
             ``cp -a --no-preserve=ownership`` (a sandbox maps no other uid) from the
             host's /tmp, + one step of each

Each (contender, k) runs in a fresh interpreter, contenders interleaved, ``--rounds``
rounds, each run once the box is idle (under 0.15 busy cores over half a second,
``--quiet-wait`` 30 s at most: what the previous run left, 64 network namespaces to
free or GBs of copied pages, would be measured with it; ``busy_cores_before`` in the
JSON); a run's figure is the
median of its repetitions, the report gives the median of the rounds with their
min-max, and the load before and after each round. A workspace the
source wrote is copied 8 times at most ("copy fork"): 64 copies would be 12.8 GB of tmpfs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
sys.path.insert(0, EXAMPLES)
sys.path.append(HERE)  # after the examples: both have an agent_workspace.py
import peers  # host_cpu: the box's busy time  # noqa: E402

# (contender, copies, where the workspace was written) in the order a round runs them.
MATRIX = (
    ("fork", 1, "empty"),
    ("fork", 1, "sandbox"),
    ("copy fork", 1, "sandbox"),
    ("fork", 1, "parent"),
    ("cp -a", 1, "sandbox"),
    ("fork", 8, "empty"),
    ("fork", 8, "sandbox"),
    ("copy fork", 8, "sandbox"),
    ("fork", 8, "parent"),
    ("cp -a", 8, "sandbox"),
    ("fork", 64, "empty"),
    ("fork", 64, "sandbox"),
    ("fork", 64, "parent"),
)
# With --microvm: the same forks on host="microvm" (the whole guest cloned: its RAM is
# copy-on-write, files included), a smaller workspace (--vm-mb) in the guest's RAM.
VM_MATRIX = (
    ("vm fork", 1, "empty"),
    ("vm fork", 1, "sandbox"),
    ("vm fork", 8, "sandbox"),
)
VM_MEMORY_MB = 512
REPEATS = {1: 7, 8: 5, 64: 3}  # a microVM row: 3 (its forks are slower under TCG)
MAX_CHILD_S = 600
QUIET_CORES = 0.15  # wait_quiet()

# Published anchors, as their authors state them (conditions in their words).
ANCHORS = (
    ("E2B fork()", "pauses the parent, refuses a paused one; up to 100 forks a call"),
    ("Daytona", "250 sandboxes created in 0.88 s"),
    ("forkd", "100 microVMs forked in ~101 ms; the parent paused 41-48 ms"),
    ("Morph", "branch in < 250 ms"),
    ("CRIU", "restore in 50-70 ms"),
    ("Firecracker", "snapshot restore in < 8 ms"),
    ("OpenHands", "a container starts in 30-60 s"),
)


def fill(root: str, mb: int, files: int) -> None:
    """``mb`` MB of bytes in ``files`` files under ``root`` (100 per directory)."""
    chunk = os.urandom(max(1, mb * (1 << 20) // max(files, 1)))
    for k in range(files):
        folder = os.path.join(root, f"d{k // 100:03d}")
        if k % 100 == 0:
            os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"f{k:05d}"), "wb") as f:
            f.write(chunk)


def make_env():
    from agent_workspace import WorkspaceEnv

    class FilledWorkspace(WorkspaceEnv):
        """A WorkspaceEnv with a bulk directory beside its files: its reset can fill it
        (options fill=(mb, files)) or copy a directory into it with ``cp -a`` (options
        copy_from=DIR)."""

        def reset(self, *, seed=None, options=None):
            out = super().reset(seed=seed)
            options = options or {}
            bulk = self.root + "-bulk"
            if "fill" in options:
                shutil.rmtree(bulk, ignore_errors=True)
                os.mkdir(bulk)
                fill(bulk, *options["fill"])
            if "copy_from" in options:
                shutil.rmtree(bulk, ignore_errors=True)
                subprocess.run(
                    ["cp", "-a", "--no-preserve=ownership", options["copy_from"], bulk], check=True
                )
            return out

    return FilledWorkspace()


def _fill_in_parent(env, mb: int, files: int) -> None:
    env.reset(options={"fill": (mb, files)})


def one(contender: str, copies: int, where: str, mb: int, files: int) -> dict:
    """One fresh interpreter's measurement: medians over REPEATS[copies] repetitions."""
    import functools

    from gym_fork import ForkVectorEnv

    workspace = (mb, files)
    times: dict[str, list[float]] = {"first_step_s": [], "fork_s": []}
    if contender == "copy fork":  # what a fork did before frozen layers: clones copy
        os.environ["GYM_FORK_TMP_LAYERS"] = "0"
    if contender in ("fork", "copy fork", "vm fork"):
        warmup = functools.partial(_fill_in_parent, mb=mb, files=files)
        vm = {"host": "microvm", "vm_memory_mb": VM_MEMORY_MB} if contender == "vm fork" else {}
        envs = ForkVectorEnv.from_parent(
            make_env, 1, seed=0, warmup=warmup if where == "parent" else None, **vm
        )
        try:
            envs.reset(seed=0, options={"fill": workspace} if where == "sandbox" else None)
            for r in range(3 if contender == "vm fork" else REPEATS[copies]):
                envs.step((f"write notes.txt {r}",))  # what an agent does between forks
                t0 = time.perf_counter()
                branch = envs.fork(f"b{r}", indices=[0], copies=copies)
                t1 = time.perf_counter()
                branch.step(("ls",) * copies)
                t2 = time.perf_counter()
                branch.close()
                times["fork_s"].append(t1 - t0)
                times["first_step_s"].append(t2 - t0)
            layers = getattr(envs.sandboxes.host, "tmp_layers", None)
            helper = getattr(layers, "helper", None)
            if helper is not None and helper.freeze_ms:  # the helper's own time
                times["freeze_s"] = [ms / 1e3 for ms in helper.freeze_ms]
            swaps = getattr(layers, "swap_ms", [])
            if len(swaps) > 1:  # the source's wait; the first also waits for the helper's start
                times["swap_s"] = [ms / 1e3 for ms in swaps[1:]]
                times["first_swap_s"] = [swaps[0] / 1e3]
        finally:
            envs.close()
    else:
        source = tempfile.mkdtemp(prefix="workspace-copy-src-")  # the host's /tmp: readable
        try:
            os.chmod(source, 0o755)
            fill(source, *workspace)
            for dirpath, dirnames, filenames in os.walk(source):
                for name in dirnames:
                    os.chmod(os.path.join(dirpath, name), 0o755)
                for name in filenames:
                    os.chmod(os.path.join(dirpath, name), 0o644)
            envs = ForkVectorEnv.from_parent(make_env, copies, seed=0)
            try:
                envs.reset(seed=0)
                for _ in range(REPEATS[copies]):
                    t0 = time.perf_counter()
                    envs.reset(seed=0, options={"copy_from": source})
                    envs.step(("ls",) * copies)
                    times["first_step_s"].append(time.perf_counter() - t0)
            finally:
                envs.close()
        finally:
            shutil.rmtree(source, ignore_errors=True)
    return {k: statistics.median(v) for k, v in times.items() if v}


def load() -> float:
    return os.getloadavg()[0]


def busy_cores(window_s: float = 0.5) -> float:
    """How many cores the whole box kept busy over the next ``window_s`` seconds."""
    before = peers.host_cpu()[0]
    time.sleep(window_s)
    return (peers.host_cpu()[0] - before) / window_s


def wait_quiet(seconds: float) -> float:
    """Wait (``seconds`` at most) until the box is idle, under QUIET_CORES busy over a
    half-second; returns the busy cores of the last window. What a row leaves behind
    (the kernel freeing 64 network namespaces, GBs of copied pages) outlasts its
    process and would be measured with the next row; the load average lags by a minute.
    -1 where ``seconds`` is 0: not waited for, not measured."""
    if seconds <= 0:
        return -1.0
    deadline = time.monotonic() + seconds
    while True:
        busy = busy_cores()
        if busy < QUIET_CORES or time.monotonic() >= deadline:
            return busy


def run_child(contender: str, copies: int, where: str, mb: int, files: int, quiet_s: float) -> dict:
    busy = wait_quiet(quiet_s)
    args = [sys.executable, __file__, "--one", contender, str(copies), where]
    args += ["--mb", str(mb), "--files", str(files)]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=MAX_CHILD_S, cwd=tempfile.gettempdir()
    )
    if done.returncode != 0:
        raise RuntimeError(f"{contender} x{copies}: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "busy_cores_before": busy}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--microvm", action="store_true", help="also fork on host='microvm'")
    parser.add_argument("--vm-mb", type=int, default=50, help="the guest's workspace, MB")
    parser.add_argument("--vm-files", type=int, default=2_500)
    parser.add_argument(
        "--contenders",
        help="only these, comma-separated (fork,copy fork,cp -a,vm fork)",
        default="",
    )
    parser.add_argument("--copies", help="only these numbers of copies, comma-separated (1,8,64)")
    parser.add_argument(
        "--quiet-wait", type=float, default=30.0, help="seconds a run waits for an idle box"
    )
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        contender, copies, where = args.one[0], int(args.one[1]), args.one[2]
        print(json.dumps(one(contender, copies, where, args.mb, args.files)))
        return
    runs: dict[str, list[dict]] = {}
    loads = []
    for r in range(args.rounds):
        before = load()
        wanted = set(filter(None, args.contenders.split(",")))
        sizes = {int(k) for k in (args.copies or "").split(",") if k}
        for contender, copies, where in MATRIX + (VM_MATRIX if args.microvm else ()):
            if (wanted and contender not in wanted) or (sizes and copies not in sizes):
                continue
            key = f"{contender} x{copies} {where}"
            vm = contender == "vm fork"  # the guest's workspace lives in its RAM: smaller
            mb, files = (args.vm_mb, args.vm_files) if vm else (args.mb, args.files)
            runs.setdefault(key, []).append(
                run_child(contender, copies, where, mb, files, args.quiet_wait)
            )
        loads.append({"round": r, "load_before": before, "load_after": load()})
        print(f"round {r}: load {before:.2f} -> {load():.2f}", flush=True)
    table = {}
    for key, results in runs.items():
        copies = int(key.split(" x")[1].split()[0])
        row = {}
        for figure in results[0]:
            values = [res[figure] for res in results]
            row[figure] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
        row["branches_per_s"] = copies / row["first_step_s"]["median"]
        table[key] = row
    print(f"workspace: {args.mb} MB in {args.files} files; {os.cpu_count()} cores")
    if args.microvm:
        print(f"microVM rows: {args.vm_mb} MB in {args.vm_files} files in the guest")
    print(
        f"{'contender':<22} {'first step (ms)':>24} {'fork call (ms)':>22} {'branches/s':>11}"
        f" {'freeze (ms)':>12} {'swap (ms)':>10} {'1st swap':>9}"
    )
    for key, row in table.items():
        first = row["first_step_s"]
        cell = f"{first['median'] * 1e3:.1f} ({first['min'] * 1e3:.1f}-{first['max'] * 1e3:.1f})"
        fork = row.get("fork_s")
        fcell = (
            ""
            if fork is None
            else f"{fork['median'] * 1e3:.1f} ({fork['min'] * 1e3:.1f}-{fork['max'] * 1e3:.1f})"
        )
        freeze = row.get("freeze_s")
        zcell = "" if freeze is None else f"{freeze['median'] * 1e3:.2f}"
        swap, first_swap = row.get("swap_s"), row.get("first_swap_s")
        scell = "" if swap is None else f"{swap['median'] * 1e3:.2f}"
        s1cell = "" if first_swap is None else f"{first_swap['median'] * 1e3:.1f}"
        print(
            f"{key:<22} {cell:>24} {fcell:>22} {row['branches_per_s']:>11.0f} {zcell:>12}"
            f" {scell:>10} {s1cell:>9}"
        )
    print("anchors (published, their conditions):")
    for name, claim in ANCHORS:
        print(f"  {name}: {claim}")
    if args.json:
        out = {
            "command": " ".join(sys.argv),
            "workspace": {"mb": args.mb, "files": args.files},
            "vm_workspace": {"mb": args.vm_mb, "files": args.vm_files} if args.microvm else None,
            "cores": os.cpu_count(),
            "loads": loads,
            "table": table,
            "anchors": dict(ANCHORS),
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
