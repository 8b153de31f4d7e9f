"""The process host's control messages (gym_fork/hosts/process/messages.py): each
type round-trips with the fds it announces. The checks a received message passes are
the typed-message layer's (tests/transport/test_typed_messages.py)."""

from __future__ import annotations

import contextlib

import pytest

from gym_fork.hosts.process import messages as M
from tests.transport.test_typed_messages import round_trip

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
    M.FrozenLayer(True, sealed=True),
    M.ClonesForked([8, 9]),
]
KINDS = tuple({type(m) for m in EXAMPLES})


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: m.OP)
def test_every_message_round_trips_with_its_fds(message):
    round_trip(message, *KINDS)


def test_ops_are_distinct():
    ops = [kind.OP for kind in KINDS]
    assert len(ops) == len(set(ops))


def test_sandboxes_come_with_their_fds():
    assert M.Spawn([SPEC, SPEC], None).fd_count() == 2 * M.FDS_PER_SANDBOX
    assert M.Assign(SPEC, None).fd_count() == M.FDS_PER_SANDBOX
    assert M.CloneFds(3).fd_count() == 3 * M.FDS_PER_SANDBOX
    assert M.FrozenLayer(True).fd_count() == 1 and M.FrozenLayer(False).fd_count() == 0
    assert M.ForkWarmParent({}, {}).fd_count() == 3
    assert M.Spawned([4, 5], [], [True, False]).fd_count() == 1


def test_a_wait_for_a_forks_message_keeps_its_deadline_under_a_flood_of_earlier_ones():
    """A hostile sandbox writing messages "of an earlier fork" as fast as it can: they
    are dropped, but the wait gives up by its deadline (and after a bounded number of
    them), not when the flood ends."""
    import socket
    import threading
    import time

    from gym_fork.errors import SandboxStartError

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    stop = time.monotonic() + 3.0

    def flood() -> None:
        with contextlib.suppress(OSError):
            while time.monotonic() < stop:
                M.send(theirs, M.LayerAdopted(fork_id=0))

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    started = time.monotonic()
    try:
        with pytest.raises(SandboxStartError):
            M.receive_for(ours, 5, M.LayerAdopted, 0.2, "flooded")
        took = time.monotonic() - started
    finally:
        stop = 0
        ours.close()
        writer.join()
        theirs.close()
    assert took < 1.5


def test_a_forks_quiet_word_no_one_waited_for_is_read_past():
    """A source says ForkQuiet wherever a layer may follow; the controller waits for it
    only where it freezes: elsewhere the next wait of that fork reads past it (once a
    fork's word, it is not "the wrong message"); a later fork's is still refused."""
    import socket

    from gym_fork.errors import SandboxStartError

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        M.send(theirs, M.ForkQuiet(fork_id=7))
        M.send(theirs, M.LayerAdopted(fork_id=7))
        adopted, _fds = M.receive_for(ours, 7, M.LayerAdopted, 1.0, "adopted")
        assert adopted.fork_id == 7
        M.send(theirs, M.ForkQuiet(fork_id=8))
        with pytest.raises(SandboxStartError, match="fork-quiet of fork 8"):
            M.receive_for(ours, 7, M.LayerAdopted, 1.0, "adopted")
    finally:
        ours.close()
        theirs.close()
