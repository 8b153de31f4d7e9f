"""The ``gym-fork`` command line."""

from __future__ import annotations

import argparse
import sys

from gym_fork._version import __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gym-fork``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="gym-fork", description="gym_fork tools")
    parser.add_argument("--version", action="version", version=f"gym-fork {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the drop-in swap from AsyncVectorEnv, and its speed")
    demo.add_argument("--num-envs", type=int, default=8)
    demo.add_argument("--steps", type=int, default=3000)
    sub.add_parser("doctor", help="what this host supports and what gym_fork will use")
    lineage = sub.add_parser(
        "lineage", help="print (or draw as HTML/PNG) the branch tree of a lineage log"
    )
    lineage.add_argument("log", nargs="?", help="a lineage JSONL log (default: the default log)")
    lineage.add_argument("--html", metavar="OUT", help="write a self-contained HTML page")
    lineage.add_argument("--png", metavar="OUT", help="write a PNG image (needs matplotlib)")
    lineage.add_argument("--root", metavar="BRANCH_ID", help="only the tree holding this branch")
    lineage.add_argument("--last", type=int, metavar="N", help="only the last N trees")
    lineage.add_argument("--title", default="gym_fork lineage", help="title of the picture")
    image = sub.add_parser("image", help="microVM guest image and kernel")
    image.add_argument("action", choices=["build", "kernel", "show", "clear-cache"])
    image.add_argument("--force", action="store_true", help="rebuild even if cached")
    image.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    bench = sub.add_parser(
        "bench", help="ForkVectorEnv against Async/SyncVectorEnv and cold starts, in one run"
    )
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller runs (under a minute)")
    size.add_argument("--tiny", action="store_true", help="every figure once, in seconds")
    bench.add_argument("--json", metavar="OUT", help="write the results as JSON")
    bench.add_argument("--plots", metavar="DIR", help="write PNG plots (needs matplotlib)")
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from gym_fork.demo import run

        run(args.num_envs, args.steps)
    elif args.command == "doctor":
        from gym_fork.doctor import run

        return run()
    elif args.command == "image":
        return _image(args.action, args.force, args.quiet)
    elif args.command == "bench":
        from gym_fork.bench.run import main as bench

        mode = "quick" if args.quick else "tiny" if args.tiny else "full"
        return bench(mode=mode, json_path=args.json, plots_dir=args.plots, quiet=args.quiet)
    elif args.command == "lineage":
        from gym_fork.lineage import default_log_path, read_log, render_tree

        path = args.log or default_log_path()
        if path is None:
            parser.error("no log given and the default log is disabled")
        try:
            events = read_log(path)
        except FileNotFoundError:
            print(f"gym-fork lineage: no such log: {path}")
            return 2
        except OSError as exc:  # a symlink (not followed), a FIFO, a directory, ...
            print(f"gym-fork lineage: cannot read {path}: {exc}")
            return 2
        if events.skipped:
            print(
                f"gym-fork lineage: {events.skipped} malformed line(s) of {path} skipped",
                file=sys.stderr,
            )
        if args.html or args.png:
            return _pictures(events, str(path), args)
        if args.root is not None or args.last is not None:
            parser.error("--root and --last go with --html or --png")
        print(render_tree(events) or "(no branches in this log)")
    return 0


def _pictures(events: list[dict], source: str, args: argparse.Namespace) -> int:
    """``gym-fork lineage --html/--png``: draw the branch trees of a log."""
    from gym_fork.lineage.picture import branch_nodes, render_html, render_png, select_trees

    nodes, roots = branch_nodes(events)
    try:
        roots = select_trees(nodes, roots, root=args.root, last=args.last)
    except KeyError as exc:
        print(f"gym-fork lineage: {exc.args[0]}")
        return 2
    options = {"title": args.title, "root": args.root, "last": args.last}
    if args.html:
        page = render_html(events, source=source, **options)
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(page)
        print(f"wrote {args.html} ({len(roots)} tree(s))")
    if args.png:
        try:
            render_png(events, args.png, **options)
        except ImportError as exc:
            print(f"gym-fork lineage: {exc}")
            return 2
        print(f"wrote {args.png} ({len(roots)} tree(s))")
    return 0


def _image(action: str, force: bool, quiet: bool = False) -> int:
    """``gym-fork image build|kernel|show|clear-cache``: the microVM guest pieces."""
    from gym_fork.hosts.microvm.image import ImageError, build_image
    from gym_fork.hosts.microvm.kernel import KernelNotFound, fetch_debian_kernel, find_kernel

    if action == "clear-cache":
        from gym_fork.hosts.microvm.template_cache import cache_dir, clear

        print(f"removed {clear()} boot template file(s) from {cache_dir()}")
        return 0
    try:
        if action == "kernel":
            kernel = fetch_debian_kernel(quiet=quiet)
            print(f"guest kernel {kernel.version}: {kernel.vmlinuz}")
        elif action == "build":
            image = build_image(force=force, log=print, quiet=quiet)
            print(f"image {image.digest}: {image.root} + {image.initramfs}")
        else:
            kernel = find_kernel()
            image = build_image(log=print, quiet=quiet)
            print(f"kernel  {kernel.version} ({kernel.vmlinuz})")
            print(f"image   {image.digest}: {image.files} files, {image.root_bytes >> 20} MiB")
            print(f"python  {image.python}")
    except (ImageError, KernelNotFound) as exc:
        print(f"gym-fork image {action}: {exc}")
        return 2
    return 0
