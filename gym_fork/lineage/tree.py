"""Branch records of one lineage tree (a root vector env and every branch forked from it)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .log import LineageLog
from .nodes import BranchNode, printable
from .runs import current_run, pick

__all__ = ["BranchRecord", "Lineage", "LineageTree", "printable", "render_tree"]


@dataclass
class BranchRecord:
    """Provenance of one vector env: a root (parent_branch_id None) or a branch."""

    branch_id: str
    parent_branch_id: str | None
    baseline_id: str
    num_envs: int
    source_indices: list[int] = field(default_factory=list)
    copies: int = 1
    seeds: list[int | None] | None = None
    created: float = field(default_factory=time.time)
    closed: float | None = None
    exit_status: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    isolation: dict[str, Any] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    gpu_memory_created: int | None = None  # bytes on GPUs held by its sandboxes (NVML)
    gpu_memory_closed: int | None = None
    run: dict[str, Any] | None = None  # of a root: who made it, when, where (runs.current_run)
    events: list[dict[str, Any]] = field(default_factory=list)


class LineageTree:
    """Shared by a root and its branches: ids are unique within it, events go to one log."""

    def __init__(self, log: LineageLog, baseline_id: str, inputs: dict[str, Any]) -> None:
        self.log = log
        self.baseline_id = baseline_id
        self.inputs = inputs
        self.branches: dict[str, BranchRecord] = {}
        self._lock = threading.Lock()

    @staticmethod
    def new_root_id() -> str:
        return f"root-{uuid.uuid4().hex[:8]}"

    def add(self, record: BranchRecord) -> None:
        with self._lock:
            if record.branch_id in self.branches:
                raise ValueError(
                    f"branch id {record.branch_id!r} is already used in this lineage tree"
                )
            self.branches[record.branch_id] = record
        if record.parent_branch_id is None and record.run is None:
            record.run = current_run(env_ids=self.inputs.get("env_ids") or [])
        # Written as JSON at once: its fields as they are (plain data), not deep copies.
        event = {
            "event": "root_ready" if record.parent_branch_id is None else "branch_created",
            **{f.name: getattr(record, f.name) for f in fields(record) if f.name != "events"},
        }
        if record.parent_branch_id is None:
            event["baseline_inputs"] = self.inputs
        else:
            del event["run"]
        self.log.append(event)

    def check_free(self, branch_id: str) -> None:
        if not isinstance(branch_id, str) or not branch_id:
            raise ValueError(f"branch_id must be a non-empty str, got {branch_id!r}")
        if branch_id in self.branches:
            raise ValueError(f"branch id {branch_id!r} is already used in this lineage tree")

    def event(self, branch_id: str, kind: str, **fields: Any) -> None:
        """Record an event (a replacement, a reset by clone, ...) of one branch."""
        entry = {"event": kind, "branch_id": branch_id, "time": time.time(), **fields}
        self.branches[branch_id].events.append(entry)
        self.log.append(entry)

    def close(self, branch_id: str, exit_status: str, gpu_memory: int | None = None) -> None:
        record = self.branches[branch_id]
        if record.closed is not None:
            return
        record.closed = time.time()
        record.exit_status = exit_status
        record.gpu_memory_closed = gpu_memory
        self.log.append(
            {
                "event": "closed",
                "branch_id": branch_id,
                "closed": record.closed,
                "exit_status": exit_status,
                "gpu_memory": gpu_memory,
            }
        )


class Lineage:
    """``envs.lineage``: this vector env's record and its place in the tree."""

    def __init__(self, tree: LineageTree, branch_id: str) -> None:
        self.tree = tree
        self.branch_id = branch_id

    @property
    def record(self) -> BranchRecord:
        return self.tree.branches[self.branch_id]

    @property
    def parent_branch_id(self) -> str | None:
        return self.record.parent_branch_id

    @property
    def baseline_id(self) -> str:
        return self.tree.baseline_id

    def children(self) -> list[str]:
        return [b for b, r in self.tree.branches.items() if r.parent_branch_id == self.branch_id]

    def ancestors(self) -> list[str]:
        out, current = [], self.record.parent_branch_id
        while current is not None:
            out.append(current)
            current = self.tree.branches[current].parent_branch_id
        return out

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.record)

    def __repr__(self) -> str:
        return (
            f"Lineage(branch_id={self.branch_id!r}, parent={self.parent_branch_id!r}, "
            f"baseline_id={self.baseline_id!r})"
        )


def render_tree(
    events: list[dict[str, Any]],
    *,
    root: str | None = None,
    last: int | None = None,
    since: float | None = None,
) -> str:
    """A text tree of the branches in a lineage log, run by run (several roots allowed),
    each run headed by its start time, script and envs (:meth:`Run.heading`; a root with
    no run record gets no heading). ``root``/``last``/``since`` choose runs as
    :func:`~gym_fork.lineage.runs.select_runs` does; none given: every run.

    Malformed events are skipped (:func:`~gym_fork.lineage.log.event_problem`); the
    first record of a branch id counts; a branch hangs under its parent only if the
    parent was recorded before it (so a log never makes a cycle), else it is a root."""
    nodes, runs = pick(events, root=root, last=last, since=since)
    blocks = []
    for run in runs:
        lines = [run.heading()] if run.recorded else []
        lines += _tree_lines(nodes, run.roots)
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if any(r.recorded for r in runs) else "\n".join(blocks)


def _label(node: BranchNode) -> str:
    if node.parent_branch_id is None:
        text = f"{node.branch_id} baseline={node.baseline_id} x{node.num_envs}"
    else:
        text = (
            f"{node.branch_id} from {node.source_indices} x{node.copies}"
            f" -> {node.num_envs} sub-envs"
        )
        if node.seeds and any(s is not None for s in node.seeds):
            text += f" reseeded {node.seeds}"
    return printable(f"{text} [{node.status}]")


def _tree_lines(nodes: dict[str, BranchNode], roots: list[str]) -> list[str]:
    lines: list[str] = []
    # Iterative depth-first walk: a deep chain of branches never hits the recursion limit.
    stack: list[tuple[str, str, bool, bool]] = [(r, "", True, True) for r in reversed(roots)]
    while stack:
        branch_id, prefix, last, top = stack.pop()
        connector = "" if top else ("└── " if last else "├── ")
        lines.append(prefix + connector + _label(nodes[branch_id]))
        kids = nodes[branch_id].children
        extension = "" if top else ("    " if last else "│   ")
        for i in reversed(range(len(kids))):
            stack.append((kids[i], prefix + extension, i == len(kids) - 1, False))
    return lines
