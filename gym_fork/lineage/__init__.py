"""Provenance: baseline ids, branch records and runs, the append-only lineage log (rotated)
and its trees."""

from gym_fork.lineage.baseline import baseline_id, baseline_inputs
from gym_fork.lineage.log import (
    LineageLog,
    LogRefused,
    default_log_path,
    read_log,
    read_logs,
)
from gym_fork.lineage.picture import render_html  # noqa: F401 (re-export)
from gym_fork.lineage.png import render_png  # noqa: F401 (re-export)
from gym_fork.lineage.runs import Run, current_run, parse_since
from gym_fork.lineage.tree import Lineage, LineageTree, render_tree

__all__ = [
    "Lineage",
    "LineageLog",
    "LineageTree",
    "LogRefused",
    "Run",
    "baseline_id",
    "baseline_inputs",
    "current_run",
    "default_log_path",
    "parse_since",
    "read_log",
    "read_logs",
    "render_tree",
]
