"""Lifecycle of one vector env's sandboxes: start, replace, health, teardown.

The release of killed sandboxes once their exit is seen is ``burial.py``'s.

A :class:`Sandboxes` owns the warm parent (its host, shared with branches), the worker
pool and the workers' slabs. It is handed everything it needs (config, spaces, lineage) and
never calls back into the vector env.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import weakref
from typing import Any

import cloudpickle
import numpy as np

from gym_fork import notices
from gym_fork.errors import RingTimeout, SubEnvCrashed, TransportError
from gym_fork.gpu import ForkUnsafeError, cuda_evidence
from gym_fork.gpu import probe as gpu_probe
from gym_fork.hosts import make_host
from gym_fork.hosts.base import Host, WorkerHandle, WorkerSpec
from gym_fork.lineage import Lineage
from gym_fork.transport.slab import SlabSet
from gym_fork.worker import protocol as P

from .burial import burial_lock, bury, bury_all, release_gone
from .config import VectorConfig, check_sandbox_count
from .faults import errors_exception
from .pool import WorkerPool
from .provenance import gpu_memory
from .spaces import VectorSpaces
from .waits import Deadline, WaitTimeout

# Every open set of sandboxes, so that interpreter exit without close() still cleans up
# (and so that the per-controller ceiling on sandboxes counts them all).
_OPEN: weakref.WeakSet[Sandboxes] = weakref.WeakSet()
_OWNER = os.getpid()  # the process whose sandboxes these are (a fork of it inherits them)


def _forget_in_forked_child() -> None:
    """In a fork of the controller: the parent's sandboxes are not ours to close."""
    global _OWNER
    _OWNER = os.getpid()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_forked_child)


@atexit.register
def _close_all_at_exit() -> None:
    if os.getpid() != _OWNER:  # forked by other means than os.fork(): not ours either
        return
    for sandboxes in list(_OPEN):
        with contextlib.suppress(Exception):
            sandboxes.teardown(terminate=True)
    bury_all()


def _let_go(
    host: Host, killed: list[WorkerHandle] | None = None, leaving: Sandboxes | None = None
) -> None:
    """A vector env (``leaving``) is done with ``host``, whose sandboxes ``killed`` it
    killed: while another open vector env uses it, their exit is seen later
    (:func:`bury`); from its last user, they and those left before are waited for. Then
    it is released (closed by its last user), whatever the wait raised."""
    try:
        with burial_lock():  # two last branches closing at once: one of them waits for all
            shared = any(other.host is host and other is not leaving for other in list(_OPEN))
            bury(host, killed, wait=not shared)
    finally:
        host.release()


def new_slab_memfd() -> int:
    """An empty memfd for one worker's slab (SlabSet sizes and seals it)."""
    return os.memfd_create("gym_fork-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


def live_sandboxes() -> int:
    """Worker sandboxes held by every open vector env of this process."""
    return sum(len(s.pool.workers) for s in list(_OPEN))


class Sandboxes:
    """The warm parent, worker pool and slabs of one vector env (a root or a branch)."""

    config: VectorConfig
    host: Host | None
    pool: WorkerPool
    slabs: SlabSet | None
    lineage: Lineage | None
    timings: dict[str, float]
    clean_launch: dict[str, Any] | None
    attach_arg: dict[str, Any] | None

    def __init__(self, config: VectorConfig, host: Host) -> None:
        self.config = config
        self.host = host
        self.owner = os.getpid()  # a fork of the controller must not close these
        self.pool = WorkerPool(
            host,
            max_concurrency=config.max_concurrency,
            trusted=config.trusted,
            send_timeout=config.timeout,
        )
        self.slabs = None
        self.lineage = None
        self.timings = {}
        self.clean_launch = None
        self.attach_arg = None
        # One slab memfd per worker, sized and sealed once the spaces are known
        # (open_slabs); each worker gets its own at spawn and maps it at ATTACH.
        self._slab_fds: list[int] = []
        self._replacement_attach: bytes | None = None
        _OPEN.add(self)

    def _live_host(self) -> Host:
        """The warm parent's host (None only once torn down)."""
        if self.host is None:
            raise RuntimeError("these sandboxes are torn down: their host is released")
        return self.host

    def slab_set(self) -> SlabSet:
        """The workers' slabs (open from :meth:`open_slabs` until torn down)."""
        if self.slabs is None:
            raise RuntimeError("the slabs are not open")
        return self.slabs

    # -- start ----------------------------------------------------------------------
    @classmethod
    def start(cls, config: VectorConfig) -> tuple[Sandboxes, list[dict[str, Any]]]:
        """Start the warm parent and one worker per group; returns their HELLOs."""
        check_sandbox_count(live_sandboxes() + config.num_envs, "this vector env")
        started = time.perf_counter()
        host = make_host(config.host_config())
        self = cls(config, host)
        try:
            self.timings["parent_ready_s"] = time.perf_counter() - started
            self._check_warm_parent_gpu()
            cloned = time.perf_counter()
            groups = config.worker_groups()
            self._slab_fds = [new_slab_memfd() for _ in groups]
            self.pool.workers = self._live_host().spawn(
                [self.spec(group) for group in groups], self._slab_fds, config.ring_bytes
            )
            hellos = self.receive_hellos(self.pool.workers)
            self.timings["sandboxes_ready_s"] = time.perf_counter() - cloned
        except BaseException:
            self.teardown(terminate=True)
            raise
        return self, hellos

    def spec(self, indices: list[int], name: str | None = None) -> WorkerSpec:
        """The spec of a worker for sub-envs ``indices`` of this vector env."""
        if name is None:
            name = f"sub-env {indices[0]}" if len(indices) == 1 else f"sub-envs {indices}"
        return WorkerSpec(name, list(indices), [self.config.origins[i] for i in indices])

    def receive_hellos(
        self, workers: list[WorkerHandle], timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Each new worker's HELLO (its build error raised), within ``timeout`` (default:
        the vector env's)."""
        timeout = self.config.timeout if timeout is None else timeout
        deadline = Deadline(timeout)
        for worker in workers:
            worker.channel.allow_pickle = self.config.trusted
        hellos = []
        for worker in workers:
            try:
                _op, _seq, info, errors = self.pool.receive(worker, deadline, P.HELLO)
            except WaitTimeout:
                assert timeout is not None  # only a deadline passes
                raise self.pool.kill_unanswered(P.HELLO, "building the sub-envs", timeout) from None
            if errors:
                raise errors_exception(errors, building=True, trusted=self.config.trusted)
            if not isinstance(info, dict):
                info = {}
            worker.info = info
            hellos.append(info)
        return hellos

    def open_slabs(
        self, spaces: VectorSpaces, obs_in_slab: bool, counts: list[int] | None = None
    ) -> SlabSet:
        """Size, seal and map each worker's slab (the workers map theirs at ATTACH)."""
        if counts is None:
            counts = [len(w.indices) for w in self.pool.workers]
        if not self._slab_fds:
            self._slab_fds = [new_slab_memfd() for _ in counts]
        fds, self._slab_fds = self._slab_fds, []
        try:
            slabs = SlabSet(
                spaces.single_observation_space,
                spaces.single_action_space,
                counts,
                fds,
                use_observations=obs_in_slab,
                min_size=self._live_host().slab_min_bytes,
            )
        except BaseException:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        self.slabs = slabs
        self._live_host().check_slab(slabs.nbytes)
        return slabs

    def attach_all(self, spaces: VectorSpaces, obs_in_slab: bool) -> list[list[bool]]:
        """Every worker maps the slab; per sub-env: [same obs space, same act space]."""
        self.attach_arg = {
            "observation_space": cloudpickle.dumps(spaces.single_observation_space),
            "action_space": cloudpickle.dumps(spaces.single_action_space),
            "observation_mode": spaces.check_mode,
            "autoreset_mode": self.config.autoreset_mode.value,
            "num_envs": self.config.num_envs,
            "shared_memory": obs_in_slab,
        }
        self.pool.send_same(P.ATTACH, self.attach_arg)
        replies = self.pool.collect(P.ATTACH, self.config.timeout)
        return [check for reply in replies for check in (reply or [])]

    def _check_warm_parent_gpu(self) -> None:
        """Before cloning the warm parent: does it hold a CUDA context? (Checked once per
        warm parent: it only forks after it is ready, so its state does not change.)"""
        pid = self._live_host().gpu_pid
        if pid is None:
            return
        evidence = cuda_evidence(pid, gpu_probe())
        if not evidence:
            return
        if self.config.gpu_fork_policy == "refuse":
            raise ForkUnsafeError(
                f"the warm parent (pid {pid}) holds a CUDA context, which does not "
                f"survive fork: {'; '.join(evidence)}. Keep CUDA out of env_fn/warmup (build "
                "on CPU, or initialise the GPU after the fork), keep GPU work in the "
                "controller, or pass gpu_fork_policy='clean' to build each sandbox cold.",
                pid=pid,
                evidence=evidence,
            )
        # "clean": a warm parent that only imports; every sandbox builds (and warms) its
        # own env from the env_fn, i.e. a cold start that keeps the reset promise.
        tainted = self._live_host()
        self.host = make_host(self.config.host_config(clean_launch=True))
        self.pool.host = self.host
        tainted.release()
        self.clean_launch = {"reason": "warm parent holds CUDA", "evidence": evidence}

    # -- replace --------------------------------------------------------------------
    def replace_dead(self, only: list[int] | None = None) -> None:
        """Fresh sandboxes for the workers found dead (of positions ``only``, if given)."""
        dead = self.pool.dead_positions()
        if only is not None:
            dead = [k for k in dead if k in set(only)]
        self.replace(dead, "replaced_dead_sandbox")

    def reset_by_clone(self, mask: np.ndarray) -> None:
        """Fresh clones of the warm parent for the workers whose sub-envs all reset."""
        workers = self.pool.workers
        positions = [k for k, w in enumerate(workers) if all(mask[i] for i in w.indices)]
        self.replace(positions, "reset_by_clone")

    def replace(self, positions: list[int], why: str) -> None:
        """Clone the warm parent for the workers at ``positions`` (killing those)."""
        if not positions:
            return
        workers = self.pool.workers
        old = [workers[k] for k in positions]
        slabs, attach_arg = self.slabs, self.attach_arg
        if slabs is None or attach_arg is None:
            raise RuntimeError("replace: the workers have not attached their slabs")
        old_host, fresh = None, None
        try:
            old_host = self._ensure_warm_parent()
            if self._replacement_attach is None:
                # Pickled once: the warm parent unpickles it once too, then shares it.
                arg = dict(attach_arg, observation_mode="custom")
                self._replacement_attach = cloudpickle.dumps(arg)
            fds = [slabs.replace(k, new_slab_memfd()).region.fd for k in positions]
            fresh = self._live_host().spawn(
                [self.spec(w.indices) for w in old],
                fds,
                self.config.ring_bytes,
                self._replacement_attach,
            )
            for k, worker in zip(positions, fresh, strict=True):
                workers[k] = worker
            self.receive_hellos(fresh)
        finally:
            # Killed only now, the old sandboxes' exits (the kernel tearing down their
            # memory, ~2 ms of a core each) no longer compete with the new ones' start
            # for the cores; they are released once seen gone (at the next replace at
            # the latest), not waited for here.
            # Not replaced (the spawn failed), they stay in the pool, killed, until its
            # teardown releases them.
            for worker in old:
                worker.kill()
            if fresh is not None and old_host is None:
                bury(self._live_host(), old, wait=False)
            elif old_host is not None:  # the dead warm parent's host: released either way
                if fresh is not None:
                    for worker in old:
                        worker.watch.wait_dead(1.0)
                        worker.release()
                _let_go(old_host)
        if self.lineage is not None and why != "reset_by_clone":  # resets would flood it
            self.lineage.tree.event(
                self.lineage.branch_id,
                why,
                indices=[i for w in old for i in w.indices],
                old_pids=[w.pid for w in old],
                new_pids=[w.pid for w in fresh],
            )

    def _ensure_warm_parent(self) -> Host | None:
        """Health check: a dead warm parent is replaced by a cold launch of the env_fns
        (the prepared state is rebuilt from scratch), recorded in the lineage. Returns
        the dead host, for the caller to release once its sandboxes are released."""
        if self._live_host().alive():
            return None
        old = self.host
        self.host = make_host(self.config.host_config())
        self.pool.host = self.host
        self._replacement_attach = None
        if self.lineage is not None:
            self.lineage.tree.event(
                self.lineage.branch_id,
                "replaced_warm_parent",
                old_pid=getattr(old, "pid", None),
                new_pid=getattr(self.host, "pid", None),
            )
        return old

    # -- reports --------------------------------------------------------------------
    def isolation(self) -> dict[str, Any]:
        """The isolation the sandboxes achieved, as the first one reported it."""
        if self.host is None:
            return {}
        workers = self.pool.workers
        report = workers[0].info.get("isolation") if workers else None
        achieved = (
            self._live_host()
            .isolation(
                report if isinstance(report, dict) else None,
                pid=workers[0].pid if workers else None,
            )
            .as_dict()
        )
        achieved["sub_envs_per_sandbox"] = self.config.envs_per_worker
        return achieved

    # -- teardown -------------------------------------------------------------------
    def teardown(self, *, terminate: bool, timeout: float | None = None) -> None:
        """Close the sub-envs (unless ``terminate``), then kill and release every
        sandbox, the host (if this was its last user), the slab and the lineage record.
        In a fork of the controller, nothing: the sandboxes are the parent's."""
        if os.getpid() != self.owner:
            return
        workers, self.pool.workers = self.pool.workers, []
        gpu_at_close = None
        try:
            gpu_at_close = gpu_memory(workers) if self.lineage is not None else None
            if not terminate:
                self._close_sub_envs(workers, timeout)
        finally:  # a Ctrl-C or a warning turned error while closing still kills them all
            for worker in workers:
                worker.kill()
            host, self.host = self.host, None
            try:
                if host is not None:
                    _let_go(host, workers, leaving=self)
                else:
                    release_gone(workers, wait=True)
            finally:
                _OPEN.discard(self)
                if self.slabs is not None:
                    self.slabs.close()
                    self.slabs = None
                for fd in self._slab_fds:
                    os.close(fd)
                self._slab_fds = []
                if self.lineage is not None:
                    self.lineage.tree.close(
                        self.lineage.branch_id,
                        "terminated" if terminate else "closed",
                        gpu_memory=gpu_at_close,
                    )
                    self.lineage = None

    def _close_sub_envs(self, workers: list[WorkerHandle], timeout: float | None) -> None:
        live = [w for w in workers if w.alive()]
        deadline = Deadline(timeout)
        try:
            for worker in live:
                worker.awaiting = 0
                worker.channel.send([P.CLOSE, 0, None], deadline.slice() or 0.01)
            for worker in live:
                reply = self.pool.receive(worker, deadline, P.CLOSE)
                with contextlib.suppress(Warning):  # a note, never a reason to stop closing
                    note_tmp_leftovers(reply[2] if len(reply) > 2 else None)
        except (WaitTimeout, SubEnvCrashed, RingTimeout, TransportError, OSError):
            pass  # past the deadline, dead or misbehaving: it is killed next
        except Exception as exc:
            with contextlib.suppress(Warning):  # warnings turned errors: close goes on
                notices.warn(f"Error while closing the sub-envs: {exc!r}")


_TMP_NOTED = False


def note_tmp_leftovers(report: Any) -> None:
    """Say once per process that sandboxes left files in their private /tmp at close
    (they are gone with them), and which option keeps them. ``report`` comes from a
    sandbox: only two non-negative ints are read from it."""
    global _TMP_NOTED
    if _TMP_NOTED or not isinstance(report, dict):
        return
    files, size = report.get("files"), report.get("bytes")
    if type(files) is not int or type(size) is not int or files <= 0 or size < 0:
        return
    _TMP_NOTED = True
    notices.warn(
        f"gym_fork: a sandbox left {files} file(s) ({size / 2**20:.1f} MiB) in its private "
        "/tmp at close; they are gone with it. private_tmp=False gives sandboxes the "
        "host's /tmp, writable_paths=[...] a host directory of your choice (said once)."
    )
