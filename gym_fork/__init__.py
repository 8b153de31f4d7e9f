"""gym_fork: branch running Gymnasium environments.

``ForkVectorEnv`` is a drop-in ``gymnasium.vector.AsyncVectorEnv`` whose sub-envs run
in sandboxes forked from a warm parent, talking over shared-memory rings.
"""

from gym_fork._version import __version__
from gym_fork.errors import (
    BadActionError,
    BadObservationError,
    EncodeError,
    GymForkError,
    IsolationMissing,
    PeerGone,
    PickleRefused,
    SandboxStartError,
    SubEnvCrashed,
    SubEnvError,
    SubEnvStopped,
    SubEnvTimeout,
    TransportError,
)

__all__ = [
    "BadActionError",
    "BadObservationError",
    "EncodeError",
    "ForkVectorEnv",
    "GymForkError",
    "IsolationMissing",
    "PeerGone",
    "PickleRefused",
    "SandboxLimits",
    "SandboxStartError",
    "SubEnvCrashed",
    "SubEnvError",
    "SubEnvStopped",
    "SubEnvTimeout",
    "TransportError",
    "__version__",
    "autotune",
    "make_vec",
    "prestart",
    "vector_entry_point",
]


def prestart(wait: bool = False) -> None:
    """Start this process's zygote now (gym_fork/hosts/process/zygote.py), so that the
    first ``ForkVectorEnv`` finds it ready. Looking up ``gym_fork.ForkVectorEnv`` does
    this already; call it after a bare ``import gym_fork``, before loading a model. It
    imports in the background; ``wait``: until it is ready."""
    from gym_fork.hosts.process import zygote

    zygote.prestart(wait=wait)


def _start_zygote_early() -> None:
    # Only here, at the lookup of what builds a vector env: `import gym_fork` alone (the
    # CLI, a warm parent, a sandbox) starts nothing. Launched before the zygote client
    # is imported: that import alone is ~70 ms of CPU the zygote need not wait for.
    from gym_fork import zygote_launch

    if zygote_launch.launch_early():
        from gym_fork.hosts.process import zygote

        zygote.adopt_early()
        # What the first vector env imports next, now, while the zygote starts (the
        # first env: 0.086 s instead of 0.111 s, median of 5, 2 cores).
        import gym_fork.hosts.process.host  # noqa: F401


def __getattr__(name: str):
    # Lazy: the warm parent imports gym_fork.* without paying for the vector env.
    if name == "ForkVectorEnv":
        _start_zygote_early()
        from gym_fork.vector.fork_vector_env import ForkVectorEnv

        return ForkVectorEnv
    if name == "autotune":
        from gym_fork.vector.autotune import autotune

        return autotune
    if name == "make_vec":
        _start_zygote_early()
        from gym_fork.make import make_vec

        return make_vec
    if name == "vector_entry_point":
        from gym_fork.make import vector_entry_point

        return vector_entry_point
    if name == "SandboxLimits":
        from gym_fork.system.isolation import SandboxLimits

        return SandboxLimits
    raise AttributeError(f"module 'gym_fork' has no attribute {name!r}")
