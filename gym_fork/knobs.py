"""Every environment variable gym_fork reads, declared once: its name, what it holds, its
default and what it does.

Code reads a knob through :func:`read` (the value, else the declared default) or
:func:`given` (the value, else None); a name that is not declared here is a KeyError, so
a typo fails where it is written. ``python -m gym_fork.knobs`` prints the table that
docs/guides/knobs.md holds; tests/test_knobs.py checks that every ``GYM_FORK_`` name in
the code is declared here and that the page is this table.

Kept free of imports beyond the standard library: the zygote's launcher reads knobs
before the rest of gym_fork is imported.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple


class Knob(NamedTuple):
    """One environment variable: ``kind`` says what it holds, ``default`` is the value
    an unset variable stands for ("" where unset means "not given")."""

    name: str
    kind: str
    default: str
    doc: str
    audience: str = "users"  # "users", "tuning" (measurement), "tests", "internal"


KNOBS: tuple[Knob, ...] = (
    Knob("GYM_FORK_HOST", "process | microvm | inline", "process",
         "The host a ForkVectorEnv uses when its `host=` is not given."),
    Knob("GYM_FORK_TRUSTED", "on/off (1/true/yes/on, 0/false/no/off)", "off",
         "The default of `trusted=`: on loads pickles a sandbox sends (a trusted env only); "
         "any other value is a ValueError."),
    Knob("GYM_FORK_MAX_SANDBOXES", "integer", "4096",
         "The most sandboxes one controller keeps at once; a fork or reset past it raises."),
    Knob("GYM_FORK_IDLE_SANDBOXES", "integer 0-16", "2",
         "Idle sandboxes a warm parent keeps forked ahead of resets by clone (0: none)."),
    Knob("GYM_FORK_ZYGOTE", "0 turns it off", "1",
         "Fork warm parents from a per-process zygote started at the first lookup of "
         "`gym_fork.ForkVectorEnv` (0: each warm parent is a fresh interpreter)."),
    Knob("GYM_FORK_PREIMPORT", "0 turns it off", "1",
         "Warm parents import an env's modules with a throw-away build before forking."),
    Knob("GYM_FORK_PREIMPORT_SECONDS", "seconds", "2",
         "How long that throw-away build may take before it is abandoned."),
    Knob("GYM_FORK_PROGRESS", "empty, 0 or 1", "",
         "Progress bars: shown on a terminal only (empty), never (0), or always (1)."),
    Knob("GYM_FORK_MAX_DECODE_OBJECTS", "positive integer", str(1 << 20),
         "The most values one record from a sandbox may decode into (a bad value warns "
         "and keeps the default)."),
    Knob("GYM_FORK_LINEAGE_LOG", "path, or empty to disable", "",
         "The lineage JSONL log (unset: $XDG_STATE_HOME/gym_fork/lineage.jsonl, else "
         "~/.local/state/gym_fork/lineage.jsonl)."),
    Knob("GYM_FORK_LINEAGE_LOG_MAX_BYTES", "positive integer", str(4 << 20),
         "The size at which the lineage log is rotated (2 rotated files are kept)."),
    Knob("GYM_FORK_CACHE", "path", "",
         "The cache root for guest kernels, images and boot templates (unset: "
         "$XDG_CACHE_HOME/gym_fork, else ~/.cache/gym_fork)."),
    Knob("GYM_FORK_VM_ACCEL", "kvm | tcg", "",
         "Force the microVM accelerator (unset: probed once and cached)."),
    Knob("GYM_FORK_VM_BOOT_CACHE", "1, 0/off/no, or a path", "1",
         "The microVM boot-template cache: on, off, or kept at that path."),
    Knob("GYM_FORK_VM_IMAGE_CACHE_MB", "whole MiB >= 0", "",
         "The bound on cached guest images (unset: the built-in bound, see `gym-fork "
         "doctor`); the least recently used go first."),
    Knob("GYM_FORK_VM_PACKAGES", "comma-separated names, or all", "",
         "Distributions packed into the guest image beside what the env imports on the "
         "host (all: the whole environment)."),
    Knob("GYM_FORK_VM_KERNEL", "path to a vmlinuz", "",
         "The guest kernel (unset: the Debian kernel `gym-fork image kernel` fetched)."),
    Knob("GYM_FORK_VM_MODULES", "path", "",
         "That kernel's modules directory (unset: ../lib/modules/VERSION beside it)."),
    Knob("GYM_FORK_VM_DOORBELL", "0 turns it off", "1",
         "microVM rings wake the other side with an eventfd doorbell (0: polling only)."),
    Knob("GYM_FORK_SPIN", "integer", "400",
         "Busy-wait rounds of a ring wait before it sleeps on a futex (0: sleep at once).",
         "tuning"),
    Knob("GYM_FORK_LONG_SPIN", "integer", "4000",
         "Spin rounds of the ring waits around steps that take 1 ms or more (worker: its "
         "own steps; controller: its waits for them), never fewer than GYM_FORK_SPIN's; "
         "unset while GYM_FORK_SPIN is set: GYM_FORK_SPIN's for every wait "
         "(benchmarks/cpu_roles.py --knob measures it).",
         "tuning"),
    Knob("GYM_FORK_LEASES", "0 turns it off", "1",
         "Take the idle sandboxes a warm parent leases ahead of need (0: every spawn asks "
         "the warm parent; benchmarks/lease_ab.py measures both).",
         "tuning"),
    Knob("GYM_FORK_TMP_LAYERS", "0 turns it off", "1",
         "Freeze a source's /tmp writes into a read-only layer its clones share at a fork "
         "(gym_fork/system/frozen_layers.py; 0: every clone copies them instead; "
         "benchmarks/agent_workspace.py measures both).",
         "tuning"),
    Knob("GYM_FORK_SCRATCH_BASE", "path", "",
         "The host temp dir scratch directories live in; set by gym_fork at its first "
         "scratch directory so sandboxes and later processes agree.", "internal"),
    Knob("GYM_FORK_SANDBOX", "a pid", "",
         "Set in the zygote's environment: marks a process that must not start a zygote of "
         "its own.", "internal"),
    Knob("GYM_FORK_SOAK_SECONDS", "seconds", "15",
         "tests/test_soak.py's time budget.", "tests"),
    Knob("GYM_FORK_SOAK_CYCLES", "integer", "",
         "tests/test_soak.py runs exactly this many cycles instead of a time budget.", "tests"),
    Knob("GYM_FORK_VM_FULL", "1 turns it on", "",
         "tests/microvm/test_contract_suites.py runs the whole contract suite on the microVM "
         "host, not a sample.", "tests"),
)  # fmt: skip

BY_NAME: dict[str, Knob] = {knob.name: knob for knob in KNOBS}


def given(name: str) -> str | None:
    """The variable's value, or None where it is unset (KeyError: not a declared knob)."""
    BY_NAME[name]
    return os.environ.get(name)


def read(name: str) -> str:
    """The variable's value, else its declared default."""
    value = given(name)
    return BY_NAME[name].default if value is None else value


def markdown() -> str:
    """The table of docs/guides/knobs.md."""
    lines = [
        "| variable | holds | default | what it does | for |\n",
        "|---|---|---|---|---|\n",
    ]
    for knob in KNOBS:
        default = f"`{knob.default}`" if knob.default else "unset"
        lines.append(
            f"| `{knob.name}` | {knob.kind} | {default} | {knob.doc} | {knob.audience} |\n"
        )
    return "".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
