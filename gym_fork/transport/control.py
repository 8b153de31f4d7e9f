"""Length-prefixed messages with attached fds over a UNIX stream socket.

Used between the controller and a warm parent (not on the hot path): spawn requests
carry the worker's channel and slab fds with SCM_RIGHTS.
"""

from __future__ import annotations

import array
import socket
import struct
from typing import Any

from gym_fork.transport.codec import pack, unpack

_HEADER = struct.Struct("<II")  # payload length, number of fds
MAX_FDS = 253  # SCM_MAX_FD: the kernel passes at most this many per message


def send_message(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Send ``message`` (codec-encoded) and pass ``fds`` along with its first byte."""
    payload = pack(message)
    data = _HEADER.pack(len(payload), len(fds)) + payload
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("control socket closed by its peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(sock: socket.socket) -> tuple[Any, list[int]]:
    """Receive one message and the fds that came with it."""
    fd_size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    data, ancdata, _flags, _addr = sock.recvmsg(_HEADER.size, fd_size)
    if not data:
        raise EOFError("control socket closed by its peer")
    if len(data) < _HEADER.size:
        data += _recv_exact(sock, _HEADER.size - len(data))
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
            fds.extend(arr)
    length, nfds = _HEADER.unpack(data)
    if nfds != len(fds):
        raise EOFError(f"expected {nfds} fds with a control message, got {len(fds)}")
    return unpack(_recv_exact(sock, length)), fds
