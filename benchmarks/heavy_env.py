"""A synthetic heavy env (seconds of initialisation, hundreds of MB of touched state).

Kept as a module here for the benchmark scripts; the env itself is gym_fork.bench.heavy's.
"""

from gym_fork.bench.heavy import HeavyEnv

__all__ = ["HeavyEnv"]
