"""The PNG picture of a lineage log's branch trees (matplotlib: extra ``plots``), drawn
from the placement :mod:`gym_fork.lineage.picture` makes for its HTML page; matplotlib is
imported only when a PNG is drawn. Text is drawn without parsing it as mathtext (a log is
not trusted).
"""

from __future__ import annotations

import os
from typing import Any

from .nodes import BranchNode, indices_text
from .picture import clip_text, colours, placed_trees


def png_unavailable() -> str | None:
    """Why :func:`render_png` cannot draw here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--png needs matplotlib: pip install 'gym_fork[plots]'"
    return None


def render_png(
    events: list[dict[str, Any]],
    path: str | os.PathLike,
    *,
    title: str = "gym_fork lineage",
    root: str | None = None,
    last: int | None = None,
    since: float | None = None,
    dpi: int = 110,
) -> None:
    """Draw the branch trees of ``events`` into a PNG at ``path``, one labelled band per
    run, chosen as :func:`render_html` chooses (needs matplotlib:
    ``pip install 'gym_fork[plots]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyBboxPatch, PathPatch
        from matplotlib.path import Path as MplPath
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("--png needs matplotlib: pip install 'gym_fork[plots]'") from exc
    placed = placed_trees(events, root, last, since)
    nodes = placed.nodes
    col_w, row_h, box_w, box_h = 3.3, 1.1, 2.7, 0.9  # inches
    width_in = 0.4 + (placed.cols - 1) * col_w + box_w
    height_in = 0.9 + max(placed.rows - 1, 0) * row_h + box_h
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
        col, row = placed.spots[node.key]
        return col * col_w, row * row_h + 0.2

    for band in placed.bands:
        top = band.top * row_h + 0.2 - 0.06
        ax.add_patch(
            FancyBboxPatch(
                (-0.1, top),
                (band.width - 1) * col_w + box_w + 0.2,
                (band.height - 1) * row_h + box_h + 0.12,
                boxstyle="round,pad=0,rounding_size=0.06",
                facecolor="#fafafa",
                edgecolor="#cfd8dc",
                linewidth=0.8,
            )
        )
        ax.text(
            0,
            top + 0.22,
            band.run.label(int(((band.width - 1) * col_w + box_w) * 15)),
            fontsize=7.5,
            fontweight="bold",
            color="#37474f",
            va="center",
            parse_math=False,
        )
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
                f"{indices_text(kid.source_indices)} x{kid.copies}",
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
            clip_text(node.branch_id, 30),
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
                clip_text(line, 46),
                fontsize=6.8,
                family="monospace",
                va="center",
                color=colour,
                parse_math=False,
            )
    fig.savefig(os.fspath(path), dpi=dpi, facecolor="white")
    plt.close(fig)
