"""Provenance: baseline ids, branch records, the append-only lineage log and its tree."""

from gym_fork.lineage.baseline import baseline_id, baseline_inputs
from gym_fork.lineage.log import LineageLog, LogRefused, default_log_path, read_log
from gym_fork.lineage.picture import render_html, render_png  # noqa: F401 (re-export)
from gym_fork.lineage.tree import Lineage, LineageTree, render_tree

__all__ = [
    "Lineage",
    "LineageLog",
    "LineageTree",
    "LogRefused",
    "baseline_id",
    "baseline_inputs",
    "default_log_path",
    "read_log",
    "render_tree",
]
