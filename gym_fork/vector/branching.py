"""Branching: clone running sub-envs into the sandboxes of a new vector env.

The fork's arguments arrive checked (:func:`gym_fork.vector.frontend.plan_fork`, before
anything is allocated); then each source worker's host clones it (a process forks, a VM
is copied), and the branch's slab starts from its sources' last results, row by row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gymnasium.vector.utils import concatenate, iterate

from gym_fork import notices, progress
from gym_fork.gpu import ForkUnsafeError, cuda_evidence
from gym_fork.gpu import probe as gpu_probe
from gym_fork.hosts.base import CloneOrder, ForkJob, WorkerHandle
from gym_fork.text_safety import escape_controls
from gym_fork.worker import protocol as P

from .burial import bury
from .frontend import ForkPlan
from .lifecycle import Sandboxes
from .opening import Opened
from .spaces import empty_buffer


def check_forkable(workers: list[WorkerHandle], pool) -> None:
    """Refuse to fork a dead sandbox or one that holds a CUDA context."""
    dead = [w for w in workers if not w.alive()]
    if dead:
        raise pool.crashed(dead[0], "before fork")
    report = gpu_probe()
    for worker in workers:
        evidence = cuda_evidence(worker.pid, report)
        if evidence:
            raise ForkUnsafeError(
                f"sub-env(s) {worker.indices} (pid {worker.pid}) hold a CUDA context, "
                f"which does not survive fork: {'; '.join(evidence)}. A live fork of "
                "mid-episode state cannot fall back to a clean launch.",
                pid=worker.pid,
                evidence=evidence,
            )


SHARED_MEMORY_POLICIES = ("warn", "refuse")


def check_shared_memory_policy(shared_memory: str) -> None:
    """Refuse an unknown ``fork(shared_memory=...)`` before anything is made."""
    if shared_memory not in SHARED_MEMORY_POLICIES:
        raise ValueError(f"shared_memory must be 'warn' or 'refuse', got {shared_memory!r}")


def clone_sandboxes(
    source: Opened, plan: ForkPlan, shared_memory: str = "warn"
) -> tuple[Opened, float]:
    """A branch's sandboxes, spaces and first observations (its metadata and render mode
    are its source's); and the seconds the clones took. ``shared_memory="refuse"``: a
    source whose clones would share memory with it (a fork does not copy MAP_SHARED
    mappings) raises ForkUnsafeError before it forks."""
    sandboxes = source.sandboxes
    involved = [w for w in sandboxes.pool.workers if any(i in w.indices for i in plan.indices)]
    check_forkable(involved, sandboxes.pool)
    started = time.perf_counter()
    if sandboxes.host is not None:
        sandboxes.host.fork_soon(involved)
    config = sandboxes.config.for_branch(plan.sources)
    if sandboxes.host is None or sandboxes.slabs is None:
        raise ValueError("fork: the source vector env is closed")
    host = sandboxes.host
    branch = Sandboxes(config, host.acquire())
    # What needs no clone is done while the sources fork (the branch's batched spaces,
    # its first observations, the tree's dead let go of): ~0.5 ms of each fork.
    done: dict[str, Any] = {}

    def meanwhile() -> None:
        done["spaces"] = source.spaces.for_branch(config.observation_mode, plan.sources)
        done["observations"] = _copy_rows(
            sandboxes, source.spaces, source.observations, branch, plan
        )
        bury(host, wait=False)  # let go of the tree's sandboxes seen gone since

    try:
        # The branch's single spaces are its source's: so are its slabs' layouts.
        branch.open_slabs(source.spaces, source.obs_in_slab, counts=[1] * config.num_envs)
        branch.attach_arg = dict(sandboxes.attach_arg or {}, num_envs=config.num_envs)
        with progress.task(
            f"fork {plan.branch_id!r}: {config.num_envs} clones",
            quiet=config.num_envs < 32,
            delay=0.5,
        ):
            branch.pool.workers = _fork_workers(sandboxes, branch, plan, shared_memory, meanwhile)
            # The branch's isolation is measured from its first sandbox: done while the
            # clones map their slabs and say HELLO.
            host.measure_born(branch.pool.workers[0])
            branch.receive_hellos(branch.pool.workers)
        opened = Opened(
            branch,
            done["spaces"],
            source.metadata,
            source.render_mode,
            source.obs_in_slab,
            done["observations"],
        )
    except BaseException:
        branch.teardown(terminate=True)
        raise
    return opened, time.perf_counter() - started


def _fork_workers(
    source: Sandboxes,
    branch: Sandboxes,
    plan: ForkPlan,
    shared_memory: str,
    meanwhile: Callable[[], None],
):
    """One fork job per source worker, all sent before any is waited for (``meanwhile``
    runs then)."""
    where = {i: k for k, w in enumerate(source.pool.workers) for i in w.indices}
    by_worker: dict[int, list[int]] = {}  # source worker position -> branch indices
    for j, i in enumerate(plan.sources):
        by_worker.setdefault(where[i], []).append(j)
    timeout = source.config.timeout
    host, slabs = branch.host, branch.slabs
    assert host is not None and slabs is not None  # opened by clone_sandboxes
    jobs = []
    for position, branch_indices in by_worker.items():
        worker = source.pool.workers[position]
        orders = [
            CloneOrder(
                branch.spec([j], f"{plan.branch_id} sub-env {j}"),
                plan.sources[j],
                j,
                plan.seeds[j],
            )
            for j in branch_indices
        ]

        def ask_later(op: int, arg: Any, worker: WorkerHandle = worker) -> Any:
            if op == P.FORK:  # the worker refuses before it forks: it alone sees its maps
                arg = {**arg, "shared_memory": shared_memory}
            return source.pool.ask_later(worker, op, arg, timeout)

        slab_fds = [slabs.slabs[j].region.fd for j in branch_indices]
        jobs.append(ForkJob(worker, orders, slab_fds, ask_later))
    made = host.fork_many(jobs, branch.config.num_envs, branch.config.ring_bytes, meanwhile)
    handles: dict[int, WorkerHandle] = {}
    for branch_indices, clones in zip(by_worker.values(), made, strict=True):
        handles.update(zip(branch_indices, clones, strict=True))
    return [handles[j] for j in range(branch.config.num_envs)]


def warn_shared_with_source(workers: list[WorkerHandle], branch_id: str) -> None:
    """One warning for a branch whose sandboxes report memory or files they share with
    their source (``missing["shared_with_source"]``, each clone's own report)."""
    shared: dict[str, Any] = {}
    for worker in workers:
        report = worker.info.get("isolation")
        missing = report.get("missing") if isinstance(report, dict) else None
        why = missing.get("shared_with_source") if isinstance(missing, dict) else None
        if isinstance(why, str):
            shared.setdefault(escape_controls(why[:1000]), []).extend(worker.indices)
    if shared:
        notices.warn(
            f"gym_fork branch {branch_id!r} shares memory with its source: "
            + "; ".join(f"sub-env(s) {indices}: {why}" for why, indices in shared.items())
            + ". The branch's writes reach its source. Pass shared_memory='refuse' to "
            "fork() to refuse such forks"
        )


def _copy_rows(source, source_spaces, source_observations, branch, plan) -> Any:
    """The branch starts where its sources are: their last results, row by row (branch
    sub-env j has a slab of its own, row 0)."""
    for j, i in enumerate(plan.sources):
        theirs, row = source.slabs.where(i)
        branch.slabs.slabs[j].copy_row(0, theirs, row)
    single = source_spaces.single_observation_space
    if branch.slabs.observation_layout is not None:
        return branch.slabs.observations()
    rows = list(iterate(source_spaces.observation_space, source_observations))
    out: Any = empty_buffer(single, len(plan.sources))
    return concatenate(single, [rows[i] for i in plan.sources], out)
