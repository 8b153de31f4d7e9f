"""``gym-fork lineage``: the branch trees of a lineage log, run by run, as text, an HTML
page or a PNG. With no option it shows the latest run (all roots the newest controller
process made); ``--last N``, ``--since WHEN``, ``--root ID`` and ``--all`` choose others,
in every output alike."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .log import default_log_path, read_logs
from .picture import render_html
from .png import png_unavailable, render_png
from .rotation import KEEP
from .runs import parse_since, pick
from .tree import render_tree

DESCRIPTION = f"""\
Print (or draw as HTML/PNG) the branch trees of a lineage log, one run at a time.
A run is what one controller process recorded (told apart by host, pid and the
process's start time); each is headed by its start time, script, env ids, pid, host and
working dir. Without an option: the latest run. The log's rotated files (LOG.1 ..
LOG.{KEEP}) are read too."""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _since(text: str) -> float:
    try:
        return parse_since(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``lineage`` subcommand's parser, added to ``sub`` (argparse subparsers)."""
    parser = sub.add_parser(
        "lineage",
        help="show the branch trees of your latest run (text, HTML or PNG)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "log",
        nargs="?",
        help="a lineage JSONL log (default: $GYM_FORK_LINEAGE_LOG, else "
        "$XDG_STATE_HOME/gym_fork/lineage.jsonl, i.e. ~/.local/state/gym_fork/lineage.jsonl)",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--last", type=_positive, metavar="N", help="the last N runs (default: the last 1)"
    )
    which.add_argument(
        "--root",
        metavar="BRANCH_ID",
        help="only the tree holding this branch (a root's or any branch's id), under its run",
    )
    which.add_argument("--all", action="store_true", help="every run of the log")
    parser.add_argument(
        "--since",
        type=_since,
        metavar="WHEN",
        help="only runs started since WHEN: a duration ago (30s, 10m, 2h, 1d) or a local "
        "ISO date/time (2026-12-01, 2026-12-01T10:00); with --last: the last N of those",
    )
    parser.add_argument(
        "--html", metavar="OUT", help="write a self-contained HTML page (no scripts) to OUT"
    )
    parser.add_argument(
        "--png", metavar="OUT", help="write a PNG image to OUT (needs matplotlib: extra 'plots')"
    )
    parser.add_argument(
        "--title",
        default="gym_fork lineage",
        help="title of the HTML page and the PNG (default: gym_fork lineage)",
    )
    return parser


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Carry out ``gym-fork lineage``; returns the exit status."""
    if args.since is not None and (args.root is not None or args.all):
        parser.error("--since goes with --last or alone, not with --root or --all")
    path = args.log or default_log_path()
    if path is None:
        parser.error("no log given and the default log is disabled ($GYM_FORK_LINEAGE_LOG='')")
    try:
        events = read_logs(path)
    except FileNotFoundError:
        print(f"gym-fork lineage: no such log: {path}")
        return 2
    except OSError as exc:  # a symlink (not followed), a FIFO, a directory, ...
        print(f"gym-fork lineage: cannot read {path}: {exc}")
        return 2
    for refusal in events.refused:
        print(f"gym-fork lineage: rotated file not read: {refusal}", file=sys.stderr)
    if events.skipped:
        print(
            f"gym-fork lineage: {events.skipped} malformed line(s) of {path} skipped",
            file=sys.stderr,
        )
    last = args.last
    if last is None and args.root is None and args.since is None and not args.all:
        last = 1  # the latest run
    choice = {"root": args.root, "last": last, "since": args.since}
    try:
        _, runs = pick(events, **choice)
    except KeyError as exc:
        print(f"gym-fork lineage: {exc.args[0]}")
        return 2
    if not runs:
        print("(no runs since then)" if args.since is not None else "(no branches in this log)")
        return 0
    if args.html or args.png:
        return _pictures(events, str(path), args, choice, len(runs))
    print(render_tree(events, **choice))
    return 0


def _pictures(
    events: list[dict], source: str, args: argparse.Namespace, choice: dict, runs: int
) -> int:
    missing = png_unavailable() if args.png else None
    if missing is not None:  # before writing anything: all or nothing
        print(f"gym-fork lineage: {missing}")
        return 2
    if args.html:
        page = render_html(events, source=source, title=args.title, **choice)
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
        print(f"wrote {args.html} ({runs} run(s))")
    if args.png:
        try:
            render_png(events, args.png, title=args.title, **choice)
        except ImportError as exc:
            print(f"gym-fork lineage: {exc}")
            return 2
        print(f"wrote {args.png} ({runs} run(s))")
    return 0
