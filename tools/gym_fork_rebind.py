"""pytest plugin: make ``gymnasium.vector.AsyncVectorEnv`` mean ``ForkVectorEnv``.

Loaded with ``-p gym_fork_rebind`` before Gymnasium's own tests import anything, so
that every ``from gymnasium.vector import AsyncVectorEnv`` and every
``gym.make_vec(..., vectorization_mode="async")`` gets gym_fork instead.
"""

import gymnasium.vector
import gymnasium.vector.async_vector_env

from gym_fork import ForkVectorEnv

gymnasium.vector.AsyncVectorEnv = ForkVectorEnv
gymnasium.vector.async_vector_env.AsyncVectorEnv = ForkVectorEnv
