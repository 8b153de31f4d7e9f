"""gym_fork's asyncio face: :class:`AsyncForkVectorEnv` (gym_fork/aio/face.py)."""

from .face import AsyncForkVectorEnv

__all__ = ["AsyncForkVectorEnv"]
