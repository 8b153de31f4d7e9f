"""Pictures of a lineage log: where each branch tree sits (one labelled band per run:
start time, script, env ids; :mod:`gym_fork.lineage.runs`; the trees of a run side by
side) and the self-contained HTML page (inline SVG, no scripts, no network) of them. The
PNG (matplotlib, extra ``plots``) is drawn by :mod:`gym_fork.lineage.png` from the same
placement.

``gym-fork lineage --html out.html --png out.png [LOG]`` writes both (of the latest run).

A log is not trusted (a sandbox may have written lines into it): only typed events are
drawn, every string from it is HTML-escaped (``html.escape``, quotes too) in text and
attributes alike, the page has no script, and the PNG draws text without parsing it as
mathtext.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from .nodes import (  # noqa: F401 (branch_nodes, select_trees: re-exported)
    BranchNode,
    branch_nodes,
    indices_text,
    layout_tree,
    local_time,
    select_trees,
    short_list,
)
from .runs import Run, pick

# Box colours by exit status: (stroke, fill).
STATUS_COLOURS = {
    "closed": ("#2e7d32", "#e8f5e9"),
    "terminated": ("#ef6c00", "#fff3e0"),
    "open": ("#1565c0", "#e3f2fd"),
}
FAILED_COLOURS = ("#c62828", "#ffebee")  # any other status (a crash, a failure)


def colours(status: str) -> tuple[str, str]:
    """(stroke, fill) of a box for this exit status."""
    return STATUS_COLOURS.get(status, FAILED_COLOURS)


# -- layout: one labelled band per run ----------------------------------------------------

LABEL_ROWS = 0.4  # the band's label line, in rows
BAND_GAP = 0.35  # rows between two bands
LINE_GAP = 0.25  # rows between two lines of trees in one band
MAX_COLS = 5  # trees of a run sit side by side up to this many columns, then wrap


@dataclass
class Band:
    """The band of one run: its label's run, top row, height in rows, width in columns."""

    run: Run
    top: float
    height: float
    width: int


@dataclass
class Placement:
    """Where everything goes, in columns (x) and rows (y): every drawn branch and band."""

    nodes: dict[str, BranchNode]
    spots: dict[str, tuple[float, float]]
    bands: list[Band]
    cols: int
    rows: float


def _members(nodes: dict[str, BranchNode], root: str) -> list[str]:
    out, stack = [], [root]
    while stack:
        branch_id = stack.pop()
        out.append(branch_id)
        stack.extend(reversed(nodes[branch_id].children))
    return out


def place(nodes: dict[str, BranchNode], runs: list[Run]) -> Placement:
    """Lay out ``runs``: each a band headed by its label (time, script, envs), its trees
    side by side (wrapping after :data:`MAX_COLS` columns, or the widest tree), so a run
    of many small trees is a block, not one tall column."""
    spots: dict[str, tuple[float, float]] = {}
    drawn: dict[str, BranchNode] = {}
    bands: list[Band] = []
    top = 0.0
    for run in runs:
        trees = []
        for root in run.roots:
            members = _members(nodes, root)
            height = layout_tree(nodes, root)
            trees.append((members, max(nodes[m].depth for m in members) + 1, height))
        limit = max([MAX_COLS, *(width for _, width, _ in trees)])
        line_top, x, line_height, band_width = top + LABEL_ROWS, 0, 0.0, 1
        for members, width, height in trees:
            if x and x + width > limit:
                line_top, x, line_height = line_top + line_height + LINE_GAP, 0, 0.0
            for m in members:
                spots[m] = (x + nodes[m].depth, line_top + nodes[m].row)
                drawn[m] = nodes[m]
            x += width
            line_height = max(line_height, height)
            band_width = max(band_width, x)
        bottom = line_top + line_height
        bands.append(Band(run, top, bottom - top, band_width))
        top = bottom + BAND_GAP
    cols = max((b.width for b in bands), default=1)
    return Placement(drawn, spots, bands, cols, top - BAND_GAP if bands else 0.0)


# -- HTML -------------------------------------------------------------------------------

BOX_W, BOX_H, COL_W, ROW_H, MARGIN = 285, 72, 350, 88, 16
BAND_PAD = 8

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222; }
h1 { font-size: 1.3em; } h2 { font-size: 1.1em; margin-top: 2em; }
.meta { color: #555; font-size: 0.9em; }
.tree { overflow-x: auto; border: 1px solid #ddd; border-radius: 6px; padding: 8px; }
svg text { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; }
table { border-collapse: collapse; font-size: 0.85em; margin-top: 0.5em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f5f5f5; position: sticky; top: 0; }
th.run { background: #eceff1; position: static; font-weight: 600; }
td.num { text-align: right; }
td.pids { max-width: 28em; word-break: break-word; font-family: ui-monospace, monospace; }
.status { font-weight: 600; }
.legend span { display: inline-block; margin-right: 1.2em; }
.legend i { display: inline-block; width: 0.9em; height: 0.9em; border: 2px solid;
  border-radius: 3px; vertical-align: middle; margin-right: 0.3em; }
"""


def _svg(placed: Placement) -> str:
    nodes, spots = placed.nodes, placed.spots
    if not nodes:
        return "<p>(no branches in this log)</p>"
    width = int(MARGIN * 2 + (placed.cols - 1) * COL_W + BOX_W)
    height = int(MARGIN * 2 + (placed.rows - 1) * ROW_H + BOX_H)

    def x(node: BranchNode) -> float:
        return MARGIN + spots[node.key][0] * COL_W

    def y(node: BranchNode) -> float:
        return MARGIN + spots[node.key][1] * ROW_H

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="branch tree">'
    ]
    for band in placed.bands:
        bx, by = MARGIN - BAND_PAD, MARGIN + band.top * ROW_H - BAND_PAD / 2
        bw = (band.width - 1) * COL_W + BOX_W + 2 * BAND_PAD
        bh = (band.height - 1) * ROW_H + BOX_H + BAND_PAD
        out.append(
            f'<rect x="{bx:.0f}" y="{by:.0f}" width="{bw:.0f}" height="{bh:.0f}" rx="6" '
            f'fill="#fafafa" stroke="#cfd8dc" stroke-width="1"/>'
        )
        out.append(
            f'<text x="{bx + BAND_PAD:.0f}" y="{by + 20:.0f}" font-size="12" fill="#37474f" '
            f'font-weight="bold">{html.escape(band.run.label(int(bw / 7.5)))}</text>'
        )
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
            label = f"{indices_text(kid.source_indices)} x{kid.copies}"
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
                f"pids: {short_list(node.pids, 16)}",
            ]
        )
        out.append(f"<g><title>{html.escape(tooltip)}</title>")
        out.append(
            f'<rect x="{x(node):.0f}" y="{y(node):.0f}" width="{BOX_W}" height="{BOX_H}" '
            f'rx="7" fill="{fill}" stroke="{stroke}" stroke-width="2"/>'
        )
        out.append(
            f'<text x="{x(node) + 8:.0f}" y="{y(node) + 17:.0f}" font-size="12" '
            f'font-weight="bold">{html.escape(clip_text(node.branch_id, 32))}</text>'
        )
        for k, line in enumerate(lines):
            out.append(
                f'<text x="{x(node) + 8:.0f}" y="{y(node) + 33 + 14 * k:.0f}" font-size="10.5">'
                f"{html.escape(clip_text(line, 43))}</text>"
            )
        out.append("</g>")
    out.append("</svg>")
    return "\n".join(out)


def clip_text(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(placed: Placement) -> str:
    head = (
        "<tr><th>branch</th><th>parent</th><th>sub-envs</th><th>from (indices x copies)</th>"
        "<th>seeds</th><th>created</th><th>timings</th><th>lifetime</th><th>exit status</th>"
        "<th>events</th><th>pids</th></tr>"
    )
    rows = []
    for band in placed.bands:
        heading = band.run.heading() if band.run.recorded else band.run.label()
        rows.append(f'<tr><th class="run" colspan="11">{html.escape(heading)}</th></tr>')
        for root in band.run.roots:
            for branch_id in _members(placed.nodes, root):  # depth-first, in log order
                rows.append(_table_row(placed.nodes[branch_id]))
    return "<table>\n" + head + "\n" + "\n".join(rows) + "\n</table>"


def _table_row(node: BranchNode) -> str:
    stroke, _ = colours(node.status)
    origin = (
        ""
        if node.parent_branch_id is None
        else f"{indices_text(node.source_indices)} x{node.copies}"
    )
    lifetime = f"{node.lifetime:.3f} s" if node.lifetime is not None else ""
    cells = [
        f"<td>{'&nbsp;' * 3 * node.depth}{html.escape(node.branch_id)}</td>",
        f"<td>{html.escape(node.parent_branch_id or '-')}</td>",
        f'<td class="num">{node.num_envs}</td>',
        f"<td>{html.escape(origin)}</td>",
        f"<td>{html.escape(short_list(node.seeds or [], 8) if node.seeds_text() else '')}</td>",
        f"<td>{local_time(node.created, ms=True)}</td>",
        f"<td>{html.escape(node.timing_text())}</td>",
        f'<td class="num">{lifetime}</td>',
        f'<td class="status" style="color:{stroke}">{html.escape(node.status)}</td>',
        f'<td class="num">{node.n_events}</td>',
        f'<td class="pids">{html.escape(", ".join(str(p) for p in node.pids))}</td>',
    ]
    return "<tr>" + "".join(cells) + "</tr>"


def placed_trees(
    events: list[dict[str, Any]], root: str | None, last: int | None, since: float | None
) -> Placement:
    nodes, runs = pick(events, root=root, last=last, since=since)
    return place(nodes, runs)


def render_html(
    events: list[dict[str, Any]],
    *,
    title: str = "gym_fork lineage",
    source: str | None = None,
    root: str | None = None,
    last: int | None = None,
    since: float | None = None,
) -> str:
    """A self-contained HTML page (inline SVG and CSS, no scripts, nothing fetched) of the
    branch trees in ``events``, one labelled band per run: ids, parents, seeds, timings,
    exit status, pids, sub-envs. ``root``/``last``/``since`` choose the runs as
    :func:`~gym_fork.lineage.runs.select_runs` does (none given: every run)."""
    placed = placed_trees(events, root, last, since)
    nodes = placed.nodes
    trees = sum(len(b.run.roots) for b in placed.bands)
    baselines = sorted({n.baseline_id for n in nodes.values() if n.baseline_id})
    legend = "".join(
        f'<span><i style="border-color:{s};background:{f}"></i>{name}</span>'
        for name, (s, f) in [*STATUS_COLOURS.items(), ("failed", FAILED_COLOURS)]
    )
    meta = (
        f"{len(placed.bands)} run(s): {trees} tree(s), {len(nodes)} vector env(s), "
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
{_svg(placed)}
</div>
<h2>Branches</h2>
{_table(placed)}
</body>
</html>
"""
