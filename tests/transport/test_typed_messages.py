"""The typed-message layer (gym_fork/transport/typed_messages.py), with message types
of its own: a message round-trips with its fds, and what a peer sends that is not the
message expected is refused with every fd closed."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

import pytest

from gym_fork.errors import ControlMessageError, SandboxStartError
from gym_fork.transport import control
from gym_fork.transport import typed_messages as T
from gym_fork.transport.control import send_message


@dataclass(frozen=True)
class Item:
    name: str
    sizes: list[int]


@dataclass(frozen=True)
class Put(T.Message):
    OP = "put"
    FDS = 2
    item: Item
    table: dict[str, int]
    note: str | None
    blob: bytes
    ratio: float
    extra: Any = None


@dataclass(frozen=True)
class Code(T.Message):
    OP = "code"
    code: int | None


@dataclass(frozen=True)
class Pid(T.Message):
    OP = "pid"
    pid: int


@dataclass(frozen=True)
class Forked(T.Message):
    OP = "forked"
    pids: list[int]
    pidfds: list[bool] = field(default_factory=list)


KINDS = (Put, Code, Pid, Forked)


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def round_trip(message: T.Message, *kinds: type[T.Message]) -> None:
    """``message`` sent with as many fds as it announces arrives equal, with them."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(message.fd_count())]
        T.send(ours, message, fds)
        T.close_fds(fds)
        got, received = T.receive(theirs, *kinds)
        T.close_fds(received)
    assert got == message and type(got) is type(message)
    assert len(received) == message.fd_count()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(
    "message",
    [
        Put(Item("w", [1, 2]), {"a": 1}, None, b"\0x", 0.5, {"any": [1]}),
        Put(Item("", []), {}, "note", b"", -1.0),
        Code(-9),
        Code(None),
        Pid(3),
    ],
    ids=lambda m: m.OP,
)
def test_a_message_round_trips_with_its_fds(message):
    round_trip(message, *KINDS)


def test_pidfds_say_which_processes_came_and_become_watches(pair):
    ours, theirs = pair
    pids = [os.getpid(), 2**22 + 12345]  # the second is no process
    T.send_with_pidfds(ours, Forked(pids), pids)
    got, fds = T.receive(theirs, Forked)
    assert got.pidfds == [True, False] and len(fds) == 1
    me, ghost = T.adopt_pidfds(got.pids, got.pidfds, fds)
    assert (me.pid, me.alive()) == (os.getpid(), True)
    assert ghost.alive() is False
    me.close()


def test_a_pidfd_of_another_process_than_named_is_refused(pair):
    ours, theirs = pair
    T.send_with_pidfds(ours, Forked([os.getppid()]), [os.getpid()])
    got, fds = T.receive(theirs, Forked)
    with pytest.raises(SandboxStartError, match=f"not a pidfd of process {os.getppid()}"):
        T.adopt_pidfds(got.pids, got.pidfds, fds)
    with pytest.raises(OSError):
        os.fstat(fds[0])  # closed
    with pytest.raises(SandboxStartError, match="a pidfd per process"):
        T.adopt_pidfds([1, 2], [False], [])


def test_a_message_without_pidfds_cannot_carry_them(pair):
    with pytest.raises(TypeError, match="no pidfds field"):
        T.send_with_pidfds(pair[0], Pid(1), [os.getpid()])


def test_a_sender_must_give_as_many_fds_as_it_announces(pair):
    with pytest.raises(ValueError, match="1 fds given, 2 announced"):
        T.send(pair[0], Put(Item("w", []), {}, None, b"", 0.0), [0])


def put(**changes):
    """A well-formed ``put`` as received, with ``changes``."""
    raw = {"op": "put", "item": {"name": "w", "sizes": []}, "table": {}, "note": None}
    return {**raw, "blob": b"", "ratio": 0.0, **changes}


BAD = [
    ("not a dict", [1, 2], (Code,), "got a list"),
    ("unknown op", {"op": "fork"}, (Code, Pid), "expected code or pid"),
    ("not expected here", {"op": "pid", "pid": 1}, (Code,), "expected code, got 'pid'"),
    ("missing field", {"op": "code"}, (Code,), "fields"),
    ("extra field", {"op": "code", "code": 1, "x": 2}, (Code,), "fields"),
    ("wrong type", {"op": "code", "code": "1"}, (Code,), "code.code"),
    ("bool for int", {"op": "pid", "pid": True}, (Pid,), "expected int"),
    ("list item", {"op": "forked", "pids": [1, "2"]}, (Forked,), r"pids\[\]"),
    (
        "too many items",
        {"op": "forked", "pids": list(range(T.MAX_ITEMS + 1))},
        (Forked,),
        "at most",
    ),
    (
        "too much text",
        put(item={"name": "w" * (T.MAX_TEXT + 1), "sizes": []}),
        (Put,),
        "put.item.name",
    ),
    ("nested dataclass", put(item={"name": "w"}), (Put,), "put.item"),
    ("dict keys", put(table={1: 1}), (Put,), "put.table key"),
    ("not a float", put(ratio=1), (Put,), "put.ratio"),
]


@pytest.mark.parametrize("case, raw, expected, match", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_message_is_refused_with_its_fds_closed(case, raw, expected, match):
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
    with pytest.raises(ControlMessageError, match=match):
        T.decode(raw, fds, *expected)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)


def test_fds_not_announced_are_refused_and_closed(pair):
    ours, theirs = pair
    fd = os.open(os.devnull, os.O_RDONLY)
    before = open_fds()
    send_message(ours, {"op": "forked", "pids": [1], "pidfds": [False]}, fds=(fd,))
    os.close(fd)
    with pytest.raises(ControlMessageError, match="1 fds came, 0 announced"):
        T.receive(theirs, Forked)
    assert open_fds() <= before


def test_a_frame_larger_than_its_type_allows_is_refused_unread(pair):
    ours, theirs = pair
    ours.sendall(control._HEADER.pack(2 << 20, 0))  # announces 2 MiB, sends none of it
    with pytest.raises(ControlMessageError, match="more than"):
        T.receive(theirs, Code)


def test_a_bad_reply_is_a_start_error_naming_the_request(pair):
    ours, theirs = pair
    send_message(ours, {"op": "pid", "pid": "one"})
    with pytest.raises(SandboxStartError, match="the start: a malformed"):
        T.receive_reply(theirs, 5.0, "the start", Pid, Code)
    with pytest.raises(SandboxStartError, match=r"no answer within 0\.01 s"):
        T.receive_reply(theirs, 0.01, "spawn", Pid)
    ours.close()
    with pytest.raises(SandboxStartError, match="closed the connection"):
        T.receive_reply(theirs, 5.0, "spawn", Pid)
