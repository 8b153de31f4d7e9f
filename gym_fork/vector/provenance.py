"""Provenance of a vector env: its lineage records, the isolation it achieved (and the
warnings about what is missing), and its sandboxes' memory."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import cloudpickle

from gym_fork import notices
from gym_fork.errors import IsolationMissing
from gym_fork.gpu import host_pid
from gym_fork.gpu import probe as gpu_probe
from gym_fork.hosts.base import WorkerHandle
from gym_fork.lineage import (
    Lineage,
    LineageLog,
    LineageTree,
    baseline_id,
    baseline_inputs,
    default_log_path,
)
from gym_fork.lineage.runs import current_run
from gym_fork.lineage.tree import BranchRecord

from .config import VectorConfig

# Sets of missing isolation layers already warned about (once per process each).
_WARNED_MISSING: set[tuple[str, ...]] = set()


def start_root_lineage(
    config: VectorConfig,
    *,
    branch_id: str | None,
    lineage_log: Any,
    env_ids: list[str | None],
    isolation: dict[str, Any],
    timings: dict[str, float],
    workers: list[WorkerHandle],
) -> Lineage:
    """A new lineage tree whose root is this vector env (raises if the id is taken)."""
    if lineage_log is True:
        lineage_log = default_log_path()
    try:
        identity = hashlib.sha256(cloudpickle.dumps(list(config.env_fns))).hexdigest()[:16]
    except Exception:
        identity = "unpicklable"
    settings = {
        "num_envs": config.num_envs,
        "autoreset_mode": config.autoreset_mode.value,
        "shared_memory": config.shared_memory,
        "observation_mode": str(config.observation_mode),
        "envs_per_worker": config.envs_per_worker,
        "reset_mode": config.reset_mode,
        "from_parent": config.prepare is not None,
    }
    inputs = baseline_inputs(
        gpu=gpu_probe().provenance(),
        env_identity=identity,
        env_ids=env_ids,
        config=settings,
        seed=config.prepare.seed if config.prepare else None,
        host=config.host,
        isolation=isolation,
    )
    tree = LineageTree(LineageLog(lineage_log or None), baseline_id(inputs), inputs)
    branch_id = branch_id or LineageTree.new_root_id()
    tree.check_free(branch_id)
    tree.add(
        BranchRecord(
            branch_id,
            None,
            tree.baseline_id,
            config.num_envs,
            timings=dict(timings),
            isolation=isolation,
            pids=[w.pid for w in workers],
            gpu_memory_created=gpu_memory(workers),
            run=current_run(env_ids=env_ids, makers=config.env_fns),
        )
    )
    return Lineage(tree, branch_id)


def add_branch(
    source: Lineage,
    branch_id: str,
    *,
    indices: list[int],
    copies: int,
    seeds: list[int | None],
    elapsed: float,
    isolation: dict[str, Any],
    workers: list[WorkerHandle],
) -> Lineage:
    """Record a branch forked from ``source`` in their tree."""
    tree = source.tree
    tree.add(
        BranchRecord(
            branch_id,
            source.branch_id,
            tree.baseline_id,
            len(workers),
            source_indices=indices,
            copies=copies,
            seeds=seeds,
            timings={"fork_s": elapsed},
            isolation=isolation,
            pids=[w.pid for w in workers],
            gpu_memory_created=gpu_memory(workers),
        )
    )
    return Lineage(tree, branch_id)


def gpu_memory(workers: list[WorkerHandle]) -> int | None:
    """GPU bytes held by these sandboxes (NVML), None without NVML."""
    report = gpu_probe()
    if not report.nvml:
        return None
    by_pid = report.processes_by_pid()
    return sum(p.used_memory or 0 for w in workers for _, p in by_pid.get(host_pid(w.pid), []))


def sandbox_stats(workers: list[WorkerHandle]) -> list[dict[str, Any]]:
    """Per sub-env: its sandbox's pid, RSS and PSS (bytes) and GPU memory (bytes)."""
    report = gpu_probe()
    by_pid = report.processes_by_pid() if report.nvml else {}
    rows = []
    for worker in workers:
        memory = smaps_rollup(worker.pid)
        gpu = by_pid.get(host_pid(worker.pid))
        gpu_bytes = sum(p.used_memory or 0 for _, p in gpu) if gpu else None
        for index in worker.indices:
            rows.append(
                {
                    "index": index,
                    "pid": worker.pid,
                    "rss": memory.get("Rss"),
                    "pss": memory.get("Pss"),
                    "gpu_memory": gpu_bytes,
                    "shares_sandbox_with": [i for i in worker.indices if i != index],
                }
            )
    return sorted(rows, key=lambda r: r["index"])


def smaps_rollup(pid: int) -> dict[str, int]:
    """Rss/Pss/... of a process in bytes (empty if it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def missing_layers(config: VectorConfig, isolation: dict[str, Any]) -> dict[str, str]:
    """The layers the host could not give (layer: why), less the caller's choices
    (network=True, private_tmp=False, namespaces=False, sandbox_user='root',
    host='inline')."""
    chosen = set()
    if config.isolation.sandbox_user == "root":
        chosen.add("identity")
    if config.isolation.network:
        chosen.add("net")
    if not config.isolation.private_tmp:
        chosen.add("private_tmp")
    if not config.isolation.namespaces:  # every layer made of namespaces is declined
        chosen |= {"namespaces", "mount", "uts", "net", "pid", "ipc", "proc", "private_tmp"}
        chosen |= {"sandbox_mount", "read_only_host", "minimal_dev", "identity"}
        chosen.add("warm_parent_read_only_host")  # its view is a mount in its pid ns
    if config.host == "inline":
        chosen.add("process")
    return {k: v for k, v in isolation.get("missing", {}).items() if k not in chosen}


def enforce_isolation(config: VectorConfig, isolation: dict[str, Any]) -> None:
    """With ``isolation="strict"``, raise :class:`IsolationMissing` naming every layer
    the sandboxes lack (the caller closes them); else do nothing."""
    if config.isolation_policy != "strict":
        return
    missing = missing_layers(config, isolation)
    if missing:
        raise IsolationMissing(
            "isolation='strict' refuses sandboxes without: "
            + "; ".join(f"{layer} ({why})" for layer, why in sorted(missing.items()))
            + ". Pass isolation='report' to run with a warning instead",
            missing=missing,
        )


def warn_missing_isolation(config: VectorConfig, isolation: dict[str, Any]) -> None:
    """Warn once about layers the host could not give (:func:`missing_layers`)."""
    missing = missing_layers(config, isolation)
    key = tuple(sorted(missing))
    if key and key not in _WARNED_MISSING:
        _WARNED_MISSING.add(key)
        notices.warn(
            "gym_fork sandboxes run without: "
            + "; ".join(f"{layer} ({why})" for layer, why in sorted(missing.items()))
        )


# A branch always shares its source's cgroups and any MAP_SHARED mapping it had.
_BRANCH_INHERENT = {"cgroups", "shared_with_source"}


def warn_branch_lost_isolation(
    source: Callable[[], dict[str, Any]], branch: dict[str, Any], branch_id: str
) -> None:
    """Warn once per set of layers when a branch lacks what its source had (a deep
    fork chain meets Landlock's 16 and user namespaces' 32 nesting levels). ``source``
    measures the source's isolation: asked only where the branch lacks a layer (it
    reads /proc of every source sandbox, ~1 ms a fork otherwise)."""
    lacking = {k: v for k, v in branch.get("missing", {}).items() if k not in _BRANCH_INHERENT}
    if not lacking:
        return
    had = set(source().get("missing", {}))
    lost = {k: v for k, v in lacking.items() if k not in had}
    key = ("branch", *sorted(lost))
    if lost and key not in _WARNED_MISSING:
        _WARNED_MISSING.add(key)
        notices.warn(
            f"gym_fork branch {branch_id!r} runs without what its source had: "
            + "; ".join(f"{layer} ({why})" for layer, why in sorted(lost.items()))
            + " (deep fork chains; see the FAQ, 'A deep search')"
        )
