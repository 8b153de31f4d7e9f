"""How many rounds a ring wait spins before it sleeps, chosen from the steps it waits on.

A short spin (``GYM_FORK_SPIN``, 400 rounds) suits small steps: a waiter that spins
through a long wait takes turns on the core its peer needs. Around steps of a
millisecond or more (Pong, 2 ms a worker of 4), sleeping costs more than spinning: each
futex sleep lets the vCPU halt, and waking it again is a hand-over the step pays
(benchmarks/cpu_roles.py, docs/benchmarks-notebook.md "Spinning around long steps":
Pong x8 0.80 -> 0.96 of the ceiling with 4000 rounds on both sides, CartPole x64 0.81 ->
0.62 with the same, so the long spin is for long steps only). The worker watches its own
steps, the controller its wait for the first reply of each step (not the whole collect,
which grows with the number of sandboxes); each keeps a moving average and spins long
once it reaches :data:`LONG_AFTER_S`. Polling rings (microVM) are left as they are. A
``GYM_FORK_SPIN`` set alone holds for every wait.
"""

from __future__ import annotations

from gym_fork import knobs

from .ring import DEFAULT_SPIN, Ring


def _long_spin() -> int:
    """GYM_FORK_LONG_SPIN's rounds (0..2**31-1); a GYM_FORK_SPIN the user set alone is
    kept for every wait, and the long spin is never shorter than the short one."""
    if knobs.given("GYM_FORK_LONG_SPIN") is None and knobs.given("GYM_FORK_SPIN") is not None:
        return DEFAULT_SPIN
    try:
        rounds = int(knobs.read("GYM_FORK_LONG_SPIN"))
    except ValueError:
        rounds = int(knobs.BY_NAME["GYM_FORK_LONG_SPIN"].default)
    return max(DEFAULT_SPIN, min(rounds, 0x7FFFFFFF))


LONG_SPIN = _long_spin()
LONG_AFTER_S = 1e-3  # a step (or a wait for one) this long or longer: spin long
_WEIGHT = 0.125  # of the newest observation in the moving average


class SpinChoice:
    """The spin rounds for the waits around one kind of step, from its recent lengths."""

    __slots__ = ("average",)

    def __init__(self) -> None:
        self.average = 0.0

    def observe(self, seconds: float) -> int:
        """One more step (or wait) of ``seconds``: the spin rounds for the next waits."""
        self.average += (seconds - self.average) * _WEIGHT
        return LONG_SPIN if self.average >= LONG_AFTER_S else DEFAULT_SPIN


def apply(rings: list[Ring], rounds: int) -> None:
    """Give each of ``rings`` (a polling ring keeps its own) ``rounds`` of spin."""
    for ring in rings:
        if ring.spin != rounds and not ring.polling:
            ring.set_spin(rounds)
