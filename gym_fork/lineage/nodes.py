"""The branches of a lineage log as nodes (a root or a branch each, with its children and
the run record of a root), the trees' text layout, and how a string from the log is shown."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from gym_fork.text_safety import escape_controls

from .log import valid_events


def printable(text: Any) -> str:
    """``text`` on one line with its control characters (C0, DEL, C1, line separators,
    bidi overrides) escaped (gym_fork.text_safety): a string from a log never moves a
    terminal's cursor, retitles or clears it, or reorders what is shown."""
    return escape_controls(str(text), one_line=True)


def local_time(stamp: float | None, *, ms: bool = False) -> str:
    """A Unix time as local ``YYYY-mm-dd HH:MM:SS`` (``.mmm`` with ``ms``); "time ?"
    for one no clock shows (a log is not trusted), "" for None."""
    if stamp is None:
        return ""
    try:
        text = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):
        return "time ?"
    return text + (f".{int(stamp % 1 * 1000):03d}" if ms else "")


@dataclass
class BranchNode:
    """One vector env of a lineage log (a root or a branch) and its place in the picture."""

    branch_id: str
    parent_branch_id: str | None
    baseline_id: str | None
    num_envs: int
    source_indices: list[int] = field(default_factory=list)
    copies: int = 1
    seeds: list[int | None] | None = None
    created: float | None = None
    closed: float | None = None
    exit_status: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    n_events: int = 0
    run: dict[str, Any] | None = None  # the run record of a root (None: not recorded)
    children: list[str] = field(default_factory=list)
    key: str = ""  # its key among the nodes of a log (the id, unique: branch_nodes)
    up: str | None = None  # the key it is drawn under (None: the root of a tree)
    depth: int = 0
    row: float = 0.0

    @property
    def status(self) -> str:
        """The exit status, or "open" while the log has no close for it."""
        return self.exit_status or "open"

    @property
    def lifetime(self) -> float | None:
        """Seconds from creation to close (None while open)."""
        if self.created is None or self.closed is None:
            return None
        return self.closed - self.created

    def summary(self) -> str:
        """One line: where it came from and how many sub-envs it has."""
        if self.parent_branch_id is None:
            return f"root, {self.num_envs} sub-envs"
        return f"{indices_text(self.source_indices)} x{self.copies} -> {self.num_envs} sub-envs"

    def timing_text(self) -> str:
        """Its timings in ms, e.g. ``fork 12.3 ms``."""
        names = {"fork_s": "fork", "parent_ready_s": "parent", "sandboxes_ready_s": "sandboxes"}
        parts = []
        for key, seconds in self.timings.items():
            ms = seconds * 1000
            parts.append(
                f"{names.get(key, key.removesuffix('_s'))} {ms:.{0 if ms >= 100 else 1}f} ms"
            )
        return ", ".join(parts)

    def seeds_text(self) -> str:
        """The reseeds of a branch, or an empty string when it replays its source."""
        if not self.seeds or all(s is None for s in self.seeds):
            return ""
        seeds = self.seeds
        ints = [v for v in seeds if isinstance(v, int)]
        if len(ints) == len(seeds) and ints == list(range(ints[0], ints[0] + len(ints))):
            return f"{ints[0]}..{ints[-1]}" if len(ints) > 1 else str(ints[0])
        return short_list(seeds, 6)

    def detail(self) -> str:
        """The third line of its box: the baseline of a root, the seeds of a branch."""
        if self.parent_branch_id is None:
            return f"baseline {self.baseline_id}"
        seeds = self.seeds_text()
        return f"reseeded {seeds}" if seeds else "replays its source (no reseed)"


def indices_text(values: list[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def short_list(values: list[Any], keep: int) -> str:
    if len(values) <= keep:
        return "[" + ", ".join(str(v) for v in values) + "]"
    shown = ", ".join(str(v) for v in values[:keep])
    return f"[{shown}, ... +{len(values) - keep}]"


def branch_nodes(events: list[dict[str, Any]]) -> tuple[dict[str, BranchNode], list[str]]:
    """The branches of a lineage log by key, laid out (``depth``, ``row``), and the keys
    of the roots in log order. A key is the branch id, made unique (``id#2``, ...) where
    another tree of the log uses the same id (a script run twice with fixed ids).

    Malformed events are skipped (:func:`~gym_fork.lineage.log.event_problem`). A root
    record starts a new tree; a branch hangs under the latest node of its parent's id,
    only if that was recorded before it (so a log never makes a cycle), else it counts
    as a root, as one whose parent is not in the log does; within one tree the first
    record of an id counts. A close or other event goes to the latest node of its id."""
    nodes: dict[str, BranchNode] = {}
    roots: list[str] = []
    latest: dict[str, str] = {}  # branch id -> key of its latest node
    in_tree: set[tuple[str, str]] = set()  # (key of the tree's root, branch id)
    tree: dict[str, str] = {}  # key -> key of its tree's root
    for e in valid_events(events):
        kind, branch_id = e["event"], e.get("branch_id")
        if kind in ("root_ready", "branch_created"):
            new_id: str = e["branch_id"]  # a str in these events (event_problem)
            parent = e.get("parent_branch_id")
            up = latest.get(parent) if kind == "branch_created" and parent is not None else None
            if up is not None and (tree[up], new_id) in in_tree:
                continue  # a second record of this id in this tree
            key, n = new_id, 1
            while key in nodes:
                n += 1
                key = f"{new_id}#{n}"
            node = BranchNode(
                branch_id=new_id,
                parent_branch_id=parent,
                baseline_id=e.get("baseline_id"),
                num_envs=e.get("num_envs") or 0,
                source_indices=list(e.get("source_indices") or []),
                copies=e.get("copies") or 1,
                seeds=e.get("seeds"),
                created=e.get("created"),
                timings=dict(e.get("timings") or {}),
                pids=list(e.get("pids") or []),
                run=e.get("run") if parent is None else None,
                key=key,
            )
            if up is not None:  # recorded before it
                node.up = up
                nodes[up].children.append(key)
                tree[key] = tree[up]
            else:
                roots.append(key)
                tree[key] = key
            in_tree.add((tree[key], new_id))
            nodes[key] = node
            latest[new_id] = key
        elif branch_id in latest:
            node = nodes[latest[branch_id]]
            if kind == "closed":
                node.exit_status = e.get("exit_status")
                node.closed = e.get("closed")
            else:
                node.n_events += 1
    _layout(nodes, roots)
    return nodes, roots


def _layout(nodes: dict[str, BranchNode], roots: list[str]) -> None:
    """Each tree from the next free row (:func:`layout_tree`), one empty row between trees."""
    next_row = 0.0
    for root in roots:
        next_row = layout_tree(nodes, root, next_row) + 1


def layout_tree(nodes: dict[str, BranchNode], root: str, first_row: float = 0.0) -> float:
    """Lay out the tree under ``root``: leaves take consecutive rows from ``first_row`` in
    depth-first order, a parent sits midway between its first and last child. Returns
    the row after its last leaf."""
    next_row = first_row
    stack = [(root, 0, False)]
    # Iterative post-order, so that a deep chain of branches never hits the recursion limit.
    while stack:
        current, level, expanded = stack.pop()
        item = nodes[current]
        item.depth = level
        if not item.children:
            item.row = next_row
            next_row += 1
        elif not expanded:
            stack.append((current, level, True))
            stack.extend((kid, level + 1, False) for kid in reversed(item.children))
        else:
            item.row = (nodes[item.children[0]].row + nodes[item.children[-1]].row) / 2
    return next_row


def select_trees(
    nodes: dict[str, BranchNode],
    roots: list[str],
    *,
    root: str | None = None,
    last: int | None = None,
) -> list[str]:
    """The roots to draw: the tree holding branch ``root``, or the ``last`` N trees."""
    if root is not None:
        return [tree_of(nodes, root)]
    if last is not None:
        return roots[-last:] if last > 0 else []
    return roots


def tree_of(nodes: dict[str, BranchNode], branch_id: str) -> str:
    """The key of the root of the tree holding the latest node of ``branch_id`` (a key
    works too; KeyError naming it if it is not there)."""
    keys = [k for k, node in nodes.items() if node.branch_id == branch_id]
    if not keys and branch_id not in nodes:
        raise KeyError(f"no branch {branch_id!r} in this log")
    current = keys[-1] if keys else branch_id
    while nodes[current].up is not None:  # parents come earlier: this ends
        current = nodes[current].up  # type: ignore[assignment]
    return current
