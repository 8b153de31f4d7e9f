"""Per-sandbox stdout/stderr: captured through pipes, kept bounded, echoed by default.

One daemon thread per host drains every sandbox's two pipes (a sandbox must never block
on a full pipe), keeps the last ``limit`` bytes of each stream for diagnostics (crash
and timeout errors quote them), and by default echoes the bytes to the controller's own
stdout/stderr, as AsyncVectorEnv's workers print to the terminal. Where that stream
is a terminal (decided once per stream, when the collector starts), control characters
and bidi overrides are shown escaped (gym_fork.text_safety): a sandbox must not drive
the user's terminal. A file or pipe gets the bytes as written.

Echoing never blocks the controller: the drained bytes go to a bounded queue that a
second thread writes out without holding any lock. When the controller's stdout is
stalled (a full pipe nobody reads) the queue fills, further output is dropped and
counted, and a note says how much once writing works again.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import threading
from collections import deque

from gym_fork.text_safety import TerminalEscaper

DEFAULT_LIMIT = 64 * 1024
# Bytes of sandbox output waiting to be echoed before more is dropped.
ECHO_BUFFER = 1 << 20


class _Echo:
    """A bounded queue of output to copy to fds 1 and 2, written by its own thread.

    ``put`` never blocks; only the echo thread ever waits on a write (and escapes what
    goes to a terminal: the draining thread does not pay for it)."""

    def __init__(self, capacity: int = ECHO_BUFFER) -> None:
        self.capacity = capacity
        # Which of fds 1 and 2 are terminals, looked at once.
        self.terminal = {fd: os.isatty(fd) for fd in (1, 2)}
        self.queue: deque[tuple[int, bytes, TerminalEscaper | None]] = deque()
        self.size = 0
        self.dropped = 0
        self.closed = False
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="gym_fork-echo", daemon=True)
        self._thread.start()

    def escaper(self, fd: int) -> TerminalEscaper | None:
        """What one source's output to ``fd`` goes through: an escaper if ``fd`` is a
        terminal (one per source: it keeps a character split across chunks whole)."""
        return TerminalEscaper() if self.terminal[fd] else None

    def put(self, fd: int, data: bytes, escaper: TerminalEscaper | None = None) -> None:
        """Queue ``data`` for ``fd`` (through ``escaper`` unless None); drop (and count)
        it when the queue is full."""
        with self._ready:
            if self.size + len(data) > self.capacity:
                self.dropped += len(data)
                return
            self.queue.append((fd, data, escaper))
            self.size += len(data)
            self._ready.notify()

    def close(self) -> None:
        """Stop after what is queued (a writer stuck on a stalled fd is abandoned)."""
        with self._ready:
            self.closed = True
            self._ready.notify()
        self._thread.join(0.2)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self.queue and not self.closed:
                    self._ready.wait()
                if not self.queue:
                    return
                fd, data, escaper = self.queue.popleft()
                self.size -= len(data)
                dropped, self.dropped = self.dropped, 0
            if dropped:
                note = f"\n[gym_fork: {dropped} bytes of sandbox output dropped: output stalled]\n"
                _write_all(2, note.encode())
            _write_all(fd, data if escaper is None else escaper(data))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except OSError:
            return


# The controller's fd a sandbox stream is echoed to.
_ECHO_FD = {"stdout": 1, "stderr": 2}


class _Stream:
    def __init__(self, limit: int, escaper: TerminalEscaper | None = None) -> None:
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.limit = limit
        self.escaper = escaper  # used by the echo thread only

    def add(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        while self.size - len(self.chunks[0]) >= self.limit:
            self.size -= len(self.chunks.popleft())

    def tail(self) -> bytes:
        return b"".join(self.chunks)[-self.limit :]


class OutputCollector:
    """Drains sandbox output pipes in the background; ``tail(key)`` returns recent bytes."""

    def __init__(self, *, echo: bool = True, limit: int = DEFAULT_LIMIT) -> None:
        self.echo = echo
        self.limit = limit
        self._streams: dict[tuple[str, str], _Stream] = {}
        # Each sandbox's read ends still open (a release touches only its own: a fork of
        # 64 sandboxes releases 64, and each once drained every sandbox's pipes).
        self._fds: dict[str, list[tuple[str, int]]] = {}
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._echo = _Echo() if echo else None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gym_fork-output", daemon=True)
        self._thread.start()

    def new_pipes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(read, write) pipes for a sandbox's stdout and stderr."""
        return os.pipe(), os.pipe()

    def watch(self, key: str, out_fd: int, err_fd: int) -> None:
        """Start draining a sandbox's read ends (the collector owns and closes them)."""
        with self._lock:
            for name, fd in (("stdout", out_fd), ("stderr", err_fd)):
                os.set_blocking(fd, False)
                escaper = self._echo.escaper(_ECHO_FD[name]) if self._echo else None
                self._streams[(key, name)] = _Stream(self.limit, escaper)
                self._selector.register(fd, selectors.EVENT_READ, (key, name))
                self._fds.setdefault(key, []).append((name, fd))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full wake pipe wakes it already
            os.write(self._wake_w, b"x")

    def tail(self, key: str, stream: str = "stderr") -> str:
        """The last bytes a sandbox wrote on ``stream`` (decoded leniently)."""
        with self._lock:
            self._drain(key)
            s = self._streams.get((key, stream))
            return s.tail().decode(errors="replace") if s else ""

    def forget(self, key: str) -> None:
        """Stop keeping a sandbox's output (after its end has been reported): what it
        wrote last is read (and echoed) first."""
        with self._lock:
            self._drain(key)
            for name in ("stdout", "stderr"):
                self._streams.pop((key, name), None)
            if self._closed:
                return
            for name, fd in self._fds.pop(key, []):
                if self._registered(fd, (key, name)):
                    self._selector.unregister(fd)
                    os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake()
        self._thread.join(2.0)
        if self._echo is not None:
            self._echo.close()
        for key in list(self._selector.get_map().values()):
            with contextlib.suppress(OSError):
                os.close(key.fd)
        self._selector.close()
        os.close(self._wake_w)

    def _drain(self, key: str) -> None:
        """Read what sandbox ``key``'s pipes hold now (the lock held)."""
        if self._closed:
            return
        for name, fd in list(self._fds.get(key, [])):
            if self._registered(fd, (key, name)):
                self._read(fd, (key, name))

    def _registered(self, fd: int, data: tuple[str, str]) -> bool:
        """Is ``fd`` still the pipe registered for ``data`` (the lock held)?"""
        registered = self._selector.get_map().get(fd)
        return registered is not None and registered.data == data

    def _read(self, fd: int, data: tuple[str, str]) -> bool:
        """Read what is there; False at EOF (the fd is then unregistered and closed)."""
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self._selector.unregister(fd)
            os.close(fd)
            own = self._fds.get(data[0], [])
            if (data[1], fd) in own:
                own.remove((data[1], fd))
            if not own:
                self._fds.pop(data[0], None)
            return False
        stream = self._streams.get(data)
        if stream is not None:
            stream.add(chunk)
        if self._echo is not None:
            fd = _ECHO_FD[data[1]]
            self._echo.put(fd, chunk, stream.escaper if stream else self._echo.escaper(fd))
        return True

    def _run(self) -> None:
        while True:
            events = self._selector.select(timeout=1.0)
            with self._lock:
                if self._closed:
                    return
                for key, _mask in events:
                    if key.data is None:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        continue
                    # The same registration only: an event of a forgotten sandbox's fd,
                    # whose number another's pipe took meanwhile, is stale.
                    if self._selector.get_map().get(key.fd) is key:
                        self._read(key.fd, key.data)
