"""A root vector env's start: its sandboxes built, their hellos read, the slabs attached.

What the facade adopts (``ForkVectorEnv._open``) once every sandbox said HELLO: the
metadata and spaces they reported (untrusted: decoded as plain data), whether
observations travel in the slab, and an observation buffer of the batch's shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gym_fork.errors import SandboxStartError
from gym_fork.transport.layout import async_shares, slab_node
from gym_fork.transport.space_codec import SpaceRefused, mapping_from_data

from .config import VectorConfig
from .lifecycle import Sandboxes
from .spaces import VectorSpaces, check_attached, empty_buffer


@dataclass
class Opened:
    """Started sandboxes, a root's or a branch's: what ``ForkVectorEnv._open`` adopts."""

    sandboxes: Sandboxes
    spaces: VectorSpaces
    metadata: dict[str, Any]
    render_mode: str | None
    obs_in_slab: bool
    observations: Any
    env_ids: list[Any] = field(default_factory=list)  # a root's: what each HELLO named


def open_root(config: VectorConfig) -> Opened:
    """Start the sandboxes of ``config`` and attach their slabs; on any failure every
    sandbox is torn down before the error is raised."""
    sandboxes, hellos = Sandboxes.start(config)
    try:
        first = hellos[0]
        try:
            metadata = mapping_from_data(first.get("metadata"), trusted=config.trusted)
        except SpaceRefused as exc:
            raise SandboxStartError(f"a sandbox reported malformed metadata: {exc}") from exc
        try:
            spaces = VectorSpaces.from_hellos(
                config.observation_mode, hellos, trusted=config.trusted
            )
            obs_in_slab = attach(sandboxes, spaces)
            observations = empty_buffer(spaces.single_observation_space, config.num_envs)
        except MemoryError as exc:  # a space cheap to declare, too big to batch or hold
            raise SandboxStartError(
                f"the spaces the sub-envs declare need more memory than this machine "
                f"gives to batch {config.num_envs} of them (numpy: {exc}); check their "
                "observation_space and action_space shapes"
            ) from None
    except BaseException:
        sandboxes.teardown(terminate=True)
        raise
    metadata["autoreset_mode"] = config.autoreset_mode
    render_mode = first.get("render_mode")
    return Opened(
        sandboxes,
        spaces,
        metadata,
        render_mode if isinstance(render_mode, str) else None,
        obs_in_slab,
        observations,
        [h.get("spec_id") for h in hellos],
    )


def attach(sandboxes: Sandboxes, spaces: VectorSpaces) -> bool:
    """Open the slabs and have every worker map its own; whether observations travel in
    the slab."""
    config = sandboxes.config
    single = spaces.single_observation_space
    if config.shared_memory and not async_shares(single):
        raise ValueError(
            "Using `AsyncVector(..., shared_memory=True)` caused an error, you can disable "
            "this feature with `shared_memory=False` however this is slower. "
            f"(ForkVectorEnv: {single} has no shared layout.)"
        )
    # Spaces Async shares but that have no fixed-size slab layout (OneOf) travel in ring
    # records: same results, one copy more.
    obs_in_slab = config.shared_memory and slab_node(single, 1) is not None
    sandboxes.open_slabs(spaces, obs_in_slab)
    checks = sandboxes.attach_all(spaces, obs_in_slab)
    check_attached(checks, config.observation_mode, spaces.single_action_space)
    return obs_in_slab
