"""The ``gym-fork`` command line."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gym-fork``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="gym-fork", description="gym_fork tools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the drop-in swap from AsyncVectorEnv, and its speed")
    demo.add_argument("--num-envs", type=int, default=8)
    demo.add_argument("--steps", type=int, default=3000)
    sub.add_parser("doctor", help="what this host supports and what gym_fork will use")
    lineage = sub.add_parser("lineage", help="print the branch tree of a lineage log")
    lineage.add_argument("log", nargs="?", help="a lineage JSONL log (default: the default log)")
    image = sub.add_parser("image", help="microVM guest image and kernel")
    image.add_argument("action", choices=["build", "kernel", "show"])
    image.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from gym_fork.demo import run

        run(args.num_envs, args.steps)
    elif args.command == "doctor":
        from gym_fork.doctor import run

        return run()
    elif args.command == "image":
        return _image(args.action, args.force)
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
        print(render_tree(events) or "(no branches in this log)")
    return 0


def _image(action: str, force: bool) -> int:
    """``gym-fork image build|kernel|show``: the microVM guest pieces."""
    from gym_fork.hosts.microvm.image import ImageError, build_image
    from gym_fork.hosts.microvm.kernel import KernelNotFound, fetch_debian_kernel, find_kernel

    try:
        if action == "kernel":
            kernel = fetch_debian_kernel()
            print(f"guest kernel {kernel.version}: {kernel.vmlinuz}")
        elif action == "build":
            image = build_image(force=force, log=print)
            print(f"image {image.digest}: {image.root} + {image.initramfs}")
        else:
            kernel = find_kernel()
            image = build_image(log=print)
            print(f"kernel  {kernel.version} ({kernel.vmlinuz})")
            print(f"image   {image.digest}: {image.files} files, {image.root_bytes >> 20} MiB")
            print(f"python  {image.python}")
    except (ImageError, KernelNotFound) as exc:
        print(f"gym-fork image {action}: {exc}")
        return 2
    return 0
