"""Branch records of one lineage tree (a root vector env and every branch forked from it)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from .log import LineageLog, valid_events


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
        event = {
            "event": "root_ready" if record.parent_branch_id is None else "branch_created",
            **{k: v for k, v in asdict(record).items() if k != "events"},
        }
        if record.parent_branch_id is None:
            event["baseline_inputs"] = self.inputs
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


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}
# Line separators and bidirectional overrides: text that reorders or splits what is shown.
_CONTROL.update({c: f"\\u{c:04x}" for c in (0x2028, 0x2029, *range(0x202A, 0x202F))})
_CONTROL.update({c: f"\\u{c:04x}" for c in range(0x2066, 0x206A)})


def printable(text: Any) -> str:
    """``text`` with its control characters (C0, DEL, C1, line separators, bidi
    overrides) escaped as ``\\xNN``/``\\uNNNN``: a string from a log never moves a
    terminal's cursor, retitles or clears it, or reorders what is shown."""
    return str(text).translate(_CONTROL)


def render_tree(events: list[dict[str, Any]]) -> str:
    """A text tree of the branches in a lineage log (several roots allowed).

    Malformed events are skipped (:func:`~gym_fork.lineage.log.event_problem`); the
    first record of a branch id counts; a branch hangs under its parent only if the
    parent was recorded before it (so a log never makes a cycle), else it is a root."""
    nodes: dict[str, dict[str, Any]] = {}
    children: dict[str | None, list[str]] = {}
    orphans: list[str] = []
    for e in valid_events(events):
        branch_id = e.get("branch_id")
        if e["event"] in ("root_ready", "branch_created"):
            if branch_id in nodes:
                continue
            parent = e.get("parent_branch_id")
            if parent is None:
                children.setdefault(None, []).append(branch_id)
            elif parent in nodes:  # recorded before it (never itself)
                children.setdefault(parent, []).append(branch_id)
            else:  # its parent is not in the log (or only after it)
                orphans.append(branch_id)
            nodes[branch_id] = dict(e)
        elif e["event"] == "closed" and branch_id in nodes:
            nodes[branch_id]["exit_status"] = e.get("exit_status")
        elif branch_id in nodes:
            nodes[branch_id].setdefault("n_events", 0)
            nodes[branch_id]["n_events"] += 1

    def label(node: dict[str, Any]) -> str:
        status = node.get("exit_status") or "open"
        if node.get("parent_branch_id") is None:
            text = f"{node['branch_id']} baseline={node.get('baseline_id')} x{node.get('num_envs')}"
        else:
            text = (
                f"{node['branch_id']} from {node.get('source_indices')} x{node.get('copies')}"
                f" -> {node.get('num_envs')} sub-envs"
            )
            if node.get("seeds") and any(s is not None for s in node["seeds"]):
                text += f" reseeded {node['seeds']}"
        return printable(f"{text} [{status}]")

    lines: list[str] = []
    # Iterative depth-first walk: a deep chain of branches never hits the recursion limit.
    stack: list[tuple[str, str, bool, bool]] = [
        (root, "", True, True) for root in reversed(children.get(None, []) + orphans)
    ]
    while stack:
        branch_id, prefix, last, top = stack.pop()
        connector = "" if top else ("└── " if last else "├── ")
        lines.append(prefix + connector + label(nodes[branch_id]))
        kids = children.get(branch_id, [])
        extension = "" if top else ("    " if last else "│   ")
        for i in reversed(range(len(kids))):
            stack.append((kids[i], prefix + extension, i == len(kids) - 1, False))
    return "\n".join(lines)
