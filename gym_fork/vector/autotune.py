"""``gym_fork.autotune``: measure how to group an env's sub-envs, offline, and recommend.

Whether several sub-envs should share a worker sandbox depends on the step's cost, which
nobody knows before running the env: cheap steps gain from fewer hand-overs per step,
costly ones from a core each. ``envs_per_worker="auto"`` picks by core count alone and
never regroups a running env; this measures the candidate groupings on the user's own env
and machine and says which ran fastest, so the choice can be written into the script.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import auto_envs_per_worker, available_cores

WARMUP_STEPS = 20  # page faults, caches and the first autoresets are not the steady state


@dataclass(frozen=True)
class Recommendation:
    """What :func:`autotune` measured: sub-env steps per second for each grouping tried
    (medians over ``rounds``, with every round's figure), and the fastest."""

    envs_per_worker: int
    steps_per_second: dict[int, float]
    rounds: dict[int, list[float]] = field(repr=False)
    auto: int
    cores: int

    def __str__(self) -> str:
        lines = [f"autotune on {self.cores} core(s): sub-env steps/s per envs_per_worker"]
        best = self.steps_per_second[self.envs_per_worker]
        for k, rate in sorted(self.steps_per_second.items()):
            marks = []
            if k == self.envs_per_worker:
                marks.append("fastest")
            if k == self.auto:
                marks.append('"auto"')
            spread = f"{min(self.rounds[k]):,.0f}-{max(self.rounds[k]):,.0f}"
            note = f"  ({', '.join(marks)})" if marks else ""
            lines.append(f"  {k:>4}: {rate:>12,.0f}  [{spread}]  {rate / best:.2f}x{note}")
        lines.append(f"recommended: ForkVectorEnv(..., envs_per_worker={self.envs_per_worker})")
        return "\n".join(lines)


def candidate_groupings(num_envs: int, cores: int) -> list[int]:
    """The groupings worth timing: one sub-env per sandbox, one worker per core, and
    everything in one worker, plus the halfway points between them."""
    per_core = max(1, math.ceil(num_envs / cores))
    picks = {1, per_core, num_envs, max(1, per_core // 2), max(1, math.ceil(num_envs / 2))}
    return sorted(k for k in picks if 1 <= k <= num_envs)


def autotune(
    env_fns: Sequence[Callable[[], Any]],
    *,
    seconds: float = 1.0,
    rounds: int = 3,
    candidates: Sequence[int] | None = None,
    seed: int | None = 0,
    progress: Callable[[str], None] | None = None,
    **env_kwargs: Any,
) -> Recommendation:
    """Time ``ForkVectorEnv(env_fns, envs_per_worker=k, **env_kwargs)`` for each grouping
    ``k`` (``candidates``, default :func:`candidate_groupings`), stepping random actions
    for ``seconds`` per try, the tries interleaved over ``rounds``, and recommend the one
    with the most sub-env steps per second. Each try builds and closes its own vector env.

    ``progress`` gets one line per try as it ends (default: written to stderr, since the
    whole takes tries x ``seconds`` plus each try's start); ``print`` or a logger's
    method work too. ``print(autotune(...))`` shows the table and the recommendation.
    """
    from .fork_vector_env import ForkVectorEnv

    if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds <= 0:
        raise ValueError(f"autotune: `seconds` must be a positive number, got {seconds!r}")
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
        raise ValueError(f"autotune: `rounds` must be an int >= 1, got {rounds!r}")
    if "envs_per_worker" in env_kwargs:
        raise TypeError("autotune: `envs_per_worker` is what autotune chooses; leave it out")
    num_envs = len(env_fns)
    if num_envs == 0:
        raise ValueError("autotune needs at least one env_fn")
    cores = available_cores()
    chosen = list(candidates) if candidates is not None else candidate_groupings(num_envs, cores)
    for k in chosen:
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_envs:
            raise ValueError(
                f"autotune: every candidate must be an int in 1..{num_envs}, got {k!r}"
            )
    chosen = sorted(set(chosen))
    say = progress if progress is not None else _to_stderr
    measured: dict[int, list[float]] = {k: [] for k in chosen}
    tries, done = rounds * len(chosen), 0
    say(
        f"autotune: {len(chosen)} grouping(s) x {rounds} round(s) of {seconds:g} s each "
        f"over {num_envs} sub-env(s) on {cores} core(s)"
    )
    for round_index in range(rounds):
        for k in chosen:
            envs = ForkVectorEnv(list(env_fns), envs_per_worker=k, **env_kwargs)
            try:
                measured[k].append(_steps_per_second(envs, seconds, seed))
            finally:
                envs.close()
            done += 1
            say(
                f"autotune [{done}/{tries}] round {round_index + 1}, envs_per_worker={k}: "
                f"{measured[k][-1]:,.0f} sub-env steps/s"
            )
    medians = {k: statistics.median(v) for k, v in measured.items()}
    best = max(medians, key=lambda k: (medians[k], -k))
    auto = auto_envs_per_worker(num_envs, env_kwargs.get("reset_mode", "in_place"))
    return Recommendation(best, medians, measured, auto, cores)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _steps_per_second(envs: Any, seconds: float, seed: int | None) -> float:
    """Sub-env steps per second of random actions, after the warm-up steps."""
    envs.reset(seed=seed)
    envs.action_space.seed(seed)
    for _ in range(WARMUP_STEPS):
        envs.step(envs.action_space.sample())
    steps = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        envs.step(envs.action_space.sample())
        steps += 1
        now = time.perf_counter()
        if now >= deadline:
            return steps * envs.num_envs / (now - start)
