"""Length-prefixed messages with attached fds over a UNIX stream socket.

Used between the controller and a warm parent (not on the hot path): spawn requests
carry the worker's channel and slab fds with SCM_RIGHTS.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import math
import os
import select
import socket
import struct
import termios
import time
from typing import Any

from gym_fork.errors import ControlMessageError
from gym_fork.transport import codec
from gym_fork.transport.codec import DecodeTooBig, pack, unpack

_HEADER = struct.Struct("<II")  # payload length, number of fds
MAX_FDS = 253  # SCM_MAX_FD: the kernel passes at most this many per message
# Largest payload a receiver accepts: a peer announcing more is refused before any of
# it is read (spawn requests carry pickled env factories, hence the generous bound).
MAX_MESSAGE_BYTES = 256 << 20


def send_message(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Send ``message`` (codec-encoded) and pass ``fds`` along with its first byte."""
    if len(fds) > MAX_FDS:
        raise ValueError(f"at most {MAX_FDS} fds per control message, got {len(fds)}")
    payload = pack(message)
    data = _HEADER.pack(len(payload), len(fds)) + payload
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = 0
    try:
        sent = sock.sendmsg([data], ancillary)  # an OSError here: nothing went out
        if sent < len(data):
            sock.sendall(data[sent:])
    except BaseException as exc:
        if sent or not isinstance(exc, OSError):
            # Part of the frame may be out (a peer that does not read, past the
            # socket's timeout; a Ctrl-C, even inside sendmsg): the stream cannot be
            # read in step any more, so it ends here rather than carry the next
            # message after a torn one.
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        raise


_CLOSED = select.POLLRDHUP | select.POLLHUP | select.POLLERR


def _events(sock: socket.socket, timeout: float) -> int:
    """The poll events of ``sock`` (readable, or closed) within ``timeout`` seconds
    (0: as it is now); 0 when none came. poll: any fd number."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    found = poller.poll(max(0, math.ceil(timeout * 1000)))
    return found[0][1] if found else 0


def peer_closed(sock: socket.socket) -> bool:
    """True when the other end of ``sock`` has closed it (or it failed): nothing more
    will come from it, whatever is still queued. Does not wait."""
    return bool(_events(sock, 0) & _CLOSED)


def frame_queued(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> bool:
    """True when receiving a message from ``sock`` will not wait: a whole one (header
    and payload) is queued, or it never can be (the peer hung up, or announces more than
    ``max_bytes``: the receive then says so). A peer that trickles a message can then not
    hold up a receiver that polls (whose timeout is per read, not per message)."""
    events = _events(sock, 0)
    if not events:
        return False  # (a socket with a timeout would wait for it in recv: no MSG_DONTWAIT)
    if events & _CLOSED:
        return True
    try:
        head = sock.recv(_HEADER.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:
        return True  # the receive will say what is wrong
    if len(head) < _HEADER.size:
        return not head  # b"": closed; a part of the header: not yet
    length, _ = _HEADER.unpack(head)
    if length > max_bytes:
        return True
    queued = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.FIONREAD, queued)
    return queued[0] >= _HEADER.size + length


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    chunks = []
    while n:
        if deadline is not None and not _events(sock, deadline - time.monotonic()):
            raise ControlMessageError(
                "a control message stalled mid-way: the rest did not come in time",
                reason="timeout",
            )
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("control socket closed by its peer")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_message(
    sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES, deadline: float | None = None
) -> tuple[Any, list[int]]:
    """Receive one message and the fds that came with it (the caller owns them).

    A message whose announced length exceeds ``max_bytes``, whose fds do not match its
    header (or were cut short by the kernel), or whose payload does not decode raises
    :class:`ControlMessageError` (an ``EOFError``) with every received fd closed; so does
    one not whole by ``deadline`` (``time.monotonic()``; None: the socket's own timeout
    per read), so that a peer trickling it cannot hold the receiver.
    """
    fd_size = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    # CLOEXEC at once: a concurrent fork + exec (a user's os.system) inherits none of them.
    data, ancdata, flags, _addr = sock.recvmsg(_HEADER.size, fd_size, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, cdata in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(cdata[: len(cdata) - (len(cdata) % arr.itemsize)])
            fds.extend(arr)
    try:
        if not data:
            raise EOFError("control socket closed by its peer")
        if flags & socket.MSG_CTRUNC:
            raise ControlMessageError(
                f"a control message carried more than {MAX_FDS} fds (cut short)",
                reason="fds",
            )
        if len(data) < _HEADER.size:
            data += _recv_exact(sock, _HEADER.size - len(data), deadline)
        length, nfds = _HEADER.unpack(data)
        if nfds != len(fds):
            raise ControlMessageError(
                f"expected {nfds} fds with a control message, got {len(fds)}", reason="fds"
            )
        if length > max_bytes:
            raise ControlMessageError(
                f"a control message announces {length} bytes, more than the {max_bytes} accepted",
                reason="too_big",
            )
        payload = _recv_exact(sock, length, deadline)
        try:
            # Bounded as a ring record (a sandbox writes on its side socket).
            refused: list[int] = []
            message = unpack(
                payload, allow_pickle=False, refused=refused, max_objects=codec.MAX_OBJECTS
            )
            if refused:  # typed messages carry pickles as bytes fields, loaded by choice
                raise ControlMessageError(
                    f"a control message holds a pickled value ({refused[0]} bytes); "
                    "pickles in control messages are never loaded",
                    reason="decode",
                )
        except ControlMessageError:
            raise
        except DecodeTooBig as exc:
            raise ControlMessageError(f"a control message: {exc}", reason="too_big") from None
        except Exception as exc:
            raise ControlMessageError(
                f"a control message does not decode ({type(exc).__name__}: {exc})",
                reason="decode",
            ) from exc
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return message, fds
