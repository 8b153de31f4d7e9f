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
]


def prestart(wait: bool = False) -> None:
    """Start this process's zygote now (gym_fork/hosts/process/zygote.py), so that even
    the first ``ForkVectorEnv`` starts in milliseconds: call it early, e.g. before
    loading a model. In the background unless ``wait``."""
    from gym_fork.hosts.process import zygote

    zygote.prestart(wait=wait)


def __getattr__(name: str):
    # Lazy: the warm parent imports gym_fork.* without paying for the vector env.
    if name == "ForkVectorEnv":
        from gym_fork.vector.fork_vector_env import ForkVectorEnv

        return ForkVectorEnv
    if name == "autotune":
        from gym_fork.vector.autotune import autotune

        return autotune
    if name == "make_vec":
        from gym_fork.make import make_vec

        return make_vec
    if name == "SandboxLimits":
        from gym_fork.system.isolation import SandboxLimits

        return SandboxLimits
    raise AttributeError(f"module 'gym_fork' has no attribute {name!r}")
