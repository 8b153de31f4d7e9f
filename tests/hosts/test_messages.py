"""The process host's control messages (gym_fork/hosts/process/messages.py): each
type round-trips, and what a warm parent or sandbox sends that is not the message
expected is refused with every fd closed."""

from __future__ import annotations

import os
import socket

import pytest

from gym_fork.errors import ControlMessageError, SandboxStartError
from gym_fork.hosts.process import messages as M
from gym_fork.transport import control
from gym_fork.transport.control import send_message

SPEC = M.SandboxSpec("w0", [0, 1], [0, 0], 4096)
EXAMPLES = [
    M.ZygoteReady(12),
    M.ForkWarmParent({"A": "1"}, {"umask": 18, "rlimits": {}}),
    M.WarmParentForked(7),
    M.Retire(),
    M.Init({"env_fns": b"x", "cwd": "/"}, {"enabled": True}, 5, True, b"iso"),
    M.Ready(3, {"tree": {"pid": True}}, None),
    M.PrepareFailed("ValueError: no", None, "Traceback ..."),
    M.Spawn([SPEC, SPEC], b"attach"),
    M.Spawned([4, 5], [[6, "T"]]),
    M.WorkerStatus(4),
    M.WorkerExit(-9),
    M.WorkerExit(None),
    M.Exit(),
    M.Refused("no"),
    M.Assign(SPEC, None),
    M.CloneFds(2),
    M.ClonesForked([8, 9]),
]
KINDS = tuple({type(m) for m in EXAMPLES})


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def fds_for(message: M.Message) -> list[int]:
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(message.fd_count())]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.OP)
def test_every_message_round_trips_with_its_fds(pair, message):
    ours, theirs = pair
    fds = fds_for(message)
    M.send(ours, message, fds)
    M.close_fds(fds)
    got, received = M.receive(theirs, *KINDS)
    assert got == message and type(got) is type(message)
    assert len(received) == message.fd_count()
    M.close_fds(received)


def test_ops_are_distinct():
    ops = [kind.OP for kind in KINDS]
    assert len(ops) == len(set(ops))


def test_pidfds_say_which_processes_came(pair):
    ours, theirs = pair
    M.send_with_pidfds(
        ours, M.ClonesForked([os.getpid(), 2**22 + 12345]), [os.getpid(), 2**22 + 12345]
    )
    got, fds = M.receive(theirs, M.ClonesForked)
    assert got.pidfds == [True, False] and len(fds) == 1
    M.close_fds(fds)


def test_a_sender_must_give_as_many_fds_as_it_announces(pair):
    with pytest.raises(ValueError, match="1 fds given, 5 announced"):
        M.send(pair[0], M.Assign(SPEC, None), [0])


BAD = [
    ("not a dict", [1, 2], (M.Spawned,), "got a list"),
    ("unknown op", {"op": "fork"}, (M.Spawned, M.Refused), "expected spawned or refused"),
    ("not expected here", {"op": "exit"}, (M.WorkerExit,), "expected worker-exit, got 'exit'"),
    ("missing field", {"op": "worker-exit"}, (M.WorkerExit,), "fields"),
    ("extra field", {"op": "worker-exit", "code": 1, "x": 2}, (M.WorkerExit,), "fields"),
    ("wrong type", {"op": "worker-exit", "code": "1"}, (M.WorkerExit,), "worker-exit.code"),
    ("bool for int", {"op": "worker-status", "pid": True}, (M.WorkerStatus,), "expected int"),
    ("list item", {"op": "clones-forked", "pids": [1, "2"]}, (M.ClonesForked,), r"pids\[\]"),
    (
        "too many items",
        {"op": "clones-forked", "pids": list(range(M.MAX_ITEMS + 1))},
        (M.ClonesForked,),
        "at most",
    ),
    (
        "nested spec",
        {"op": "assign", "spec": {"name": "w", "indices": [0], "origins": [0]}, "attach": None},
        (M.Assign,),
        "assign.spec",
    ),
    (
        "dict keys",
        {"op": "fork-warm-parent", "environ": {1: "a"}, "state": {}},
        (M.ForkWarmParent,),
        "key",
    ),
]


@pytest.mark.parametrize("case, raw, expected, match", BAD, ids=[b[0] for b in BAD])
def test_a_malformed_message_is_refused(case, raw, expected, match):
    with pytest.raises(ControlMessageError, match=match):
        M.decode(raw, [], *expected)


def test_fds_not_announced_are_refused_and_closed(pair):
    ours, theirs = pair
    fd = os.open(os.devnull, os.O_RDONLY)
    before = open_fds()
    send_message(ours, {"op": "clones-forked", "pids": [1], "pidfds": [False]}, fds=(fd,))
    os.close(fd)
    with pytest.raises(ControlMessageError, match="1 fds came, 0 announced"):
        M.receive(theirs, M.ClonesForked)
    assert open_fds() <= before


def test_a_frame_larger_than_its_type_allows_is_refused_unread(pair):
    ours, theirs = pair
    ours.sendall(control._HEADER.pack(2 << 20, 0))  # announces 2 MiB, sends none of it
    with pytest.raises(ControlMessageError, match="more than"):
        M.receive(theirs, M.WorkerExit)


def test_a_bad_reply_is_a_start_error_naming_the_request(pair):
    ours, theirs = pair
    send_message(ours, {"op": "ready", "pid": "one"})
    with pytest.raises(SandboxStartError, match="the warm parent's start: a malformed"):
        M.receive_reply(theirs, 5.0, "the warm parent's start", M.Ready, M.PrepareFailed)
    with pytest.raises(SandboxStartError, match=r"no answer within 0\.01 s"):
        M.receive_reply(theirs, 0.01, "spawn", M.Spawned)
    ours.close()
    with pytest.raises(SandboxStartError, match="closed the connection"):
        M.receive_reply(theirs, 5.0, "spawn", M.Spawned)
