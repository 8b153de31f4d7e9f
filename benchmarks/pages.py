"""The page blocks drawn from the results file (benchmarks/figures.py): each renderer
takes the whole file and returns a block's Markdown; a figure the file lacks is "n/a"."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from typing import Any

from figures import CHECKED_PAGES, ROOT, apply, slug

STEP_ROWS = ("CartPole x2", "CartPole x8", "CartPole x64", "100 us step x8", "Pong x8", "Pong x16")
ROW_SLUGS = {
    "CartPole x2": "cartpole_x2",
    "CartPole x8": "cartpole_x8",
    "CartPole x64": "cartpole_x64",
    "100 us step x8": "slow100us_x8",
    "Pong x8": "pong_x8",
    "Pong x16": "pong_x16",
}
ROW_NAMES = {
    "CartPole x2": "CartPole-v1 x2",
    "CartPole x8": "CartPole-v1 x8",
    "CartPole x64": "CartPole-v1 x64",
    "100 us step x8": "a 100 us Python step x8",
    "Pong x8": "Pong x8 (Atari preprocessing)",
    "Pong x16": "Pong x16",
}


class Page:
    """Lookups into one results file for the renderers."""

    def __init__(self, results: dict) -> None:
        self.results = results
        self.figures: dict[str, dict[str, Any]] = results["figures"]

    def text(self, key: str) -> str:
        found = self.figures.get(key)
        return found["text"] if found else "n/a"

    def spread(self, key: str) -> str:
        """'1.82x (1.70-1.90x)' where the figure has rounds."""
        found = self.figures.get(key)
        if not found:
            return "n/a"
        return f"{found['text']} ({found['range']})" if "range" in found else found["text"]

    def value(self, key: str) -> float | None:
        found = self.figures.get(key)
        return None if found is None else float(found["value"])

    def run(self, name: str) -> dict[str, Any]:
        return self.results["runs"].get(name, {})

    def cores(self) -> int:
        return int(self.run("peers").get("machine", {}).get("cpus", 0))

    def day(self, name: str) -> str:
        return str(self.run(name).get("date", "n/a"))[:10]


FIELD = re.compile(r"\{([\w.=:-]+)\}")

README_COMPAT = """\
- The whole `AsyncVectorEnv` contract of Gymnasium 1.4 (spaces, autoreset modes, `_key`
  info masks, the async state machine and its errors, `call`/`get_attr`/`set_attr`/`render`,
  `close(timeout, terminate)`). Gymnasium's own vector test suite passes {suite.passed_both}
  of the {suite.passed_async} tests that pass with `AsyncVectorEnv` here ({=day:suite}), under
  the untrusted default (the one left asserts a log line that would be false here): see
  [docs/compatibility.md](docs/compatibility.md).
"""

README_SPEED = """\
- Speed, measured on a **{=cores}-core** machine ({=day:peers}, one run of
  `benchmarks/publish.py` against SyncVectorEnv, AsyncVectorEnv and EnvPool, medians of 3;
  ratios move with the core count, so measure on yours with `gym-fork bench --quick`):
  steps/s against `SyncVectorEnv`, a 100 us Python step x8 {step.slow100us_x8.fork} and
  Atari Pong x8 {step.pong_x8.fork} (two plain processes handing nothing over reach
  {step.slow100us_x8.ceiling} and {step.pong_x8.ceiling} here); CartPole-v1 x64
  {step.cartpole_x64.fork}, x8 {step.cartpole_x8.fork}, x2 {step.cartpole_x2.fork}
  ({=async_span} `AsyncVectorEnv`: a CartPole step, {cost.cartpole_step} here, costs less
  than a hand-over between processes; `gym_fork.autotune(env_fns)` measures whether
  grouping sub-envs pays for your env). Gymnasium's own `benchmark_vector_step` gives
  ForkVectorEnv {gymnasium_step.slow100us_x8.fork_vs_sync} (100 us step x8) and
  {gymnasium_step.cartpole_x8.fork_vs_sync} (CartPole x8) of `SyncVectorEnv`. The first
  vector env of a process waits for the process's zygote, which starts when the script
  first looks up `gym_fork.ForkVectorEnv`: {build.first.w0.fork} if it is built right
  after the imports ({build.first.w0.fork_vs_async} `AsyncVectorEnv`),
  {build.first.w0_3.fork} ({build.first.w0_3.fork_vs_async}) once the script did 0.3 s of
  other work; later envs {build.second.fork}. A ring round trip takes {round_trip.ring}
  against {round_trip.pipe} for a pipe. A clone of a warm parent with its first step:
  {clone.heavy.apart_p50} when resets come apart, as at episodes' ends
  ({clone.heavy.vs_cold} faster than building a {heavy.init_s} / {heavy.mb} env;
  {clone.heavy.back_p50} p50, {clone.heavy.back_p99} p99 in a loop of back-to-back
  resets), a fork of a running sub-env {fork.cartpole.p50}, 64 clones of it in
  {fanout64.cartpole} (each clone makes its own user, mount, IPC and network namespaces),
  adding {memory64.heavy} of the memory of 64 independent copies of a {heavy.mb} env
  ({memory64.cartpole} for CartPole). Every figure, its run and what is not met yet:
  [docs/benchmarks.md](docs/benchmarks.md).
"""

README_AGENT = """\
- Agent workspaces: Gymnasium `Text` spaces (str actions, observations and infos), an
  asyncio face (`gym_fork.aio.AsyncForkVectorEnv`: awaitable reset, step and fork per
  sub-env, for loops that step each episode at its own pace), and forks whose cost does not
  grow with what a sandbox wrote: at a fork, its /tmp writes are frozen into a read-only
  layer the source and its branches share. A fork + first step of
  `examples/agent_workspace.py`'s env holding {=workspace} it wrote takes
  {agent.fork_x1_sandbox.first_step} ({agent.fork_x1_empty.first_step} with an empty
  workspace, {agent.cp_a_x1_sandbox.first_step} for a fresh sandbox that copies the
  workspace in with `cp -a`), 64 branches of it {agent.fork_x64_sandbox.first_step}
  ({=day:agent_workspace}). The process host refuses to fork an env that started a child
  process (a shell it talks to), naming it; `host="microvm"` clones the whole guest,
  child processes included. See [docs/branching.md](docs/branching.md).
"""


def fill(p: Page, template: str) -> str:
    """``template`` with each ``{key}`` replaced by that figure's text, ``{=cores}``,
    ``{=day:RUN}``, ``{=async_span}`` and ``{=workspace}`` by what they name."""

    def one(match: re.Match[str]) -> str:
        key = match.group(1)
        if key == "=cores":
            return str(p.cores())
        if key.startswith("=day:"):
            return p.day(key[5:])
        if key == "=async_span":
            return _async_span(p)
        if key == "=workspace":
            found = p.results.get("raw", {}).get("agent_workspace", {}).get("workspace", {})
            return f"{found.get('mb', 'n/a')} MB in {found.get('files', 'n/a')} files"
        return p.text(key)

    filled = " ".join(FIELD.sub(one, template).split())
    # A bullet of prose, wrapped as the hand-written ones around it are.
    return (
        textwrap.fill(
            filled[2:],
            width=92,
            initial_indent="- ",
            subsequent_indent="  ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        + "\n"
    )


def readme_agent(p: Page) -> str:
    return fill(p, README_AGENT)


def readme_compat(p: Page) -> str:
    return fill(p, README_COMPAT)


def _async_span(p: Page) -> str:
    rows = ("cartpole_x2", "cartpole_x8", "cartpole_x64")
    known = [v for v in (p.value(f"step.{s}.fork_vs_async") for s in rows) if v is not None]
    return f"{min(known):.0f}-{max(known):.0f}x" if known else "n/a"


def readme_speed(p: Page) -> str:
    return fill(p, README_SPEED)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = [header, ["---"] * len(header), *rows]
    return "".join("| " + " | ".join(cells) + " |\n" for cells in lines)


def faq_peers(p: Page) -> str:
    intro = (
        f"Measured side by side on a {p.cores()}-core machine ({p.day('peers')},"
        " `benchmarks/publish.py`, medians of 3;\n"
        'steps/s as a ratio of `SyncVectorEnv`; "ceiling": two plain processes stepping the\n'
        "envs with nothing handed over; run `gym-fork bench` for your own machine):\n\n"
    )
    header = ["workload", "SyncVectorEnv", "AsyncVectorEnv", "EnvPool", "ForkVectorEnv", "ceiling"]
    rows = [
        [ROW_NAMES[row], "1.00x"]
        + [p.text(f"step.{ROW_SLUGS[row]}.{c}") for c in ("async", "envpool", "fork", "ceiling")]
        for row in STEP_ROWS
    ]
    against = [p.value(f"step.{ROW_SLUGS[row]}.fork_vs_async") for row in STEP_ROWS]
    known = [v for v in against if v is not None]
    if not known:
        return intro + table(header, rows)
    faster = sum(v > 1 for v in known)
    return (
        intro
        + table(header, rows)
        + f"\nForkVectorEnv against AsyncVectorEnv: {min(known):.2f}-{max(known):.2f}x its"
        f" steps/s, faster on {faster} of these {len(known)} rows.\n"
    )


def benchmarks_runs(p: Page) -> str:
    rows = []
    for name, run in sorted(p.results["runs"].items()):
        m = run.get("machine", {})
        where = f"{m.get('cpus', '?')} cores, {m.get('cpu', '?')}, {m.get('memory_gib', '?')} GiB"
        load = f"{run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f}"
        rows.append([name, f"`{run['command']}`", run["date"], run["head"], load, where])
    return table(["run", "command", "date", "commit", "load before -> after", "machine"], rows)


# (goal, figure, comparison, threshold or figure, ceiling figure or None)
GOALS: tuple[tuple[str, str, str, float | str, str | None], ...] = (
    ("100 us Python step x8 >= 1.8x Sync", "step.slow100us_x8.fork", ">=", 1.8,
     "step.slow100us_x8.ceiling"),
    ("Pong x16 >= 1.8x Sync", "step.pong_x16.fork", ">=", 1.8, "step.pong_x16.ceiling"),
    ("CartPole x8 >= 1.3x Sync", "step.cartpole_x8.fork", ">=", 1.3, "step.cartpole_x8.ceiling"),
    ("first env of a fresh process <= 2x Async", "build.first.w0.fork_vs_async", "<=", 2.0, None),
    ("16 Pong envs one per sandbox: PSS <= Async's", "pss16.pong.fork1", "<=",
     "pss16.pong.async", None),
    ("clone + first step of the heavy env, apart, <= 5 ms p50", "clone.heavy.apart_p50", "<=",
     5.0, None),
    ("fan-out of 64 + first step <= 150 ms", "fanout64.cartpole", "<=", 150.0, None),
    ("64 clones add <= 1/20 of 64 copies' memory", "memory64.heavy", ">=", 20.0, None),
    ("fork + first step of an agent workspace (200 MB) <= 10 ms p50",
     "agent.fork_x1_sandbox.first_step", "<=", 10.0, None),
    ("... <= 2x the same env with an empty workspace", "agent.x1_sandbox_vs_empty", "<=", 2.0,
     None),
    ("... its source paused <= 1 ms", "agent.fork_x1_sandbox.swap", "<=", 1.0, None),
    ("64 branches of it ready <= 300 ms", "agent.fork_x64_sandbox.first_step", "<=", 300.0,
     None),
)  # fmt: skip


def goal_met(p: Page, key: str, sense: str, bound: float | str, ceiling_key: str | None) -> str:
    """'yes', 'no', 'no: above this machine's ceiling' or 'not measured'."""
    value = p.value(key)
    limit = p.value(bound) if isinstance(bound, str) else bound
    if value is None or limit is None:
        return "not measured"
    value, limit = round(value, 2), round(limit, 2)  # as the pages print them
    if (value >= limit) if sense == ">=" else (value <= limit):
        return "yes"
    ceiling = p.value(ceiling_key) if ceiling_key else None
    if ceiling is not None and ceiling < limit:
        return "no: above this machine's ceiling"
    return "no"


def benchmarks_goals(p: Page) -> str:
    rows = [
        [goal, p.spread(key), p.text(ceiling) if ceiling else "-", goal_met(p, key, *rest, ceiling)]
        for goal, key, *rest, ceiling in GOALS
    ]
    return table(["goal", "measured", "the ceiling here", "met"], rows)


def benchmarks_step(p: Page) -> str:
    header = ["workload", "Async", "EnvPool", "ForkVectorEnv (min-max of 3)", "ceiling"]
    header += ["ForkVectorEnv / ceiling", "ForkVectorEnv / Async"]
    rows = []
    for row in STEP_ROWS:
        k = f"step.{ROW_SLUGS[row]}."
        rows.append(
            [
                ROW_NAMES[row],
                p.text(k + "async"),
                p.text(k + "envpool"),
                p.spread(k + "fork"),
                p.text(k + "ceiling"),
                p.text(k + "fork_of_ceiling"),
                p.text(k + "fork_vs_async"),
            ]
        )
    gym_rows = []
    for row, s in (("CartPole x8", "cartpole_x8"), ("100 us step x8", "slow100us_x8")):
        k = f"gymnasium_step.{s}."
        gym_rows.append(
            [
                ROW_NAMES[row],
                p.text(k + "sync"),
                p.text(k + "async"),
                p.text(k + "fork"),
                p.spread(k + "fork_vs_sync"),
            ]
        )
    env = next((k.split(".")[1] for k in p.figures if k.startswith("pss16.")), "pong")
    pss = f"pss16.{env}."
    return (
        table(header, rows)
        + "\nGymnasium's own `gymnasium.utils.performance.benchmark_vector_step` (sub-env"
        " steps/s; `benchmarks/gymnasium_step.py`):\n\n"
        + table(["workload", "SyncVectorEnv", "AsyncVectorEnv", "ForkVectorEnv", "Fork / Sync"],
                gym_rows)
        + "\nConstruction + first reset of CartPole x8, later envs of a process: Sync"
        f" {p.text('build.later.sync')}, Async {p.text('build.later.async')}, EnvPool"
        f" {p.text('build.later.envpool')}, ForkVectorEnv {p.text('build.later.fork')}.\n"
        f"Total PSS of 16 {env} envs: Sync {p.text(pss + 'sync')}, Async {p.text(pss + 'async')},"
        f" EnvPool {p.text(pss + 'envpool')}, ForkVectorEnv {p.text(pss + 'fork')} (auto),"
        f" {p.text(pss + 'fork1')} (one per sandbox).\n"
    )  # fmt: skip


def benchmarks_first_env(p: Page) -> str:
    header = ["script does before building", "AsyncVectorEnv", "ForkVectorEnv"]
    header += ["ForkVectorEnv / Async", "zygote already ready (`fork-ready`)"]
    rows = []
    for tag, what in (
        ("w0", "nothing (imports, then build + reset)"),
        ("w0_3", "0.3 s of other work"),
    ):
        k = f"build.first.{tag}."
        ready = f"{p.text(k + 'fork_ready')} ({p.text(k + 'fork_ready_vs_async')})"
        rows.append(
            [what, p.spread(k + "async"), p.spread(k + "fork"), p.text(k + "fork_vs_async"), ready]
        )
    second = f"\nThe second ForkVectorEnv of a process: {p.spread('build.second.fork')}.\n"
    return table(header, rows) + second


def benchmarks_clone(p: Page) -> str:
    heavy = f"heavy env ({p.text('heavy.init_s')} init, {p.text('heavy.mb')})"
    gap = p.text("param.clone_gap")
    rows = [
        [what, p.text(key.format("cartpole")), p.text(key.format("heavy"))]
        for what, key in (
            (f"clone of the warm parent + first step, {gap} apart, p50", "clone.{}.apart_p50"),
            ("the same back to back, p50", "clone.{}.back_p50"),
            ("the same back to back, p99", "clone.{}.back_p99"),
            ("building the env cold in-process + first step, p50", "cold.{}"),
            ("cold / clone apart", "clone.{}.vs_cold"),
            ("fork of a running sub-env + first step, p50", "fork.{}.p50"),
            ("fork(copies=64) + one step of all 64, median of 3", "fanout64.{}"),
            ("PSS the 64 clones add, against 64 independent copies", "memory64.{}"),
        )
    ]
    return table(["operation", "CartPole-v1", heavy], rows)


def benchmarks_grouping(p: Page) -> str:
    header = ["workload", '"auto" gives', "fastest", "fastest / auto"]
    header += ["all in one worker / auto", "one per sandbox / auto"]
    rows = []
    for row, s in (("CartPole x8", "cartpole_x8"), ("100 us step x8", "slow100us_x8")):
        k = f"grouping.{s}."
        rows.append(
            [
                ROW_NAMES[row],
                p.text(k + "auto"),
                p.text(k + "best"),
                p.spread(k + "best_vs_auto"),
                p.text(k + "one_worker_vs_auto"),
                p.text(k + "one_per_sandbox_vs_auto"),
            ]
        )
    return table(header, rows)


# benchmarks/agent_workspace.py's rows, in its order: (its key, how the page names it).
AGENT_ROWS = tuple(
    (f"{contender} x{k} {where}", f"{k} {'copy' if k == 1 else 'copies'}: {named}")
    for k in (1, 8, 64)
    for contender, where, named in (
        ("fork", "empty", "fork, empty workspace"),
        ("fork", "sandbox", "fork, workspace the source wrote"),
        ("copy fork", "sandbox", "fork, frozen layers off (the workspace copied)"),
        ("fork", "parent", "fork, workspace the warm parent wrote"),
        ("cp -a", "sandbox", "fresh sandboxes + `cp -a` of the workspace"),
    )
)


def benchmarks_agent(p: Page) -> str:
    rows = []
    for row, named in AGENT_ROWS:
        key = f"agent.{slug(row)}"
        if key + ".first_step" not in p.figures:
            continue  # not a row of this run (8 copies of the workspace at most)
        swap = p.text(key + ".swap") if key + ".swap" in p.figures else "-"
        rows.append([named, p.spread(key + ".first_step"), p.text(key + ".branches_per_s"), swap])
    header = ["what", "until every copy's first step (min-max of the rounds)", "branches/s"]
    header.append("the source's own time on its layer")
    raw = p.results.get("raw", {}).get("agent_workspace", {})
    workspace = raw.get("workspace", {})
    about = (
        f"\nThe workspace: {workspace.get('mb', 'n/a')} MB in {workspace.get('files', 'n/a')}"
        " files. The anchors, as their authors publish them (their machines and conditions,"
        " not measured here):\n\n"
        + "".join(f"- {name}: {claim}\n" for name, claim in raw.get("anchors", {}).items())
    )
    return table(header, rows) + about


RENDERERS: dict[str, Callable[[Page], str]] = {
    "readme-compat": readme_compat,
    "readme-speed": readme_speed,
    "readme-agent": readme_agent,
    "faq-peers": faq_peers,
    "benchmarks-runs": benchmarks_runs,
    "benchmarks-goals": benchmarks_goals,
    "benchmarks-step": benchmarks_step,
    "benchmarks-first-env": benchmarks_first_env,
    "benchmarks-clone": benchmarks_clone,
    "benchmarks-grouping": benchmarks_grouping,
    "benchmarks-agent": benchmarks_agent,
}


def render(results: dict) -> dict[str, str]:
    page = Page(results)
    return {name: draw(page) for name, draw in RENDERERS.items()}


def rendered_pages(results: dict) -> dict[str, tuple[str, str]]:
    """page -> (its text now, its text with every block rendered from ``results``)."""
    blocks = render(results)
    out = {}
    for name in CHECKED_PAGES:
        text = (ROOT / name).read_text()
        out[name] = (text, apply(text, blocks))
    return out
