"""The Host interface: what the vector layer asks of a sandbox backend, and nothing more.

A *host* owns one warm parent (a prepared process, a frozen VM, or the controller itself
for ``inline``) and makes *worker sandboxes* from it: ``spawn`` clones the warm parent,
``fork`` clones a running worker (a *branch point*). The vector layer talks to workers
only through their channel (transport) and asks the host for everything else: liveness,
exit status, the isolation achieved, and whether its warm parent may be forked.

Shared here, so that every host speaks the same way: the worker handle and spec, the
clone order, the isolation report, and reference counting of the warm parent between a
vector env and its branches. The init message and the prepare-failure reply are in
gym_fork/hosts/preparing.py; making many sandboxes at once in gym_fork/hosts/batching.py.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self

from gym_fork.hosts.output import OutputCollector
from gym_fork.system.isolation import IsolationConfig
from gym_fork.system.scratch import is_scratch_dir, remove_scratch
from gym_fork.transport.channel import DEFAULT_RING_BYTES, Channel
from gym_fork.worker.prepare import PrepareRecipe as PrepareRecipe  # one type, every host

HOST_KINDS = ("process", "microvm", "inline")
# A microVM's guest RAM and batch slab unless the vector env says otherwise. The slab
# device has one size for every VM of a host (device layouts must match for a restore).
# A live fork reads all of it (the migration scans every page), so it is sized for
# typical batches rather than for the largest; vm_slab_mb raises it.
DEFAULT_VM_MEMORY_MB = 256
DEFAULT_VM_SLAB_MB = 16


@dataclass(frozen=True)
class HostConfig:
    """Everything a host needs to start its warm parent."""

    kind: str
    env_fns: tuple[Callable, ...]
    prepare: PrepareRecipe | None = None
    clean_launch: bool = False  # gpu_fork_policy="clean": each sandbox builds its env cold
    isolation: IsolationConfig = field(default_factory=IsolationConfig)
    ring_capacity: int = DEFAULT_RING_BYTES
    vm_memory_mb: int = DEFAULT_VM_MEMORY_MB
    vm_slab_mb: int = DEFAULT_VM_SLAB_MB
    start_timeout: float | None = None
    # Load what the sandboxes send (pickles run code): only when the user says so.
    trusted: bool = False


@dataclass
class WorkerSpec:
    """What a new worker sandbox hosts: sub-env ``indices`` built from env_fns ``origins``."""

    name: str
    indices: list[int]
    origins: list[int]


@dataclass(frozen=True)
class CloneOrder:
    """One clone of a fork: branch sub-env ``branch_index`` continues the source's
    sub-env ``source_index`` (reseeded with ``seed`` unless None), in a sandbox ``spec``."""

    spec: WorkerSpec
    source_index: int
    branch_index: int
    seed: int | None


class Watch(Protocol):
    """How the controller watches a sandbox: a pidfd (process hosts), a thread (inline),
    a VM's QEMU process."""

    def alive(self) -> bool:
        """Is it running (a zombie is not)?"""
        ...

    def kill(self, sig: int = ...) -> None:
        """Send it a signal (SIGKILL by default)."""
        ...

    def wait_dead(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for it to be gone; True once it is."""
        ...

    def close(self) -> None:
        """Let go of what watches it."""
        ...


@dataclass
class WorkerHandle:
    """A running worker sandbox as the controller sees it.

    Concurrency: used from the controller's calling thread only.
    """

    name: str
    indices: list[int]
    channel: Channel
    pid: int
    watch: Watch
    origins: list[int] = field(default_factory=list)
    output: OutputCollector | None = None
    awaiting: int = 0  # seq of the reply this worker still owes, 0 if none
    dead: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    host_data: Any = None  # what the host keeps per sandbox (side socket, VM)
    output_key: str = ""  # its pipes' key in ``output``; "" for str(pid)

    def output_tail(self, stream: str = "stderr") -> str:
        """The last bytes this sandbox wrote on ``stream``."""
        key = self.output_key or str(self.pid)
        return self.output.tail(key, stream) if self.output is not None else ""

    def alive(self) -> bool:
        """False once the sandbox is known dead (checked with its pidfd)."""
        if self.dead:
            return False
        if not self.watch.alive():
            self.dead = True
        return not self.dead

    def stopped(self) -> str:
        """``"T"`` while the sandbox is stopped by a signal (SIGSTOP, SIGTSTP, ...), ``"t"``
        while it is held in a tracing stop, ``""`` otherwise (running, sleeping, dead).

        Read from ``/proc/<pid>/stat`` with the handle's pid (in the controller's pid
        namespace), and believed only if the pidfd still says the process has not exited
        afterwards: an exited process keeps its pid until it is reaped, so the state
        read was its own, never that of another process given the pid since."""
        if self.dead:
            return ""
        state = process_state(self.pid)
        if state not in ("T", "t") or not self.alive():
            return ""
        return state

    def resume(self) -> None:
        """SIGCONT the sandbox (through its pidfd)."""
        self.watch.kill(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the sandbox; :meth:`alive` is False from now on."""
        self.watch.kill()
        self.dead = True

    def release(self) -> None:
        """Close the controller's ends of this sandbox (it must be dead or closed).

        Its scratch directory is removed too, when it is a host path (inside a
        namespaced tree the warm parent removes it)."""
        scratch = self.info.get("scratch")
        if is_scratch_dir(scratch):  # a sandbox's word: only ever a gym_fork scratch dir
            remove_scratch(scratch)
        close = getattr(self.host_data, "close", None)
        if close is not None:
            close()
        self.host_data = None
        if self.output is not None:
            self.output.forget(self.output_key or str(self.pid))
        self.watch.close()
        self.channel.close()


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``R``, ``S``, ``T``,
    ``t``, ``Z``, ...), ``""`` when it cannot be read (gone, no such /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    # The name in parentheses may hold anything, ")" too: the state follows the last one.
    rest = stat[stat.rfind(b")") + 1 :].split(None, 1)
    return rest[0].decode("ascii", "replace") if rest else ""


@dataclass
class IsolationReport:
    """What separates sandboxes on a host, as achieved there (never as hoped).

    ``missing`` maps each layer the host could not give to the reason; ``details`` holds
    host-specific facts (address space, accelerator, guest kernel, image digest).
    """

    host: str
    network: str
    namespaces: dict[str, bool]
    private_tmp: bool
    no_new_privs: bool
    limits: dict[str, Any]
    missing: dict[str, str]
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The flat dictionary ``ForkVectorEnv.isolation`` shows and the lineage records."""
        return {
            "host": self.host,
            **self.details,
            "network": self.network,
            "namespaces": dict(self.namespaces),
            "private_tmp": self.private_tmp,
            "no_new_privs": self.no_new_privs,
            "limits": dict(self.limits),
            "missing": dict(self.missing),
        }


# ``ask(op, arg)``: send a request to the worker being forked (through the pool of the
# vector env that owns it) and return its reply's result.
AskWorker = Callable[[int, Any], Any]
# ``ask_later(op, arg)``: the same request sent now; the function it returns waits for
# the result (so that several workers can work on their requests at once).
AskLater = Callable[[int, Any], Callable[[], Any]]


@dataclass
class ForkJob:
    """The clones one running worker is to make: an order and a slab memfd each."""

    source: WorkerHandle
    orders: list[CloneOrder]
    slab_fds: list[int]
    ask_later: AskLater

    def ask(self, op: int, arg: Any) -> Any:
        """A request to the source, waited for."""
        return self.ask_later(op, arg)()


class Host(Protocol):
    """A sandbox backend. Every method is called from the controller's thread."""

    kind: str
    # The warm parent's process (host pid): a process host's tree, a microVM's QEMU, the
    # controller itself for inline; provenance records it (-1 before it started).
    pid: int
    # The process a clone of the warm parent is forked from, whose CUDA state it would
    # inherit; None where clones are not forked processes (VMs, inline).
    gpu_pid: int | None
    output: OutputCollector | None
    slab_min_bytes: int  # a slab memfd is sized to at least this (a VM's fixed device)

    def spawn(
        self,
        specs: Sequence[WorkerSpec],
        slab_fds: Sequence[int],
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """Clone the warm parent once per spec, handing worker k the slab memfd
        ``slab_fds[k]`` (its own rows only); each worker sends a HELLO when built (with
        ``attach``, the pickled attach argument, it maps its slab first)."""
        ...

    def fork_soon(self, sources: Sequence[WorkerHandle]) -> None:
        """A fork of ``sources`` begins (its fork_many follows): start what can go on
        while the controller prepares it. Nothing a fork that never comes would need
        undone."""
        ...

    def fork_many(
        self,
        jobs: Sequence[ForkJob],
        num_envs: int,
        ring_capacity: int,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[list[WorkerHandle]]:
        """Clone each job's running, idle source worker once per order (clone k with the
        slab memfd ``slab_fds[k]``; each clone sends a HELLO), the sources working at
        once where the host can; the clones of each job, in order. ``ask_later`` reaches
        a source through its own vector env. ``meanwhile`` (work that needs no clone) is
        called once, while the sources fork where the host can. If one fails, every
        clone made is killed and released."""
        ...

    def alive(self) -> bool:
        """Is the warm parent still able to make sandboxes?"""
        ...

    def tree(self) -> list[WorkerHandle]:
        """The live sandboxes of this warm parent (of every vector env sharing it) that
        can signal one another, the suspects when one is found stopped; an empty list
        where sandboxes cannot signal each other (each VM has its own kernel; inline)."""
        ...

    def exit_code(self, worker: WorkerHandle) -> int | None:
        """A dead worker's exit code (negative: a signal), None when unknown."""
        ...

    def isolation(
        self, sandbox: dict[str, Any] | None = None, pid: int | None = None
    ) -> IsolationReport:
        """The isolation achieved: one sandbox's own report (its HELLO), checked where
        the host can against what the kernel says about that sandbox's process ``pid``
        (a host pid)."""
        ...

    def measure_born(self, worker: WorkerHandle) -> None:
        """The sandbox ``worker`` has done its set-up and has not said HELLO yet (a
        fork's clones once :meth:`fork_many` returns): a host that measures a sandbox's
        process from outside does it now, while the sandbox finishes, and the next
        :meth:`isolation` of its pid takes that measure (once, while it lives)."""
        ...

    def check_slab(self, nbytes: int) -> None:
        """Refuse (ValueError) a batch slab this host's sandboxes cannot map."""
        ...

    def acquire(self) -> Host:
        """One more vector env (a root or a branch) uses this warm parent."""
        ...

    def release(self) -> None:
        """A user is done; the last one closes the host."""
        ...

    def close(self) -> None:
        """Stop the warm parent and every sandbox made from it."""
        ...


class SharedByBranches:
    """Reference counting of a warm parent shared by a vector env and its branches."""

    _users: int = 1

    def acquire(self) -> Self:
        """One more vector env uses this host."""
        self._users += 1
        return self

    def release(self) -> None:
        """A user is done; the last one closes the host."""
        self._users -= 1
        if self._users <= 0:
            self.close()

    def fork(
        self,
        source: WorkerHandle,
        orders: Sequence[CloneOrder],
        num_envs: int,
        slab_fds: Sequence[int],
        ring_capacity: int,
        ask: AskWorker,
    ) -> list[WorkerHandle]:  # pragma: no cover - every host defines it
        raise NotImplementedError

    def fork_soon(self, sources: Sequence[WorkerHandle]) -> None:
        """Nothing to start ahead of a fork."""

    def fork_many(
        self,
        jobs: Sequence[ForkJob],
        num_envs: int,
        ring_capacity: int,
        meanwhile: Callable[[], None] | None = None,
    ) -> list[list[WorkerHandle]]:
        """One source after the other (hosts whose clones cannot overlap); ``meanwhile``
        first."""
        if meanwhile is not None:
            meanwhile()
        made: list[list[WorkerHandle]] = []
        try:
            for job in jobs:
                made.append(
                    self.fork(
                        job.source, job.orders, num_envs, job.slab_fds, ring_capacity, job.ask
                    )
                )
        except BaseException:
            release_all(h for handles in made for h in handles)
            raise
        return made

    def close(self) -> None:  # pragma: no cover - every host defines it
        raise NotImplementedError


def release_all(handles: Iterable[WorkerHandle]) -> None:
    """Kill and release sandboxes that will not be used (a failed spawn or fork)."""
    for handle in handles:
        handle.kill()
        handle.release()
