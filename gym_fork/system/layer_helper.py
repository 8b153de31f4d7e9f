"""The layer helper: a root process of the controller's that freezes a source sandbox's
/tmp writes before a FORK (gym_fork/system/frozen_layers.py says how and why).

One per process host, started at its first freeze: forked by the controller's zygote
where one is ready (gym_fork/hosts/process/zygote.py: a millisecond or two), else
``python -S`` on this file (stdlib only: ~30 ms before its first answer); single-threaded
(a thread cannot enter another mount namespace), talking to the controller over a
SOCK_SEQPACKET pair: a request is a JSON object and the
source's pidfd; the answer a JSON object and, once frozen, the fd of the source's new
upper layer. It ends when the controller's end closes (the host's close, or the
controller's death: EOF), and is killed past a deadline. The controller's end files the
answers from a thread of its own (:meth:`LayerHelper._read_answers`).

(Over ~450 lines as one job: the controller's end and the helper's loop speak one
protocol, numbered answers in the order asked, and are read side by side.)
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the helper imports as little as it can: it starts at a first fork
    from typing import Any, NoReturn

    from gym_fork.system.linux import ProcessWatch

_MAX_REQUEST = 4096
ANSWER_TIMEOUT_S = 5.0  # a freeze moves a directory's entries: milliseconds
# How long a seal after the source reopened its files waits for a writer to go (a thread
# of its closing a file it opened before the freeze); the source's FORK waits as long.
SEAL_PATIENCE_S = 0.05
MAX_QUEUED = 32  # requests sent and not answered yet, at most
ANSWER_WAIT_S = 2 * ANSWER_TIMEOUT_S  # the request the helper is on, at most
LONGEST_WAIT_S = 6 * ANSWER_TIMEOUT_S  # one caller's wait, behind others' requests too


class LayerLost(RuntimeError):
    """The helper may have frozen a source's /tmp, and its new layer did not come back:
    it ended while that freeze may have been the request it was on (any freeze not
    answered yet, where the controller ended it: an answer sent may not have been read
    then), or its answer came without the layer. The source's /tmp then stands on a
    layer no one holds."""


class LayerHelper:
    """The controller's end: :meth:`freeze` asks, ``close`` ends the helper."""

    def __init__(
        self, size_bytes: int, forked: tuple[socket.socket, ProcessWatch] | None = None
    ) -> None:
        """``size_bytes``: the upper layers' size (the helper makes the next one ahead).
        ``forked``: a helper a zygote forked already (our end of its socket, a watch of
        it); without it a fresh interpreter is started."""
        import collections  # the controller's end only: the helper itself imports none
        import itertools
        import subprocess
        import threading

        from gym_fork.system.held_signals import held

        self._held = held
        self.process: subprocess.Popen | None = None  # ours to reap, where we started it
        self.watch: ProcessWatch | None = None  # a zygote's child: known by its pidfd
        if forked is not None:
            self.sock, self.watch = forked
        else:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-S", "-E", __file__, str(theirs.fileno()), str(size_bytes)],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # not in the controller's terminal's signals
                )
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            self.sock = ours
        self.sock.settimeout(ANSWER_TIMEOUT_S)
        # The helper answers in the order it was asked: each request gets a number, each
        # answer goes to the oldest number unanswered, and is kept until its asker takes
        # it (two threads forking two sources of one host never take each other's
        # answer, nor new layer fd). A thread of its own takes the answers off the
        # socket as they come and files them (:meth:`_read_answers`): the helper never
        # waits on a full socket, and a Ctrl-C (handled in the main thread only) never
        # comes between an answer's read and its filing, so none is lost or misfiled.
        # An RLock: a Condition's wait takes it back uninterruptibly (a plain Lock's
        # re-take can be cut by a Ctrl-C, and the ``with`` then releases another
        # thread's hold of it).
        self._asking = threading.RLock()
        self._filed = threading.Condition(self._asking)
        self._stop = False
        self._numbers = itertools.count()
        self._unanswered: collections.deque[int] = collections.deque()
        self._head_since = time.monotonic()  # when the oldest unanswered became so
        self._answers: dict[int, tuple[dict[str, Any], list[int]]] = {}
        self._abandoned: set[int] = set()  # their answers are dropped when read
        self.broken = ""  # why no freeze is asked any more
        # The requests it may have begun when it ended: the one it was on where it ended
        # by itself (every answer it sent was read: EOF), else every one unanswered (an
        # answer it sent may not have been read yet when the controller ended it).
        self.maybe_begun: frozenset[int] = frozenset()
        self._read_to_end = False  # the answers' thread read up to the helper's EOF
        self.freeze_ms: list[float] = []  # the helper's time of each freeze (the source waits)
        self.asked: dict[str, int] = {}  # requests sent, by op
        self.found_ahead = 0  # freezes that took what their check found (mount table, ...)
        _inherited_by_forks(self)
        self._reader = threading.Thread(
            target=self._read_answers, name="gym_fork layer helper answers", daemon=True
        )
        self._reader.start()

    def alive(self) -> bool:
        """Whether the helper process still runs."""
        if self.process is not None:
            return self.process.poll() is None
        return self.watch is not None and self.watch.alive()

    def ask_wrote_since(self, pidfd: int, layer_fd: int) -> int:
        """Ask, without waiting, whether the sandbox ``pidfd`` wrote anything in its
        private layer (fd ``layer_fd`` of its) to freeze: the number to pass to
        :meth:`wrote_since` for the answer, or to :meth:`forget`. RuntimeError where the
        helper is broken."""
        return self._send({"op": "check", "layer_fd": layer_fd}, [pidfd])

    def wrote_since(self, number: int, wait: bool = True) -> bool:
        """The answer to :meth:`ask_wrote_since` ``number``: True unless the helper saw an
        empty layer (or broke: the freeze asked next says why). ``wait=False``: True at
        once where the answer has not come yet (it is forgotten)."""
        if not wait:
            with self._asking:
                if number not in self._answers:
                    self.forget(number)
                    return True
        try:
            answer, fds = self._answer(number)
        except RuntimeError:
            return True
        for fd in fds:
            os.close(fd)
        return answer.get("writes") is not False

    def forget(self, number: int) -> None:
        """An answer asked for and no longer wanted (its fork failed first)."""
        with self._asking:
            if number in self._unanswered:
                self._abandoned.add(number)
            for fd in self._answers.pop(number, ({}, []))[1]:
                os.close(fd)

    def freeze(
        self, pidfd: int, layer_fd: int, size_bytes: int, base: str
    ) -> tuple[int, int, int | None]:
        """Freeze the /tmp writes of the sandbox ``pidfd``: (its new upper layer's fd, to
        hand to it; its depth now; the token to :meth:`seal` the frozen layer with once
        it has reopened its files, or None where the helper sealed it already). Raises
        RuntimeError with the helper's reason when it did not (the source is then as it
        was), LayerLost where the helper ended on this freeze; a helper that does not
        answer in time is killed, and every later call raises.

        The caller holds signals (``held_signals.held``) from here until the layer has
        its next holder: a KeyboardInterrupt in the wait drops the answer, layer and all.
        """
        request = {"op": "freeze", "layer_fd": layer_fd, "size": size_bytes, "base": base}
        number = self._send(request, [pidfd])  # RuntimeError: ended before: nothing asked
        try:
            answer, fds = self._answer(number)
        except RuntimeError as exc:
            if number in self.maybe_begun:  # it may have ended on this very freeze
                raise LayerLost(f"the layer helper ended during its freeze ({exc})") from exc
            raise  # it ended on an earlier request: this freeze never began
        if not answer.get("frozen"):
            for fd in fds:
                os.close(fd)
            raise RuntimeError(str(answer.get("why")))
        return self._frozen(answer, fds)

    def _frozen(self, answer: dict[str, Any], fds: list[int]) -> tuple[int, int, int | None]:
        """A freeze's answer: (the new layer's fd, the depth, the token or None)."""
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise LayerLost("the layer helper's answer to its freeze came without its layer")
        took = answer.get("ms")
        if isinstance(took, float):
            self.freeze_ms = [*self.freeze_ms[-999:], took]
        if isinstance(answer.get("found_ahead"), int):  # freezes that took their check's
            self.found_ahead = answer["found_ahead"]
        token = answer.get("token")
        return fds[0], int(answer["depth"]), None if token is None else int(token)

    def seal(self, token: int) -> str:
        """Make the layer frozen under ``token`` read-only ("" once it is, else why not:
        kept, asked again later)."""
        try:
            answer, fds = self._ask({"op": "seal", "token": token}, [])
        except RuntimeError as exc:
            return str(exc)
        for fd in fds:
            os.close(fd)
        return "" if answer.get("sealed") else str(answer.get("why"))

    def _ask(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        return self._answer(self._send(request, fds))

    def _send(self, request: dict[str, Any], fds: list[int]) -> int:
        # Signals held outside the lock: their handlers (a user's too) run once it is
        # free. A request sent is recorded as sent, else later answers are misfiled;
        # one whose number a held Ctrl-C keeps from its caller is forgotten.
        number: int | None = None
        try:
            with self._held(), self._asking:
                if self.broken:
                    raise RuntimeError(self.broken)
                # A short queue: the helper takes requests one at a time, and a send into
                # a full socket would wait on it (a fork of hundreds of sources).
                started = time.monotonic()
                while len(self._unanswered) >= MAX_QUEUED:
                    self._wait_for_answers(self._left(started))
                    if self.broken:
                        raise RuntimeError(self.broken)
                number = next(self._numbers)
                try:
                    socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                except OSError as exc:  # timeout included
                    self._break(f"the layer helper did not take a request ({exc})", exc)
                if not self._unanswered:
                    self._head_since = time.monotonic()
                self._unanswered.append(number)
                op = str(request.get("op", "freeze"))
                self.asked[op] = self.asked.get(op, 0) + 1
            assert number is not None
            return number
        except BaseException:
            if number is not None:
                self.forget(number)
            raise

    def _answer(self, number: int) -> tuple[dict[str, Any], list[int]]:
        """Answer ``number``, once the answers' thread has filed it: the helper is ended
        where the request it is on (the oldest unanswered) waits past ANSWER_WAIT_S, or
        this one past LONGEST_WAIT_S. Where this is interrupted (a Ctrl-C too) the answer
        is dropped when filed (its fds closed)."""
        started = time.monotonic()
        try:
            with self._asking:
                while number not in self._answers:
                    if self.broken:
                        raise RuntimeError(self.broken)
                    if number not in self._unanswered:
                        raise RuntimeError(f"no request {number} waits for its answer")
                    self._wait_for_answers(self._left(started))
                return self._answers.pop(number)
        except BaseException:
            self.forget(number)
            raise

    def _left(self, started: float) -> float:
        """With the lock held: how long a wait begun at ``started`` may go on, judged by
        the helper's progress (the request it is on, asked or answered last, waits at
        most ANSWER_WAIT_S: a deadline of each, not of the queue before it) and bounded
        by LONGEST_WAIT_S; past either, the helper is ended (RuntimeError)."""
        now = time.monotonic()
        left = min(self._head_since + ANSWER_WAIT_S, started + LONGEST_WAIT_S) - now
        if left <= 0:
            self._break("the layer helper did not answer in time", TimeoutError(f"{left:.1f}"))
        return left

    def _wait_for_answers(self, timeout: float) -> None:
        """With the lock held: until an answer is filed (or the helper ends), at most
        ``timeout`` seconds; the lock is held again whatever cut the wait short."""
        try:
            self._filed.wait(timeout)
        except BaseException:
            # A Ctrl-C right after the wait let go of the lock, before it could take it
            # back: the caller's ``with`` would release a lock it no longer holds.
            if not self._asking._is_owned():  # type: ignore[attr-defined]
                with self._held():
                    self._asking.acquire()
            raise

    def _read_answers(self) -> None:
        """Thread: take each answer off the socket as it comes and file it under the
        oldest unanswered request's number, until the helper ends; then no request is
        asked any more (whatever ended it), and the socket is closed here, by its one
        reader (a close elsewhere could hand its number to a new file midway)."""
        why = "the layer helper's answers are no longer read"
        try:
            why = self._file_answers()
        finally:
            with self._asking:
                if not self.broken:
                    self._stop_asking(why)
                self._filed.notify_all()
            self.sock.close()

    def _file_answers(self) -> str:
        """Why the answers end: "" once closed, else what the helper did."""
        while True:
            got: list[int] = []
            try:
                data, got, _flags, _addr = socket.recv_fds(self.sock, _MAX_REQUEST, 1)
            except TimeoutError:
                if self._stop:
                    return ""
                continue  # nothing asked, or a freeze still at work: its asker's deadline
            except ConnectionResetError:
                # It ended with requests unread: the kernel says so first, then hands
                # over what it sent (a freeze's layer included), then EOF.
                continue
            except OSError as exc:
                data, why = b"", f"the layer helper did not answer ({exc})"
            else:
                why = "the layer helper ended"
                self._read_to_end = not data  # EOF: each answer it sent was filed
            with self._asking:
                if self._stop:
                    for fd in got:
                        os.close(fd)
                    return ""
                why = self._file(data, got) if data else why
                if why:
                    return why
                self._filed.notify_all()

    def _file(self, data: bytes, got: list[int]) -> str:
        """With the lock held: file one answer; why it cannot be ("" once filed)."""
        try:
            answer = json.loads(data)
            if not isinstance(answer, dict):
                raise ValueError(f"an answer that is no object: {answer!r:.100}")
            if not self._unanswered:
                raise ValueError("an answer nobody asked for")
        except ValueError as exc:
            for fd in got:
                os.close(fd)
            return f"the layer helper did not answer ({exc})"
        oldest = self._unanswered.popleft()
        self._head_since = time.monotonic()  # the next request's turn begins
        if oldest in self._abandoned:
            self._abandoned.discard(oldest)
            for fd in got:
                os.close(fd)
        else:
            self._answers[oldest] = (answer, got)
        return ""

    def _break(self, why: str, cause: BaseException) -> NoReturn:
        """With the lock held: no request is asked any more; end the helper."""
        self._stop_asking(why)
        raise RuntimeError(why) from cause

    def _stop_asking(self, why: str) -> None:
        """With the lock held: no request is asked any more (``why``), those it may have
        begun remembered (``maybe_begun``); the helper is ended and every waiter woken."""
        self.broken = why
        unanswered = list(self._unanswered)
        self.maybe_begun = frozenset(unanswered[:1] if self._read_to_end else unanswered)
        self._unanswered.clear()
        self._end()
        self._filed.notify_all()

    def close(self) -> None:
        """End the helper (EOF on its socket), killed if it takes more than a second. A
        freeze under way in another thread fails (LayerLost where it was the request
        the helper was on)."""
        with self._asking:
            if not self.broken:
                self._stop_asking("the layer helper was closed")
        self._reader.join(ANSWER_TIMEOUT_S)
        if not self._reader.is_alive():
            self.sock.close()  # closed by the reader already, unless it never ran

    def _end(self) -> None:
        """With the lock held: end the helper and its answers' thread (EOF on the socket:
        the thread closes it)."""
        import subprocess

        self._stop = True
        with contextlib.suppress(OSError):  # wakes the answers' thread: EOF
            self.sock.shutdown(socket.SHUT_RDWR)
        if self.process is not None:
            try:
                self.process.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                self.process.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel
                    self.process.wait(timeout=1.0)
        elif self.watch is not None:  # its zygote reaps it
            if not self.watch.wait_dead(1.0):
                self.watch.kill()
                self.watch.wait_dead(1.0)
            self.watch.close()

    def _inherited(self) -> None:
        """In a process forked from the controller (the answers' thread did not come
        along): this end is the parent's. Nothing is asked from here, and only this
        process's copies are let go of: no shutdown of the shared socket, no kill."""
        import threading

        self._asking = threading.RLock()  # held by the parent's thread, maybe
        self._filed = threading.Condition(self._asking)
        self.broken = "a process forked from the controller does not ask its layer helper"
        self._stop = True
        self._unanswered.clear()
        for _answer, fds in self._answers.values():
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._answers.clear()
        self.process = None
        if self.watch is not None:
            self.watch.close()  # this process's copy of the pidfd
            self.watch = None
        self.sock.close()


_live_helpers: Any = None  # a WeakSet of LayerHelper, once the first one starts


def _inherited_by_forks(helper: LayerHelper) -> None:
    """Have a fork of this process let go of ``helper`` (:meth:`LayerHelper._inherited`)."""
    global _live_helpers
    if _live_helpers is None:
        import weakref

        _live_helpers = weakref.WeakSet()
        os.register_at_fork(after_in_child=_let_go_in_child)
    _live_helpers.add(helper)


def _let_go_in_child() -> None:
    for helper in list(_live_helpers or ()):
        helper._inherited()


class _Pending:
    """The frozen layers not sealed yet, each with a pidfd of its source: a layer whose
    source has exited is let go of at once (it would pin a whole workspace's memory)."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[int, int]] = {}  # token -> (layer fd, source's pidfd)

    def keep(self, token: int, layer: int, source_pidfd: int) -> None:
        self.layers[token] = (layer, os.dup(source_pidfd))

    def layer(self, token: int) -> int:
        return self.layers.get(token, (-1, -1))[0]

    def drop(self, token: int) -> None:
        for fd in self.layers.pop(token):
            os.close(fd)

    def wait_for(self, sock: socket.socket) -> None:
        """Until ``sock`` has a request (or EOF); meanwhile drop the layers of sources
        that exit."""
        import select

        while True:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)
            sources = {pidfd: token for token, (_layer, pidfd) in self.layers.items()}
            for pidfd in sources:
                poller.register(pidfd, select.POLLIN)
            ready = {fd for fd, _events in poller.poll()}
            for pidfd in ready & sources.keys():
                self.drop(sources[pidfd])
            if sock.fileno() in ready:
                return


def serve(sock: socket.socket, size_bytes: int) -> None:
    """The helper's loop: one freeze or seal per request, until EOF. A frozen layer's fd
    waits here for its seal (or its drop). The new tmpfs a freeze needs are made while
    no source waits: before the first request, and after each answer."""
    try:
        from gym_fork.system import frozen_layers
    except ImportError:  # run as a script (python -S): sys.path[0] is this file's folder
        import frozen_layers  # type: ignore[import-not-found,no-redef]

    with contextlib.suppress(OSError):
        frozen_layers.make_spares(size_bytes)
    pending = _Pending()
    sealed: dict[int, None] = {}  # the tokens sealed lately, oldest first
    tokens = iter(range(1, 1 << 62))
    while True:
        pending.wait_for(sock)  # a source gone meanwhile lets go of its layers
        data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_REQUEST, 1)
        if not data:
            return
        started = time.perf_counter()
        answer: dict[str, Any] = {"frozen": False}
        new = -1
        try:
            request = json.loads(data)
            if request.get("op") == "check":  # read-only: asked ahead of a fork
                if len(fds) != 1:
                    raise frozen_layers.FreezeRefused("no pidfd came with the request")
                answer = {"writes": frozen_layers.wrote_since(fds[0], int(request["layer_fd"]))}
            elif request.get("op") == "seal":
                token = int(request["token"])
                layer = pending.layer(token)
                answer = {"sealed": token in sealed, "why": "no such frozen layer"}
                if layer >= 0:  # kept where it fails: the source's next fork asks again
                    frozen_layers.seal(layer, patience_s=SEAL_PATIENCE_S)
                    pending.drop(token)
                    answer = {"sealed": True}
                    # Asked again when an answer was lost (a Ctrl-C): sealed it stays.
                    sealed[token] = None
                    if len(sealed) > 4096:
                        del sealed[next(iter(sealed))]
            else:
                if len(fds) != 1:
                    raise frozen_layers.FreezeRefused("no pidfd came with the request")
                new, depth, unsealed = frozen_layers.freeze(
                    fds[0], int(request["layer_fd"]), int(request["size"]), str(request["base"])
                )
                answer = {"frozen": True, "depth": depth, "token": None}
                answer["found_ahead"] = frozen_layers.checks.found_taken
                if unsealed is not None:  # sealed once the source has reopened its files
                    answer["token"] = token = next(tokens)
                    pending.keep(token, unsealed, fds[0])
        except frozen_layers.FreezeRefused as exc:
            answer["why"] = str(exc)
        except Exception as exc:  # told to the controller, which copies instead
            answer["why"] = f"{type(exc).__name__}: {exc}"
        finally:
            for fd in fds:
                os.close(fd)
        answer["ms"] = (time.perf_counter() - started) * 1e3
        socket.send_fds(sock, [json.dumps(answer).encode()], [new] if new >= 0 else [])
        if new >= 0:
            os.close(new)
        with contextlib.suppress(OSError):  # a freeze that needs one makes it, or says why
            frozen_layers.make_spares(size_bytes)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])), int(sys.argv[2]))
