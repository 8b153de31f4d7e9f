"""Pictures of a lineage log: a self-contained HTML page (inline SVG, no scripts, no
network) and a PNG (matplotlib, extra ``plots``) of its branch trees.

``gym-fork lineage --html out.html --png out.png [LOG]`` writes both.

A log is not trusted (a sandbox may have written lines into it): only typed events are
drawn, every string from it is HTML-escaped (``html.escape``, quotes too) in text and
attributes alike, the page has no script, and the PNG draws text without parsing it as
mathtext.
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass, field
from typing import Any

from .log import valid_events

# Box colours by exit status: (stroke, fill).
STATUS_COLOURS = {
    "closed": ("#2e7d32", "#e8f5e9"),
    "terminated": ("#ef6c00", "#fff3e0"),
    "open": ("#1565c0", "#e3f2fd"),
}
FAILED_COLOURS = ("#c62828", "#ffebee")  # any other status (a crash, a failure)


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
    children: list[str] = field(default_factory=list)
    up: str | None = None  # the branch it is drawn under (None: the root of a tree)
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
        return f"{_indices(self.source_indices)} x{self.copies} -> {self.num_envs} sub-envs"

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
        if all(isinstance(v, int) for v in seeds) and seeds == list(
            range(seeds[0], seeds[0] + len(seeds))  # type: ignore[arg-type]
        ):
            return f"{seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])
        return _short_list(seeds, 6)

    def detail(self) -> str:
        """The third line of its box: the baseline of a root, the seeds of a branch."""
        if self.parent_branch_id is None:
            return f"baseline {self.baseline_id}"
        seeds = self.seeds_text()
        return f"reseeded {seeds}" if seeds else "replays its source (no reseed)"


def _indices(values: list[int]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _short_list(values: list[Any], keep: int) -> str:
    if len(values) <= keep:
        return "[" + ", ".join(str(v) for v in values) + "]"
    shown = ", ".join(str(v) for v in values[:keep])
    return f"[{shown}, ... +{len(values) - keep}]"


def branch_nodes(events: list[dict[str, Any]]) -> tuple[dict[str, BranchNode], list[str]]:
    """The branches of a lineage log by id, laid out (``depth``, ``row``), and the root
    ids in log order. Malformed events are skipped
    (:func:`~gym_fork.lineage.log.event_problem`) and the first record of an id counts;
    a branch hangs under its parent only if the parent was recorded before it (so a log
    never makes a cycle), else it counts as a root, as one whose parent is not in the
    log does."""
    nodes: dict[str, BranchNode] = {}
    roots: list[str] = []
    for e in valid_events(events):
        kind, branch_id = e["event"], e.get("branch_id")
        if kind in ("root_ready", "branch_created") and branch_id not in nodes:
            node = BranchNode(
                branch_id=branch_id,
                parent_branch_id=e.get("parent_branch_id"),
                baseline_id=e.get("baseline_id"),
                num_envs=e.get("num_envs") or 0,
                source_indices=list(e.get("source_indices") or []),
                copies=e.get("copies") or 1,
                seeds=e.get("seeds"),
                created=e.get("created"),
                timings=dict(e.get("timings") or {}),
                pids=list(e.get("pids") or []),
            )
            if node.parent_branch_id in nodes:  # recorded before it
                node.up = node.parent_branch_id
                nodes[node.up].children.append(branch_id)
            else:
                roots.append(branch_id)
            nodes[branch_id] = node
        elif kind == "closed" and branch_id in nodes:
            nodes[branch_id].exit_status = e.get("exit_status")
            nodes[branch_id].closed = e.get("closed")
        elif branch_id in nodes:
            nodes[branch_id].n_events += 1
    _layout(nodes, roots)
    return nodes, roots


def _layout(nodes: dict[str, BranchNode], roots: list[str]) -> None:
    """Leaves take consecutive rows in depth-first order, a parent sits midway between
    its first and last child; one empty row between trees."""
    next_row = 0.0

    def place(branch_id: str, depth: int) -> None:
        nonlocal next_row
        node = nodes[branch_id]
        node.depth = depth
        stack = [(branch_id, depth, False)]
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

    for root in roots:
        place(root, 0)
        next_row += 1


def select_trees(
    nodes: dict[str, BranchNode],
    roots: list[str],
    *,
    root: str | None = None,
    last: int | None = None,
) -> list[str]:
    """The roots to draw: the tree holding branch ``root``, or the ``last`` N trees."""
    if root is not None:
        if root not in nodes:
            raise KeyError(f"no branch {root!r} in this log")
        current = root
        while nodes[current].up is not None:  # parents come earlier: this ends
            current = nodes[current].up  # type: ignore[assignment]
        return [current]
    if last is not None:
        return roots[-last:] if last > 0 else []
    return roots


def _subtree(nodes: dict[str, BranchNode], roots: list[str]) -> dict[str, BranchNode]:
    """The nodes of the trees under ``roots``, laid out again on their own."""
    keep: dict[str, BranchNode] = {}
    stack = list(roots)
    while stack:
        branch_id = stack.pop()
        keep[branch_id] = nodes[branch_id]
        stack.extend(nodes[branch_id].children)
    _layout(keep, roots)
    return keep


def colours(status: str) -> tuple[str, str]:
    """(stroke, fill) of a box for this exit status."""
    return STATUS_COLOURS.get(status, FAILED_COLOURS)


# -- HTML -------------------------------------------------------------------------------

BOX_W, BOX_H, COL_W, ROW_H, MARGIN = 285, 72, 350, 88, 16

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 2em; }
.meta { color: #555; font-size: 0.9em; }
.tree { overflow-x: auto; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
svg text { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; }
table { border-collapse: collapse; font-size: 0.85em; margin-top: 0.5em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; position: sticky; top: 0; }
td.num { text-align: right; }
td.pids { max-width: 28em; word-break: break-word; font-family: ui-monospace, monospace; }
.status { font-weight: 600; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 0.9em; height: 0.9em; border: 2px solid;
  border-radius: 3px; vertical-align: middle; margin-right: 0.3em; }
"""


def _svg(nodes: dict[str, BranchNode], roots: list[str]) -> str:
    if not nodes:
        return "<p>(no branches in this log)</p>"
    depth = max(n.depth for n in nodes.values())
    rows = max(n.row for n in nodes.values()) + 1
    width = int(MARGIN * 2 + depth * COL_W + BOX_W)
    height = int(MARGIN * 2 + rows * ROW_H)

    def x(node: BranchNode) -> float:
        return MARGIN + node.depth * COL_W

    def y(node: BranchNode) -> float:
        return MARGIN + node.row * ROW_H

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="branch tree">'
    ]
    for node in nodes.values():
        for kid_id in node.children:
            kid = nodes[kid_id]
            x0, y0 = x(node) + BOX_W, y(node) + BOX_H / 2
            x1, y1 = x(kid), y(kid) + BOX_H / 2
            mid = (x0 + x1) / 2
            out.append(
                f'<path d="M{x0:.0f},{y0:.0f} C{mid:.0f},{y0:.0f} {mid:.0f},{y1:.0f} '
                f'{x1:.0f},{y1:.0f}" fill="none" stroke="#999" stroke-width="1.5"/>'
            )
            label = f"{_indices(kid.source_indices)} x{kid.copies}"
            out.append(
                f'<text x="{x1 - 6:.0f}" y="{y1 - 4:.0f}" font-size="10" fill="#666" '
                f'text-anchor="end">{html.escape(label)}</text>'
            )
    for node in nodes.values():
        stroke, fill = colours(node.status)
        lines = [node.summary(), node.detail(), f"{node.status}  {node.timing_text()}".strip()]
        seeds = node.seeds_text()
        tooltip = "\n".join(
            [
                node.branch_id,
                f"parent: {node.parent_branch_id or '-'}",
                node.summary(),
                f"seeds: {seeds or '-'}",
                f"timings: {node.timing_text() or '-'}",
                f"exit status: {node.status}",
                f"pids: {_short_list(node.pids, 16)}",
            ]
        )
        out.append(f"<g><title>{html.escape(tooltip)}</title>")
        out.append(
            f'<rect x="{x(node):.0f}" y="{y(node):.0f}" width="{BOX_W}" height="{BOX_H}" '
            f'rx="7" fill="{fill}" stroke="{stroke}" stroke-width="2"/>'
        )
        out.append(
            f'<text x="{x(node) + 8:.0f}" y="{y(node) + 17:.0f}" font-size="12" '
            f'font-weight="bold">{html.escape(_clip(node.branch_id, 32))}</text>'
        )
        for k, line in enumerate(lines):
            out.append(
                f'<text x="{x(node) + 8:.0f}" y="{y(node) + 33 + 14 * k:.0f}" font-size="10.5">'
                f"{html.escape(_clip(line, 43))}</text>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _when(stamp: float | None) -> str:
    if stamp is None:
        return ""
    try:
        when = time.localtime(stamp)
    except (OverflowError, OSError, ValueError):  # a time no clock shows
        return html.escape(repr(stamp))
    return time.strftime("%Y-%m-%d %H:%M:%S", when) + f".{int(stamp % 1 * 1000):03d}"


def _table(nodes: dict[str, BranchNode], roots: list[str]) -> str:
    head = (
        "<tr><th>branch</th><th>parent</th><th>sub-envs</th><th>from (indices x copies)</th>"
        "<th>seeds</th><th>created</th><th>timings</th><th>lifetime</th><th>exit status</th>"
        "<th>events</th><th>pids</th></tr>"
    )
    rows = []
    for root in roots:
        stack = [root]
        while stack:  # depth-first, children in log order
            node = nodes[stack.pop()]
            stack.extend(reversed(node.children))
            stroke, _ = colours(node.status)
            origin = (
                ""
                if node.parent_branch_id is None
                else f"{_indices(node.source_indices)} x{node.copies}"
            )
            lifetime = f"{node.lifetime:.3f} s" if node.lifetime is not None else ""
            cells = [
                f"<td>{'&nbsp;' * 3 * node.depth}{html.escape(node.branch_id)}</td>",
                f"<td>{html.escape(node.parent_branch_id or '-')}</td>",
                f'<td class="num">{node.num_envs}</td>',
                f"<td>{html.escape(origin)}</td>",
                f"<td>{html.escape(_short_list(node.seeds, 8) if node.seeds_text() else '')}</td>",
                f"<td>{_when(node.created)}</td>",
                f"<td>{html.escape(node.timing_text())}</td>",
                f'<td class="num">{lifetime}</td>',
                f'<td class="status" style="color:{stroke}">{html.escape(node.status)}</td>',
                f'<td class="num">{node.n_events}</td>',
                f'<td class="pids">{html.escape(", ".join(str(p) for p in node.pids))}</td>',
            ]
            rows.append("<tr>" + "".join(cells) + "</tr>")
    return "<table>\n" + head + "\n" + "\n".join(rows) + "\n</table>"


def render_html(
    events: list[dict[str, Any]],
    *,
    title: str = "gym_fork lineage",
    source: str | None = None,
    root: str | None = None,
    last: int | None = None,
) -> str:
    """A self-contained HTML page (inline SVG and CSS, no scripts, nothing fetched) of the
    branch trees in ``events``: ids, parents, seeds, timings, exit status, pids, sub-envs.
    ``root``/``last``: only the tree holding that branch, or the last N trees."""
    nodes, roots = branch_nodes(events)
    roots = select_trees(nodes, roots, root=root, last=last)
    nodes = _subtree(nodes, roots)
    baselines = sorted({n.baseline_id for n in nodes.values() if n.baseline_id})
    legend = "".join(
        f'<span><i style="border-color:{s};background:{f}"></i>{name}</span>'
        for name, (s, f) in [*STATUS_COLOURS.items(), ("failed", FAILED_COLOURS)]
    )
    meta = (
        f"{len(roots)} tree(s), {len(nodes)} vector env(s), "
        f"{sum(n.num_envs for n in nodes.values())} sub-envs in all"
        + (f"; baseline {html.escape(', '.join(baselines))}" if baselines else "")
        + (f"; log {html.escape(source)}" if source else "")
    )
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{CSS}</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">{meta}</p>
<p class="legend">{legend}</p>
<div class="tree">
{_svg(nodes, roots)}
</div>
<h2>Branches</h2>
{_table(nodes, roots)}
</body>
</html>
"""


# -- PNG --------------------------------------------------------------------------------


def render_png(
    events: list[dict[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "gym_fork lineage",
    root: str | None = None,
    last: int | None = None,
    dpi: int = 110,
) -> None:
    """Draw the branch trees of ``events`` into a PNG at ``path`` (needs matplotlib:
    ``pip install 'gym_fork[plots]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, PathPatch
        from matplotlib.path import Path as MplPath
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("--png needs matplotlib: pip install 'gym_fork[plots]'") from exc
    nodes, roots = branch_nodes(events)
    roots = select_trees(nodes, roots, root=root, last=last)
    nodes = _subtree(nodes, roots)
    depth = max((n.depth for n in nodes.values()), default=0)
    rows = max((n.row for n in nodes.values()), default=0) + 1
    col_w, box_w, box_h = 3.3, 2.7, 0.9  # inches; one row is 1.1 inch
    width_in = 0.4 + (depth * col_w + box_w)
    height_in = 0.9 + rows * 1.1
    # Agg refuses images over 2**16 pixels a side: lower the resolution for huge trees.
    dpi = int(min(dpi, 60000 / max(width_in, height_in)))
    fig = plt.figure(figsize=(width_in, height_in), dpi=dpi)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.2, width_in - 0.2)
    ax.set_ylim(height_in - 0.5, -0.6)
    ax.axis("off")
    # Text from the log is drawn as it is: never parsed as mathtext ("$...$").
    ax.text(0, -0.3, title, fontsize=11, fontweight="bold", va="center", parse_math=False)

    def xy(node: BranchNode) -> tuple[float, float]:
        return node.depth * col_w, node.row * 1.1 + 0.2

    for node in nodes.values():
        x0, y0 = xy(node)
        for kid_id in node.children:
            kid = nodes[kid_id]
            x1, y1 = xy(kid)
            ya, yb, mid = y0 + box_h / 2, y1 + box_h / 2, (x0 + box_w + x1) / 2
            curve = MplPath(
                [(x0 + box_w, ya), (mid, ya), (mid, yb), (x1, yb)],
                [MplPath.MOVETO, MplPath.CURVE4, MplPath.CURVE4, MplPath.CURVE4],
            )
            ax.add_patch(PathPatch(curve, facecolor="none", edgecolor="#999", linewidth=1.1))
            ax.text(
                x1 - 0.06,
                y1 + box_h / 2 - 0.08,
                f"{_indices(kid.source_indices)} x{kid.copies}",
                fontsize=6.5,
                color="#666",
                ha="right",
                va="bottom",
                parse_math=False,
            )
    for node in nodes.values():
        x0, y0 = xy(node)
        stroke, fill = colours(node.status)
        ax.add_patch(
            FancyBboxPatch(
                (x0, y0),
                box_w,
                box_h,
                boxstyle="round,pad=0,rounding_size=0.08",
                facecolor=fill,
                edgecolor=stroke,
                linewidth=1.6,
            )
        )
        ax.text(
            x0 + 0.08,
            y0 + 0.18,
            _clip(node.branch_id, 30),
            fontsize=8,
            fontweight="bold",
            family="monospace",
            va="center",
            parse_math=False,
        )
        status = f"{node.status}  {node.timing_text()}".strip()
        for k, (line, colour) in enumerate(
            [(node.summary(), "black"), (node.detail(), "#444"), (status, stroke)]
        ):
            ax.text(
                x0 + 0.08,
                y0 + 0.38 + 0.19 * k,
                _clip(line, 46),
                fontsize=6.8,
                family="monospace",
                va="center",
                color=colour,
                parse_math=False,
            )
    fig.savefig(os.fspath(path), dpi=dpi, facecolor="white")
    plt.close(fig)
