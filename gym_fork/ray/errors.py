"""Errors of the Ray backend."""

from __future__ import annotations

from gym_fork.errors import SubEnvCrashed


class ShardLost(SubEnvCrashed):
    """A shard's Ray actor (or its whole node) died while serving a call.

    ``indices`` are the vector env's sub-env indices that lived on the lost shards,
    ``node_id`` the Ray node id of the first lost shard and ``lost`` one
    ``(node_id, indices)`` pair per lost shard. ``reset()`` rebuilds the lost shards, on
    the same node when it is still alive, else on another one.
    """

    code = "shard_lost"

    def __init__(
        self,
        message: str,
        *,
        indices: list[int],
        node_id: str | None,
        lost: list[tuple[str | None, list[int]]] | None = None,
        pid: int | None = None,
        exitcode: int | None = None,
    ) -> None:
        super().__init__(message, indices=indices, pid=pid, exitcode=exitcode)
        self.node_id = node_id
        self.lost = lost if lost is not None else [(node_id, list(indices))]

    def __reduce__(self):
        return (_rebuild, (str(self), self.indices, self.node_id, self.lost, self.pid))


def _rebuild(message, indices, node_id, lost, pid):
    return ShardLost(message, indices=indices, node_id=node_id, lost=lost, pid=pid)
