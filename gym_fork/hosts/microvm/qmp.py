"""A small blocking QMP client over an inherited socket.

Why not the ``qemu.qmp`` package: it is asyncio-based, and its synchronous wrapper runs
an event loop per call; gym_fork drives each QEMU from whatever thread owns the vector
env (possibly inside the user's own event loop) over a socketpair made before QEMU
starts (no socket path to leak or race on), and needs SCM_RIGHTS to hand QEMU fds
(``getfd``). That is a few dozen lines of JSON lines, written here.
"""

from __future__ import annotations

import array
import json
import socket
import time
from typing import Any

from gym_fork.system.linux import wait_readable


class QMPError(RuntimeError):
    """QEMU answered a command with an error, or the monitor went away."""


class QMP:
    """One QMP session on a connected stream socket."""

    def __init__(self, sock: socket.socket, timeout: float = 30.0) -> None:
        self.sock = sock
        self.timeout = timeout
        self._buffer = b""
        self.events: list[dict[str, Any]] = []
        greeting = self._read_message(time.monotonic() + timeout)
        if "QMP" not in greeting:
            raise QMPError(f"not a QMP greeting: {greeting}")
        self.command("qmp_capabilities")

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QMPError(f"QEMU's monitor did not answer within {self.timeout} s")
            if not wait_readable(self.sock.fileno(), left):
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                raise QMPError("QEMU's monitor closed (QEMU exited)")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def command(
        self, name: str, arguments: dict[str, Any] | None = None, fds: tuple[int, ...] = ()
    ) -> Any:
        """Run one command and return its result; events that arrive meanwhile are kept."""
        message: dict[str, Any] = {"execute": name}
        if arguments:
            message["arguments"] = arguments
        data = json.dumps(message).encode() + b"\n"
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            self.sock.sendmsg([data], ancillary)
        else:
            self.sock.sendall(data)
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if "event" in reply:
                self.events.append(reply)
                continue
            if "error" in reply:
                error = reply["error"]
                raise QMPError(f"{name}: {error.get('class')}: {error.get('desc')}")
            return reply.get("return")

    def close(self) -> None:
        self.sock.close()
