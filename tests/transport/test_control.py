"""Control-socket messages: sizes and fd counts a peer announces are bounded before use."""

from __future__ import annotations

import array
import os
import socket
import struct
import time

import pytest

from gym_fork.errors import ControlMessageError
from gym_fork.transport.control import recv_message, send_message

from .hostile import Peer

HEADER = struct.Struct("<II")


def test_messages_and_fds_round_trip():
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        send_message(theirs, {"op": "spawn", "n": 3}, fds=(r,))
        message, fds = recv_message(ours)
        assert message == {"op": "spawn", "n": 3}
        assert len(fds) == 1
        os.write(w, b"x")
        assert os.read(fds[0], 1) == b"x"
        os.close(fds[0])
    finally:
        for fd in (r, w):
            os.close(fd)
        ours.close()
        theirs.close()


def test_a_huge_announced_length_is_refused_before_reading():
    """A peer announces 4 GiB and sends nothing more: the receiver refuses at once
    instead of waiting for (and buffering) the payload."""
    ours, theirs = socket.socketpair()
    try:
        with Peer(lambda: theirs.sendall(HEADER.pack(0xFFFFFFFF, 0))) as peer:
            assert peer.wait() == 0
        start = time.monotonic()
        with pytest.raises(ControlMessageError) as info:
            recv_message(ours, max_bytes=1 << 20)
        assert time.monotonic() - start < 1.0
        assert info.value.reason == "too_big"
        assert isinstance(info.value, EOFError)  # callers treat it as a lost peer
    finally:
        ours.close()
        theirs.close()


def test_fds_that_do_not_match_the_header_are_refused_and_closed():
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    try:
        fds = array.array("i", [r, w])
        theirs.sendmsg([HEADER.pack(1, 1) + b"\xc0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        with pytest.raises(ControlMessageError) as info:
            recv_message(ours)
        assert info.value.reason == "fds"
        # the two received copies were closed (the leak check would see them otherwise)
    finally:
        for fd in (r, w):
            os.close(fd)
        ours.close()
        theirs.close()


def test_an_undecodable_payload_is_refused():
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(HEADER.pack(1, 0) + b"\xc1")  # 0xc1: never used by msgpack
        with pytest.raises(ControlMessageError) as info:
            recv_message(ours)
        assert info.value.reason == "decode"
    finally:
        ours.close()
        theirs.close()


def test_a_message_cut_short_by_a_deaf_peer_ends_the_stream():
    """A peer that does not read: the send times out with part of the frame out. The
    next message must not follow a torn one (the peer would read it as the rest of the
    first): the stream ends there, and the peer reads the part, then EOF."""
    ours, theirs = socket.socketpair()
    try:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.settimeout(0.2)
        with pytest.raises(TimeoutError):
            send_message(ours, {"blob": b"x" * (1 << 20)})
        with pytest.raises(OSError):
            send_message(ours, {"op": "next"})
        theirs.settimeout(5)
        received = 0
        while chunk := theirs.recv(1 << 16):
            received += len(chunk)
        assert 0 < received < (1 << 20)
    finally:
        ours.close()
        theirs.close()
