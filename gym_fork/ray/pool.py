"""The controller's side of the shard actors: one pool per lineage tree (a root and its
branches share its actors), actors started with hard node affinity and ended when their
last handle closes."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from gym_fork.ray.actor import remote_class


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's entries of the alive nodes that have CPUs."""
    import ray

    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]


def actor_error(err: Any) -> BaseException:
    """The exception an actor method raised, with the actor-side traceback as a note."""
    cause = getattr(err, "cause", None)
    if not isinstance(cause, BaseException):
        return err
    remote = getattr(err, "traceback_str", None)
    if remote:
        cause.add_note(f"raised in a shard actor:\n{remote}")
    return cause


@dataclass(eq=False)
class ActorEntry:
    """One shard actor: where it runs and the handles (vector envs) it holds."""

    actor: Any
    node_id: str
    pid: int
    handles: set[str] = field(default_factory=set)
    alive: bool = True


class ActorPool:
    """The actors of one lineage tree (a root and all its branches share them)."""

    def __init__(self, actor_options: dict[str, Any]) -> None:
        self.actor_options = actor_options
        self.entries: list[ActorEntry] = []
        self.lock = threading.Lock()

    def spawn(self, node_ids: list[str]) -> list[ActorEntry]:
        """Start one actor on each of ``node_ids`` (hard node affinity), in parallel."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options = {"num_cpus": 0, **self.actor_options}
        actors = [
            remote_class()
            .options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                **options,
            )
            .remote()
            for node_id in node_ids
        ]
        where = ray.get([a.where.remote() for a in actors])
        entries = [ActorEntry(a, node, pid) for a, (node, pid) in zip(actors, where, strict=True)]
        with self.lock:
            self.entries.extend(entries)
        return entries

    def for_node(self, node_id: str) -> ActorEntry:
        """A live actor on ``node_id`` (the least loaded), started if there is none."""
        with self.lock:
            live = [e for e in self.entries if e.alive and e.node_id == node_id]
        if live:
            return min(live, key=lambda e: len(e.handles))
        return self.spawn([node_id])[0]

    def lost(self, entry: ActorEntry) -> None:
        """Forget a dead actor (and make sure it is dead: no half-alive shard)."""
        import ray

        entry.alive = False
        with self.lock:
            if entry in self.entries:
                self.entries.remove(entry)
        with contextlib.suppress(Exception):
            ray.kill(entry.actor, no_restart=True)

    def release(self, entry: ActorEntry, handle: str) -> None:
        """A handle closed; an actor left with none is ended."""
        entry.handles.discard(handle)
        if not entry.handles and entry.alive:
            self.lost(entry)
