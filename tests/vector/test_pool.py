"""The worker pool alone: the test plays the workers on real channels (no sandbox)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from gym_fork.errors import SubEnvCrashed, TransportError
from gym_fork.hosts.base import WorkerHandle
from gym_fork.hosts.inline import ThreadWatch
from gym_fork.transport.channel import Channel
from gym_fork.vector.pool import WorkerPool
from gym_fork.vector.waits import Deadline, WaitTimeout
from gym_fork.worker import protocol as P


class FakeHost:
    kind = "fake"

    def exit_code(self, worker):
        return -9


class FakeWorker:
    """One worker end: a channel the test reads requests from and writes replies to."""

    def __init__(self, index: int, size: int = 1):
        self.ours = Channel.create(f"fake {index}", 1 << 14)
        self.theirs = Channel.attach(os.dup(self.ours.region.fd), 1 << 14, f"fake {index}")
        self.alive = threading.Event()
        self.alive.set()
        thread = threading.Thread(target=self.alive.wait, daemon=True)
        thread.is_alive = self.alive.is_set  # the watch asks this
        self.handle = WorkerHandle(
            f"fake {index}",
            list(range(index * size, index * size + size)),
            self.ours,
            os.getpid(),
            ThreadWatch(thread),
        )

    def request(self, timeout=2.0):
        return self.theirs.recv(timeout)

    def reply(self, op, seq, result=None, errors=None):
        self.theirs.send([op, seq, result, errors])

    def close(self):
        self.theirs.close()
        self.ours.close()


@pytest.fixture
def workers():
    made = [FakeWorker(k) for k in range(3)]
    yield made
    for w in made:
        w.close()


def make_pool(workers, **kwargs):
    pool = WorkerPool(FakeHost(), **kwargs)
    pool.workers = [w.handle for w in workers]
    return pool


def test_replies_are_collected_in_worker_order_and_errors_raised_after_all(workers):
    pool = make_pool(workers)
    pool.send_same(P.CALL, ["x", (), {}])
    requests = [w.request() for w in workers]
    for w, (op, seq, _arg) in zip(reversed(workers), reversed(requests), strict=True):
        w.reply(op, seq, [w.handle.indices[0]])
    assert pool.collect(P.CALL, 2.0) == [[0], [1], [2]]
    pool.send_same(P.CALL, ["x", (), {}])
    for w in workers:
        op, seq, _ = w.request()
        errors = None
        if w.handle.indices[0] == 1:
            errors = [{"index": 1, "type": "KeyError", "message": "'k'", "traceback": "tb"}]
        w.reply(op, seq, [None], errors)
    with pytest.raises(KeyError, match="KeyError") as info:  # untrusted: SubEnvError[KeyError]
        pool.collect(P.CALL, 2.0)
    assert info.value.gym_fork_index == 1


def test_a_late_reply_of_an_abandoned_call_is_dropped_by_its_sequence_number(workers):
    pool = make_pool(workers[:1])
    worker = workers[0]
    pool.send_same(P.STEP, None)
    old = worker.request()
    with pytest.raises(WaitTimeout):
        pool.collect(P.STEP, 0.05)
    assert pool.behind()  # the abandoned reply is still owed
    pool.send_same(P.STEP, None)
    new = worker.request()
    worker.reply(P.STEP, old[1], "old")
    worker.reply(P.STEP, new[1], "new")
    assert pool.collect(P.STEP, 2.0) == ["new"]
    assert not pool.behind()


def test_max_concurrency_holds_requests_until_earlier_workers_answer(workers):
    pool = make_pool(workers, max_concurrency=1)
    pool.send_same(P.STEP, None)
    assert workers[0].theirs.inbox.pending() > 0
    assert workers[1].theirs.inbox.pending() == 0 and workers[2].theirs.inbox.pending() == 0

    def answer_in_turn():
        for w in workers:
            op, seq, _ = w.request(5.0)
            time.sleep(0.01)
            w.reply(op, seq, w.handle.indices[0])

    thread = threading.Thread(target=answer_in_turn)
    thread.start()
    assert pool.collect(P.STEP, 5.0) == [0, 1, 2]
    thread.join()


@pytest.mark.parametrize(
    "reply",
    [
        "not a list",
        [P.STEP, "seq", None, None],
        [P.STEP, 1, None, "errors must be a list"],
        [P.CALL, 1, None, None],  # a reply to another operation
    ],
)
def test_a_malformed_reply_kills_the_worker_and_names_it(workers, reply):
    pool = make_pool(workers[:1])
    worker = workers[0]
    pool.send_same(P.STEP, None)
    _op, seq, _ = worker.request()
    if isinstance(reply, list) and type(reply[1]) is int:
        reply = [reply[0], seq, *reply[2:]]
    worker.theirs.send(reply)
    with pytest.raises(TransportError, match="corrupt record") as info:
        pool.collect(P.STEP, 2.0)
    assert info.value.indices == [0]
    assert not worker.handle.alive()


def test_a_worker_found_dead_while_waiting_is_a_crash_with_its_status(workers):
    pool = make_pool(workers[:1])
    pool.send_same(P.STEP, None)
    workers[0].alive.clear()
    started = time.perf_counter()
    with pytest.raises(SubEnvCrashed, match=r"died during step") as info:
        pool.receive(workers[0].handle, Deadline(None), P.STEP)
    assert time.perf_counter() - started < 1.0
    assert info.value.exitcode == -9


def test_a_wait_on_several_workers_hands_over_each_with_a_reply_or_found_dead(workers):
    pool = make_pool(workers)
    pool.send_same(P.STEP, None)
    requests = [w.request() for w in workers]
    workers[2].reply(P.STEP, requests[2][1], "two")
    workers[0].alive.clear()
    ops = dict.fromkeys(range(3), P.STEP)
    handed = []

    def take(ready):
        handed.append(ready)
        for k in ready:
            del ops[k]
        return False  # wants worker 1 too, which never answers

    with pytest.raises(WaitTimeout):
        pool.wait_any(ops, Deadline(0.3), take)
    assert handed == [[2], [0]]  # the reply there at once, then the dead one
    assert list(ops) == [1]
