"""The ``gym-fork`` command line."""

from __future__ import annotations

import argparse

from gym_fork._version import __version__
from gym_fork.lineage import command as lineage_command


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gym-fork``; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="gym-fork",
        description="gym_fork tools: try the drop-in swap, check this host, see the branch "
        "trees of your runs, build microVM images, benchmark.",
        epilog="'gym-fork COMMAND -h' tells more of each command.",
    )
    parser.add_argument(
        "--version", action="version", version=f"gym-fork {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="the drop-in swap from AsyncVectorEnv, and its speed",
        description="Run CartPole-v1 in ForkVectorEnv and in SyncVectorEnv, check that both "
        "give the same trajectory, and print the steps per second of each.",
    )
    demo.add_argument(
        "--num-envs", type=int, default=8, help="sub-envs of each vector env (default: 8)"
    )
    demo.add_argument(
        "--steps", type=int, default=3000, help="steps each vector env takes (default: 3000)"
    )
    doctor = sub.add_parser(
        "doctor",
        help="what this host supports and what gym_fork will use (only looks: builds "
        "nothing, writes nothing)",
    )
    doctor.add_argument(
        "--json",
        action="store_true",
        help="print the checks as JSON (schema gym_fork.doctor/1: name, status, detail, "
        "required, data of each)",
    )
    lineage = lineage_command.add_parser(sub)
    image = sub.add_parser(
        "image",
        help="microVM guest image and kernel",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="actions:\n"
        "  build        build the guest image this environment would use (cached)\n"
        "  kernel       download Debian's kernel into the cache (apt-get download)\n"
        "  show         what the image would pack and whether it is cached (builds nothing)\n"
        "  clear-cache  remove the cached guest images and boot templates (not kernels),\n"
        "               except images a running process uses; says how much it freed",
    )
    image.add_argument(
        "action",
        choices=["build", "kernel", "show", "clear-cache"],
        help="what to do (see the actions above)",
    )
    image.add_argument("--force", action="store_true", help="build: rebuild even if cached")
    image.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    bench = sub.add_parser(
        "bench",
        help="ForkVectorEnv against Async/SyncVectorEnv and cold starts, in one run",
        description="Measure on this machine: step throughput of ForkVectorEnv against "
        "AsyncVectorEnv and SyncVectorEnv, fork and clone times, cold starts and memory. "
        "Without --quick or --tiny: the full run (minutes).",
    )
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller runs (under a minute)")
    size.add_argument("--tiny", action="store_true", help="every figure once, in seconds")
    bench.add_argument("--json", metavar="OUT", help="write the results as JSON to OUT")
    bench.add_argument(
        "--plots", metavar="DIR", help="write PNG plots into DIR (needs matplotlib: extra 'plots')"
    )
    bench.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from gym_fork.demo import run

        run(args.num_envs, args.steps)
    elif args.command == "doctor":
        from gym_fork.doctor import run

        return run(as_json=args.json)
    elif args.command == "image":
        return _image(args.action, args.force, args.quiet)
    elif args.command == "bench":
        from gym_fork.bench.run import main as bench

        mode = "quick" if args.quick else "tiny" if args.tiny else "full"
        return bench(mode=mode, json_path=args.json, plots_dir=args.plots, quiet=args.quiet)
    elif args.command == "lineage":
        return lineage_command.run(args, lineage)
    return 0


def _image(action: str, force: bool, quiet: bool = False) -> int:
    """``gym-fork image build|kernel|show|clear-cache``: the microVM guest pieces."""
    from gym_fork.hosts.microvm.building.image import ImageError, build_image, plan_image
    from gym_fork.hosts.microvm.building.kernel import KernelNotFound, fetch_debian_kernel

    if action == "clear-cache":
        from gym_fork.hosts.microvm.building.image_cache import clear, images_dir

        done = clear()
        print(
            f"removed {done.images} guest image(s) and {done.boot_templates} boot template "
            f"file(s): {done.freed_bytes / 2**20:.0f} MiB freed ({images_dir().parent})"
        )
        if done.kept_in_use:
            print(f"kept {len(done.kept_in_use)} image(s) a running process may use")
        return 0
    try:
        if action == "kernel":
            kernel = fetch_debian_kernel(quiet=quiet)
            print(f"guest kernel {kernel.version}: {kernel.vmlinuz}")
        elif action == "build":
            image = build_image(force=force, log=print, quiet=quiet)
            print(f"image {image.digest}: {image.root} + {image.initramfs}")
        else:
            plan = plan_image()
            state = "cached" if plan.cached else f"not built (~{plan.estimate_s():.0f} s to build)"
            print(f"kernel  {plan.kernel.version} ({plan.kernel.vmlinuz})")
            print(f"image   {plan.digest}: {state}")
            print(f"packs   {plan.files} files, {plan.packed_bytes / 2**20:.0f} MiB")
            print(f"from    {plan.selection.describe()}")
            print(f"python  {plan.python}")
    except (ImageError, KernelNotFound, ValueError) as exc:
        print(f"gym-fork image {action}: {exc}")
        return 2
    return 0
