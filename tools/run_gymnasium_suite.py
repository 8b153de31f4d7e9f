"""Run Gymnasium's own vector tests against AsyncVectorEnv and against ForkVectorEnv.

Usage:
    python tools/run_gymnasium_suite.py GYMNASIUM_GIT_DIR [--rev REV] [--out docs/...]

GYMNASIUM_GIT_DIR is a clone (or bare git dir) of the Gymnasium repository; REV is the
commit of the pinned release (default: the "Update to v1.4.0" commit). The script
exports that revision's tests/ to .gymnasium-src/, runs the selected test paths twice
(real AsyncVectorEnv; then with tools/gym_fork_rebind.py loaded), and prints the
counts and every test that passes with AsyncVectorEnv but not with ForkVectorEnv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / ".gymnasium-src"
REV_1_4_0 = "95a790e19"
PATHS = ["tests/vector", "tests/wrappers/vector", "tests/envs/registration/test_make_vec.py"]


def export_tests(git_dir: str, rev: str) -> None:
    if SRC.exists():
        shutil.rmtree(SRC)
    SRC.mkdir()
    archive = subprocess.run(
        ["git", "--git-dir", git_dir, "archive", rev, "tests"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(SRC)], input=archive, check=True)


def run(label: str, rebind: bool, extra: list[str]) -> dict[str, str]:
    xml = SRC / f"{label}.xml"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tools"), str(SRC)]))
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--junitxml={xml}",
        "-o",
        "addopts=",
        "-o",
        "timeout=120",
        *PATHS,
        *extra,
    ]
    if rebind:
        cmd[3:3] = ["-p", "gym_fork_rebind"]
    proc = subprocess.run(cmd, cwd=SRC, env=env, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
    print(f"[{label}] {' '.join(tail)}")
    outcomes: dict[str, str] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        # Parametrize ids carry the class name: compare Fork's ids as Async's.
        name = f"{case.get('classname')}::{case.get('name')}".replace(
            "ForkVectorEnv", "AsyncVectorEnv"
        )
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        outcomes[name] = outcome
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("git_dir")
    parser.add_argument("--rev", default=REV_1_4_0)
    parser.add_argument("--json", metavar="OUT", help="write the counts and the lost tests")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    export_tests(args.git_dir, args.rev)
    baseline = run("async", rebind=False, extra=args.pytest_args)
    fork = run("fork", rebind=True, extra=args.pytest_args)
    passed_async = {t for t, o in baseline.items() if o == "passed"}
    passed_both = {t for t in passed_async if fork.get(t) == "passed"}
    lost = sorted(passed_async - passed_both)
    ratio = len(passed_both) / max(1, len(passed_async))
    print(f"passing with AsyncVectorEnv: {len(passed_async)}")
    print(f"of those, passing with ForkVectorEnv: {len(passed_both)} ({ratio:.1%})")
    for test in lost:
        print(f"LOST {test}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "rev": args.rev,
                    "passed_async": len(passed_async),
                    "passed_both": len(passed_both),
                    "lost": lost,
                },
                out,
                indent=1,
            )
    return 0 if ratio >= 0.98 else 1


if __name__ == "__main__":
    sys.exit(main())
