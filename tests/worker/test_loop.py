"""The worker loop alone: records in, records out, over a real channel and slab in one
process (a thread serves; no sandbox)."""

from __future__ import annotations

import os
import threading

import cloudpickle
import numpy as np
import pytest
from gymnasium import spaces

from gym_fork.transport.channel import Channel
from gym_fork.transport.slab import SlabSet
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import Worker
from tests.helpers import SpaceEnv

OBS = spaces.Box(-1, 1, (2,), np.float32)
ACT = spaces.Discrete(3)


class Harness:
    """A worker for sub-envs ``indices`` served in a thread; the test plays controller."""

    def __init__(self, indices, fail_build=None, env_class=SpaceEnv):
        self.channel = Channel.create("test worker", 1 << 16)
        theirs = Channel.attach(os.dup(self.channel.region.fd), 1 << 16, "test worker")
        slab_fd = os.memfd_create("gym_fork-slab", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)

        def make_env(origin):
            if origin == fail_build:
                raise RuntimeError("cannot build")
            return env_class(OBS, ACT, max_len=50, trunc_prob=0)

        self.worker = Worker(theirs, indices, indices, make_env, os.dup(slab_fd))
        self.slabs = SlabSet(OBS, ACT, [len(indices)], [slab_fd], use_observations=True)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        self.seq = 0

    def _serve(self):
        try:
            if self.worker.hello():
                self.worker.run()
        finally:
            if self.worker.slab is not None:
                self.worker.slab.close()
            else:
                os.close(self.worker.slab_fd)
            self.worker.channel.close()

    def request(self, op, arg):
        self.seq += 1
        self.channel.send([op, self.seq, arg])
        reply = self.channel.recv(5.0)
        assert reply[0] == op and reply[1] == self.seq
        return reply[2], reply[3]

    def attach(self):
        arg = {
            "observation_space": cloudpickle.dumps(OBS),
            "action_space": cloudpickle.dumps(ACT),
            "observation_mode": "same",
            "autoreset_mode": "NextStep",
            "num_envs": 2,
            "shared_memory": True,
        }
        return self.request(P.ATTACH, arg)

    def close(self):
        self.request(P.CLOSE, None)
        self.thread.join(5)
        self.slabs.close()
        self.channel.close()


@pytest.fixture
def harness():
    h = Harness([4, 5])
    hello = h.channel.recv(5.0)
    assert hello[0] == P.HELLO and hello[3] is None
    yield h, hello[2]
    h.close()


def test_hello_reports_plain_spaces_and_attach_checks_them(harness):
    h, info = harness
    assert info["pid"] == os.getpid()
    assert [s["kind"] for s in info["observation_spaces"]] == ["box", "box"]
    checks, errors = h.attach()
    assert errors is None and checks == [[True, True], [True, True]]


def test_step_reads_actions_from_its_slab_rows_and_writes_results_there(harness):
    h, _ = harness
    h.attach()
    h.request(P.RESET, [[1, None, True], [2, None, True]])
    h.slabs.write_actions(np.array([2, 0]))
    (obs_list, _infos), errors = h.request(P.STEP, None)
    assert errors is None and obs_list is None
    assert h.slabs.rewards().shape == (2,) and np.any(h.slabs.observations() != 0)
    assert h.worker.slots[0].env.t == 1 and h.worker.slots[1].env.t == 1
    # actions inside the request instead of the slab (a worker that is behind)
    (_, _), errors = h.request(P.STEP, [1, 1])
    assert errors is None and h.worker.slots[0].env.t == 2


def test_a_failing_call_is_one_sub_envs_error_record_and_the_loop_goes_on(harness):
    h, _ = harness
    h.attach()
    result, errors = h.request(P.CALL, ["step", (0,), {}])
    assert result == [None, None]
    assert [e["index"] for e in errors] == [4, 5]
    assert errors[0]["type"] == "ValueError" and "use `step` directly" in errors[0]["message"]
    assert "Traceback" in errors[0]["traceback"]
    result, errors = h.request(P.CALL, ["add", (1,), {}])
    assert errors is None and result == [2, 2]


def test_an_unknown_operation_and_an_unencodable_result_are_reported_not_fatal(harness):
    h, _ = harness
    _, errors = h.request(42, None)
    assert "unknown operation 42" in errors[0]["message"]
    _, errors = h.request(P.CALL, ["observation_space", (), {}])  # pickled by the codec
    assert errors is None
    _, errors = h.request(P.CALL, ["add", (1,), {}])
    assert errors is None


def test_a_sub_env_that_fails_to_build_is_named_in_the_hello():
    h = Harness([0, 1], fail_build=1)
    try:
        hello = h.channel.recv(5.0)
        assert hello[0] == P.HELLO and hello[2] is None
        assert hello[3][0]["index"] == 1 and hello[3][0]["message"] == "cannot build"
    finally:
        h.thread.join(5)
        h.slabs.close()
        h.channel.close()
