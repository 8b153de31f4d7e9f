"""gym_fork on Ray: sub-envs sharded over Ray actors, one node-local ForkVectorEnv each.

Needs the ``ray`` extra (``pip install 'gym_fork[ray]'``). See docs/scale.md.
"""

try:
    import ray as _ray  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gym_fork.ray needs Ray: pip install 'gym_fork[ray]' (ray>=2.9)") from exc

from gym_fork.ray.cluster import loopback_cluster
from gym_fork.ray.errors import ShardLost
from gym_fork.ray.vector_env import RayForkVectorEnv

__all__ = ["RayForkVectorEnv", "ShardLost", "loopback_cluster"]
