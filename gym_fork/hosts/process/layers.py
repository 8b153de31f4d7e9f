"""The controller's side of frozen /tmp layers: before a source forks, its writes become a
read-only layer its clones share, so a fork copies nothing of its workspace
(gym_fork/system/frozen_layers.py says how; the layer helper does it).

Where it cannot (no root here, a kernel before 6.6, no private /tmp or tree view, a
writable host directory, ``GYM_FORK_TMP_LAYERS=0``, or the helper says why for this
source), the source's clones copy its writes, as before; the reason is logged once at
DEBUG on the ``gym_fork`` logger.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

from gym_fork import knobs
from gym_fork.hosts.base import WorkerHandle
from gym_fork.hosts.process import zygote
from gym_fork.system import frozen_layers
from gym_fork.system.held_signals import held
from gym_fork.system.host_view import TREE_TMP_VIEW
from gym_fork.system.isolation import IsolationConfig
from gym_fork.system.layer_helper import LayerHelper, LayerLost

log = logging.getLogger("gym_fork")


class TmpLayers:
    """One process host's freezes: its layer helper, started at the first one."""

    def __init__(self, isolation: IsolationConfig) -> None:
        self.isolation = isolation
        self.helper: LayerHelper | None = None
        self.off = self._why_off()
        self.said: set[str] = set()
        # pid -> why its frozen layers are not read-only, their tokens (asked again at its
        # next fork: the cause may be gone, e.g. a deleted file it mapped) and its watch
        # (forgotten once it has exited: the helper lets go of its layers then). A token
        # is here from its freeze on, and leaves once sealed: whatever stops a fork
        # midway (a Ctrl-C included) leaves it to be sealed before the next one.
        self.unsealed: dict[int, tuple[str, list[int], Any]] = {}
        # pid -> why its /tmp's layer is unknown to gym_fork (a freeze whose new layer
        # never reached it: the helper ended mid-freeze, or a fork was interrupted
        # twice): its clones would copy a stale layer and miss its writes, so it is not
        # forked again. Forgotten once it has exited.
        self.lost: dict[int, tuple[str, Any]] = {}
        # pid -> a freeze's (new layer fd, token) not yet sent to its source
        self.in_flight: dict[int, tuple[int, int | None]] = {}
        self._starting = threading.Lock()  # one helper, whichever thread forks first
        self.closed = False  # no helper is started any more
        # Each fork's layer swap as its source lived it, ms, as it said (benchmarks read
        # it): waiting for its new layer, adopting it (its files reopened), its seal.
        # A source forks its clones while the helper freezes: its wait is what the
        # freeze outlasts the fork (benchmarks/agent_workspace.py).
        self.swap_ms: list[float] = []
        # source pid -> the number of the helper's answer to "anything to freeze?", asked
        # as its fork began (check_soon) and taken by its freeze (or forgotten at its next
        # fork's check, or once it is gone: a fork that failed before its freeze), and its
        # watch
        self.checks: dict[int, tuple[int, Any]] = {}

    def checks_soon(self, sources: Sequence[WorkerHandle], tree: dict[str, Any]) -> None:
        """A fork of ``sources`` begins: :meth:`check_soon` each, after forgetting the
        checks of sources gone since (their forks failed before their freeze)."""
        for pid, (_number, watch) in list(self.checks.items()):
            if not watch.alive():
                self._forget_check(pid)
        with held():  # one swap of the handlers for them all
            for source in sources:
                self.check_soon(source, tree)

    def check_soon(self, source: WorkerHandle, tree: dict[str, Any]) -> None:
        """A fork of ``source`` begins: ask the helper now, without waiting, whether there
        is anything to freeze, so that its round trip (~0.5 ms) overlaps the controller's
        preparation of the fork instead of following it. Read-only: an answer the fork
        never takes is forgotten."""
        self._forget_check(source.pid)
        if self.off or _why_not_for(source, tree):
            return
        try:
            with held():  # asked is recorded: else its answer is kept for no one
                number = self._helper().ask_wrote_since(*_layer_of(source))
                self.checks[source.pid] = (number, source.watch)
        except (OSError, RuntimeError):
            return  # the freeze asks again, and says why

    def _forget_check(self, pid: int) -> None:
        number, _watch = self.checks.pop(pid, (None, None))
        if number is not None and self.helper is not None:
            self.helper.forget(number)

    def _helper(self) -> LayerHelper:
        with self._starting:
            if self.closed:  # a fork racing the host's close: its sources copy
                raise RuntimeError("the host is closed")
            if self.helper is None:
                size = self.isolation.layer_bytes()
                with held():  # started is kept: else its process and thread live on
                    self.helper = LayerHelper(size, zygote.fork_layer_helper(size))
            return self.helper

    def _why_off(self) -> str:
        if knobs.read("GYM_FORK_TMP_LAYERS") == "0":
            return "GYM_FORK_TMP_LAYERS=0"
        if os.geteuid() != 0:
            return "the controller is not root (the layer helper mounts in a sandbox's namespace)"
        if not frozen_layers.kernel_supports_layers():
            return f"kernel {os.uname().release} (tmpfs keeps user.* xattrs from 6.6)"
        if not self.isolation.private_tmp or self.isolation.shared_writable():
            return "sandboxes write a host directory (their clones get no namespaces)"
        return ""

    def may_freeze(self, source: WorkerHandle, tree: dict[str, Any]) -> bool:
        """Before a FORK of ``source``: whether its /tmp writes may be frozen (then
        :meth:`wrote` and :meth:`freeze` follow its FORK request); else its clones copy
        them. Raises RuntimeError for a source whose frozen layer could not be sealed
        before (no clone may stand on a layer that can still be written), or whose
        layer was lost."""
        if self.helper is not None and self.helper.broken and not self.off:
            self.off = self.helper.broken  # ended between forks: its sources copy
        for pid, (_why, _tokens, watch) in list(self.unsealed.items()):
            if not watch.alive():
                self.unsealed.pop(pid, None)
        for pid, (_why, watch) in list(self.lost.items()):
            if not watch.alive():
                self.lost.pop(pid, None)
        if source.pid in self.lost:
            raise RuntimeError(
                f"fork of {source.name}: {self.lost[source.pid][0]}; its branches would "
                "miss its /tmp writes, so it is not forked again"
            )
        if source.pid in self.unsealed:
            self._seal_again(source)
        why = self.off or _why_not_for(source, tree)
        if why:
            self._forget_check(source.pid)
            self._say(source, why)
        return not why

    def wrote(self, source: WorkerHandle) -> bool:
        """Whether ``source`` wrote anything to freeze since its last freeze: the answer
        :meth:`check_soon` asked for where it has come (True without one: the freeze,
        asked at once, looks). Not waited for: the helper answers in order, so a freeze
        asked now follows the check there (which read ahead what it needs) without the
        check's answer going to the controller and the freeze's request coming back
        (~0.8 ms of a fork's critical path on 2 busy cores)."""
        checked, _watch = self.checks.pop(source.pid, (None, None))
        if checked is None or self.helper is None:
            return True
        return self.helper.wrote_since(checked, wait=False)

    def freeze(self, source: WorkerHandle) -> tuple[int, int | None] | None:
        """Freeze the /tmp writes of ``source`` (:meth:`may_freeze` said so): (the fd of
        its new upper layer, to send it; the token to :meth:`seal` with once it has
        reopened its files, or None where the helper sealed the frozen layer already),
        or None (its clones copy them; the helper said why). RuntimeError where the
        helper ended midway: the source's layer is unknown then, and it is not forked
        again. Signals wait (``held``) until the result is kept in flight: a Ctrl-C in
        the helper's answer comes once it is (the caller sends it on)."""
        with held():
            try:
                fd, _depth, token = self._helper().freeze(
                    *_layer_of(source), self.isolation.layer_bytes(), TREE_TMP_VIEW
                )
            except LayerLost as exc:  # its /tmp may stand on the new layer already
                if self.helper is not None and self.helper.broken:
                    self.off = self.helper.broken
                self.lose(source, str(exc))
                raise RuntimeError(f"fork of {source.name}: {exc}") from exc
            except (OSError, RuntimeError) as exc:
                if self.helper is not None and self.helper.broken:
                    self.off = self.helper.broken  # it ended before this freeze began
                self._say(source, str(exc))
                return None
            return self._started(source, fd, token)

    def _started(self, source: WorkerHandle, fd: int, token: int | None) -> tuple[int, int | None]:
        """A freeze's result, kept (in flight, and its token as unsealed) until it is
        sent and sealed."""
        self.in_flight[source.pid] = (fd, token)
        if token is not None:
            self._unsealed(source, token, "it was not sealed yet")
        return fd, token

    def take_in_flight(self, source: WorkerHandle) -> tuple[int, int | None] | None:
        """The freeze of ``source`` not sent to it yet (its caller sends it now)."""
        return self.in_flight.pop(source.pid, None)

    def lose(self, source: WorkerHandle, why: str) -> None:
        """``source``'s /tmp may stand on a layer it never received (``why``; "": the
        helper surely froze nothing): not forked again."""
        if why:
            self.lost[source.pid] = (why, source.watch)

    def _unsealed(self, source: WorkerHandle, token: int, why: str) -> None:
        tokens = self.unsealed.get(source.pid, ("", [], source.watch))[1]
        if token not in tokens:
            tokens = [*tokens, token]
        self.unsealed[source.pid] = (why, tokens, source.watch)

    def _say(self, source: WorkerHandle, why: str) -> None:
        """Log once at DEBUG why a source's clones copy its /tmp writes."""
        if why not in self.said and why != "nothing to freeze":
            self.said.add(why)
            log.debug("gym_fork: %s's clones copy its /tmp writes: %s", source.name, why)

    def seal(self, source: WorkerHandle, token: int) -> str:
        """Make ``source``'s layer frozen under ``token`` read-only, once it has reopened
        its files ("", else why not: the source's next fork asks again, and is refused
        while it cannot be). Never let go of unsealed, even where its FORK failed: the
        source's /tmp stands on it."""
        why = self._ask_seal(token)
        if why:
            self._unsealed(source, token, why)
            return why
        self._sealed(source, token)
        return why

    def _sealed(self, source: WorkerHandle, token: int) -> None:
        why, tokens, watch = self.unsealed.get(source.pid, ("", [], source.watch))
        left = [t for t in tokens if t != token]
        if left:
            self.unsealed[source.pid] = (why, left, watch)
        else:
            self.unsealed.pop(source.pid, None)

    def _seal_again(self, source: WorkerHandle) -> None:
        """Before another fork of a source whose frozen layers could not be sealed:
        try again; RuntimeError while one still cannot (no clone may stand on it). Each
        token leaves the record only once sealed."""
        _why, tokens, _watch = self.unsealed[source.pid]
        for token in list(tokens):
            again = self._ask_seal(token)
            if again:
                self._unsealed(source, token, again)
            else:
                self._sealed(source, token)
        if source.pid in self.unsealed:
            why = self.unsealed[source.pid][0]
            raise RuntimeError(
                f"fork of {source.name}: its /tmp's frozen layer is not read-only ({why}): "
                "it is forked again once it can be made so"
            )

    def _ask_seal(self, token: int) -> str:
        if self.helper is None:
            return "the layer helper has ended"
        return self.helper.seal(token)

    def source_swapped(self, layer_ms: float) -> None:
        """A source's word on its time on its new layer (ClonesForked): kept where it is
        a figure a swap could take (0 where no layer came: not kept)."""
        if type(layer_ms) is float and 0.0 < layer_ms <= 600_000.0:
            self.swap_ms = [*self.swap_ms[-999:], layer_ms]

    def close(self) -> None:
        """End the helper, if one was started."""
        with self._starting:
            self.closed = True
        self.checks.clear()
        for pid in list(self.in_flight):  # a fork in another thread may take one first
            taken = self.in_flight.pop(pid, None)
            if taken is not None:
                os.close(taken[0])
        helper, self.helper = self.helper, None
        if helper is not None:
            helper.close()


def _layer_of(source: WorkerHandle) -> tuple[int, int]:
    """(a pidfd of ``source``, the number of its private layer's fd in it): what the
    helper is asked about, where :func:`_why_not_for` found both."""
    pidfd = getattr(source.watch, "fd", -1)  # a ProcessWatch: _why_not_for checked
    return pidfd, source.info["isolation"]["sandbox"]["tmp_layer_fd"]


def _why_not_for(source: WorkerHandle, tree: dict[str, Any]) -> str:
    if not tree.get("tree", {}).get("tmp_view"):
        return "the tree has no read-only view of its /tmp"
    report = source.info.get("isolation")
    sandbox = report.get("sandbox") if isinstance(report, dict) else None
    layer = sandbox.get("tmp_layer_fd") if isinstance(sandbox, dict) else None
    if type(layer) is not int or layer < 0:
        return "it has no private /tmp layer of its own"
    if getattr(source.watch, "fd", -1) < 0:
        return "no pidfd of it"
    return ""
