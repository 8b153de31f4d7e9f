"""The isolation report of a process sandbox or tree: what separates its sandboxes, as
the kernel says it achieved (gym_fork/system/measure.py), for ``ProcessHost.isolation``
(``host.py``), which is :func:`isolation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from gym_fork.hosts.base import IsolationReport, WorkerHandle
from gym_fork.system.measure import Measured, achieved, measure

if TYPE_CHECKING:
    from gym_fork.hosts.process.host import ProcessHost


def isolation(
    host: ProcessHost, sandbox: dict[str, Any] | None = None, pid: int | None = None
) -> IsolationReport:
    """What separates sandboxes on this host, as achieved (not as hoped).

    ``sandbox`` is the report of one sandbox (its HELLO); without it, the tree's.
    With ``pid`` (that sandbox's host pid) the namespaces, no_new_privs, seccomp,
    capabilities and the read-only view are what the kernel says about the process
    (gym_fork/system/measure.py), not what the sandbox said: env code may have run
    in it before it reported.
    """
    report = sandbox or {"tree": {}, "sandbox": {}, "limits": {}, "missing": {}}
    measured = None
    if pid is not None:
        watch, measured = host._born_measures.pop(pid, (None, None))
        if watch is None or not watch.alive():  # else the pid is still the one measured
            measured = measure(pid, _writable(host))
    seen = achieved(
        report.get("tree") or host.tree_isolation.get("tree", {}),
        report.get("sandbox", {}),
        {**host.tree_isolation.get("missing", {}), **report.get("missing", {})},
        measured,
        _others(host, pid),
        host.config.isolation,
    )
    return IsolationReport(
        host=host.kind,
        network="off" if seen.namespaces["net"] else "host",
        namespaces=seen.namespaces,
        private_tmp=seen.private_tmp,
        no_new_privs=seen.no_new_privs,
        limits=report.get("limits", {}),
        missing=seen.missing,
        details={"process": True, "address_space": "copy-on-write fork", **seen.details},
    )


def measure_born(host: ProcessHost, worker: WorkerHandle) -> None:
    """Measure ``worker``'s process now, for the next :func:`isolation` of its pid (taken
    while that process lives: its pid cannot name another then): a fork's clone
    whose source has replied (a source replies once every clone of its FORK has done its
    set-up: its namespaces, /tmp, identity and confinement are final), while it maps its
    slab and says HELLO (~1 ms of /proc reads the controller would make after the HELLO,
    on a fork's critical path, made while it waits). Env code may run in it meanwhile
    (a reseed), as it did before the measure of old; a process can only add to its
    isolation, and a lie of its source's (a reply before the set-up) could only make it
    look less isolated. A few at most are kept (those of forks that failed before their
    report); two threads forking on one host may evict at once."""
    born = host._born_measures
    while len(born) >= 8:
        with contextlib.suppress(StopIteration, RuntimeError):  # emptied, or changed
            born.pop(next(iter(born)), None)
    born[worker.pid] = (worker.watch, measure(worker.pid, _writable(host)))


def _writable(host: ProcessHost) -> frozenset[str]:
    return frozenset(host.config.isolation.shared_writable())


def _measured_once(host: ProcessHost, pid: int) -> Measured | None:
    """What the kernel said about ``pid`` when first asked (namespaces and layers are
    a sandbox's from its set-up on): each fork measures its new sandbox only."""
    cache = host._measure_cache
    if pid not in cache:
        live = {h.pid for h in host.tree()} | {host.pid}
        for gone in [p for p in cache if p not in live]:
            del cache[gone]  # a dead sandbox's pid may be reused
        cache[pid] = measure(pid)
    return cache[pid]


def _others(host: ProcessHost, pid: int | None) -> Iterator[tuple[int, Measured | None]]:
    """The warm parent and the other live sandboxes of this tree (host pids), each
    with what the kernel says about it."""
    # The newest 16: a branch's source is among them when the branch is new, and
    # the cost stays bounded in a tree search of thousands of sandboxes.
    others = [h.pid for h in host.tree() if h.pid != pid][-16:]
    for other in ([host.pid] if host.pid else []) + others:
        yield other, _measured_once(host, other)
