"""A sandbox's decode bomb: what one record from a sandbox decodes to is bounded in
values (and so in bytes), not only in wire size (hardening, issue 18).

Before the bound, a 5 MiB reply ``info={"x": [{}] * N}`` grew to ~74x its wire size in
the controller (each 1-byte msgpack map a 64-byte dict), with ``trusted=False`` too.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading
import tracemalloc

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.spaces import GraphInstance
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_fork import ForkVectorEnv
from gym_fork.errors import ControlMessageError, TransportError
from gym_fork.transport import codec
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import (
    MAX_OBJECTS_ENV,
    DecodeTooBig,
    check_bounds,
    pack,
    unpack,
)
from gym_fork.transport.control import recv_message
from tests.helpers import SpaceEnv

WIRE = 5 * 2**20  # the brief's 5 MiB reply
N = WIRE - 16  # {"x": [{}] * N} packs to ~5 MiB: one byte per empty map

BOMBS = {
    "flat": lambda: {"x": [{}] * N},
    # past the bound on one container: many lists, each short enough
    "nested": lambda: {"x": [[{}] * 2**16] * 80},
    # small strings: 3 bytes on the wire, a 51-byte str each
    "strings": lambda: {"x": [["ab"] * 2**16] * 26},
}


def values(value) -> int:
    """The values ``value`` decodes to, as :func:`check_bounds` counts them."""
    if type(value) is GraphInstance:  # the ext value, its list, three arrays (or nil)
        return 5
    if type(value) is tuple:  # the ext value, the list it holds, its items
        return 2 + sum(values(v) for v in value)
    if type(value) is list:
        return 1 + sum(values(v) for v in value)
    if type(value) is dict:
        return 1 + sum(values(k) + values(v) for k, v in value.items())
    return 1


def channel_pair(capacity: int = 1 << 20) -> tuple[Channel, Channel]:
    controller = Channel.create("bounds", capacity)
    worker = Channel.attach(os.dup(controller.region.fd), capacity, "bounds")
    return controller, worker


def receive(record: bytes, *, trusted: bool, trace: bool = False):
    """``record`` sent raw by a sandbox's end (in fragments if need be), received by the
    controller's: (what recv returned or raised, the controller's peak traced bytes)."""
    controller, worker = channel_pair()
    controller.allow_pickle = trusted
    sender = threading.Thread(target=worker.send_raw, args=(record,), kwargs={"timeout": 60})
    gc.collect()
    if trace:
        tracemalloc.start()
    try:
        sender.start()
        try:
            result = controller.recv(timeout=60)
        except Exception as exc:
            result = exc
        peak = tracemalloc.get_traced_memory()[1] if trace else 0
    finally:
        if trace:
            tracemalloc.stop()
        sender.join()
    try:
        controller.send_raw(pack("ping"))  # both directions still in step
        assert worker.recv(timeout=5) == "ping"
        worker.send_raw(pack("pong"))
        assert controller.recv(timeout=5) == "pong"
    finally:
        controller.close()
        worker.close()
    return result, peak


# -- the bound --------------------------------------------------------------------------


@pytest.mark.slow  # 12.4 s here
@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_decode_bomb_is_refused_before_it_is_built(bomb, trusted):
    record = pack(BOMBS[bomb]())
    assert 4.8 * 2**20 < len(record) < 5.1 * 2**20
    result, peak = receive(record, trusted=trusted, trace=True)
    assert isinstance(result, DecodeTooBig), result
    assert isinstance(result, TransportError) and result.reason == "too_big"
    assert MAX_OBJECTS_ENV in str(result) and str(codec.MAX_OBJECTS) in str(result)
    assert "'bounds replies'" in str(result)  # names the ring it came from
    # The controller holds the record (reassembled from fragments) and little more; it
    # held 72x the wire size in dicts (20x in small strs) before the bound.
    assert peak < 3 * len(record), f"peak {peak / len(record):.1f}x the wire size"


def test_one_container_longer_than_the_bound_is_refused_at_its_header():
    record = pack({"x": [None] * (2**20 + 1)})
    with pytest.raises(DecodeTooBig):
        check_bounds(record, 2**20)
    check_bounds(record, 2**20 + 4)  # the dict, its key, the list and its items


def test_a_container_announcing_more_items_than_bytes_left_is_malformed():
    # 1000 nested lists, each announcing 10000 items, cut short: msgpack allocates
    # ~80 KB for each open level before it finds out (76 MiB for 10 KB).
    record = (b"\xdc" + struct.pack(">H", 10000)) * 1000 + b"\xc0" * 7000
    with pytest.raises(ValueError, match="announces"):
        check_bounds(record, 10**6)
    controller, worker = channel_pair()
    try:
        controller.max_objects = 1000  # walk records over 1000 bytes
        worker.send_raw(record)
        with pytest.raises(TransportError) as info:
            controller.recv(timeout=5)
        assert info.value.reason == "decode" and not isinstance(info.value, DecodeTooBig)
        worker.send_raw(pack([1, 2]))
        assert controller.recv(timeout=5) == [1, 2]  # in step: the record was read whole
    finally:
        controller.close()
        worker.close()


@pytest.mark.parametrize(
    "record",
    [b"\xc1", b"\xdd\x00\x00", b"\xd9\x05ab", b"\x92\x01", b"\xc7\x09\x02\x92"],
    ids=["never-used-byte", "short-header", "short-str", "short-list", "short-ext"],
)
def test_malformed_records_are_a_value_error_not_a_crash(record):
    with pytest.raises(ValueError):
        check_bounds(record, 10**6)
    with pytest.raises(ValueError):
        unpack(record, max_objects=1)


def test_the_worker_reads_the_controllers_records_unbounded():
    controller, worker = channel_pair()
    try:
        assert controller.max_objects == codec.MAX_OBJECTS
        assert worker.max_objects is None
    finally:
        controller.close()
        worker.close()


def test_the_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(MAX_OBJECTS_ENV, "5000")
    assert codec._max_objects_from_env() == 5000
    monkeypatch.setenv(MAX_OBJECTS_ENV, "lots")
    with pytest.warns(UserWarning, match=MAX_OBJECTS_ENV):
        assert codec._max_objects_from_env() == codec.DEFAULT_MAX_OBJECTS
    monkeypatch.delenv(MAX_OBJECTS_ENV)
    assert codec._max_objects_from_env() == codec.DEFAULT_MAX_OBJECTS


def test_a_control_message_bomb_is_refused():
    ours, theirs = socket.socketpair()
    payload = pack({"pids": [{}] * N})
    sender = threading.Thread(
        target=theirs.sendall, args=(struct.pack("<II", len(payload), 0) + payload,)
    )
    try:
        sender.start()
        with pytest.raises(ControlMessageError) as info:
            recv_message(ours)
        assert info.value.reason == "too_big" and MAX_OBJECTS_ENV in str(info.value)
    finally:
        sender.join()
        ours.close()
        theirs.close()


# -- what honest envs send still passes -------------------------------------------------

HONEST = {
    "info with 5000 entries": lambda: [3, 1, [None, [{f"k{i}": float(i) for i in range(5000)}]]],
    "200k floats": lambda: [3, 1, [None, [{"trace": [0.5] * 200_000}]], None],
    "an 8 MiB array": lambda: [3, 1, [None, [{"frame": np.ones(2**23, np.uint8)}]], None],
    "200k tuples": lambda: [3, 1, [None, [{"path": [(i, i + 1) for i in range(200_000)]}]]],
}


@pytest.mark.slow  # 2.0 s here
@pytest.mark.parametrize("name", sorted(HONEST))
def test_honest_records_decode_as_before(name):
    value = HONEST[name]()
    record = pack(value)
    result, _ = receive(record, trusted=False)
    assert not isinstance(result, Exception), result
    assert pack(result) == record


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300)
    | st.sampled_from(["s" * 300, "t" * 70_000, b"b" * 70_000])
    | st.builds(np.float32, st.floats(-1, 1, width=32))
    | st.builds(lambda n: np.arange(n, dtype=np.int16), st.integers(0, 5))
    | st.just(GraphInstance(np.zeros((2, 3)), None, np.zeros((0, 2), np.int64)))
)
_keys = st.text(max_size=5) | st.integers(-5, 2**40) | st.tuples(st.integers(0, 9))
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(_keys, inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
    ),
    max_leaves=40,
)


@pytest.mark.slow  # 2.2 s here
@settings(max_examples=300, deadline=None)
@given(_values)
def test_the_walk_counts_every_value_exactly(value):
    record = pack(value)
    n = values(value)
    check_bounds(record, n)
    with pytest.raises(DecodeTooBig):
        check_bounds(record, n - 1)
    assert pack(unpack(record, max_objects=n)) == record


# -- end to end: a sandboxed env's step returns a bomb ----------------------------------


class BombEnv(SpaceEnv):
    """Action 1 returns a 5 MiB info that decoded to ~370 MiB of dicts."""

    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=50, trunc_prob=0)

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        if int(action) == 1:
            info = {"x": [{}] * N}
        return obs, reward, terminated, truncated, info


@pytest.mark.parametrize("trusted", [True, False])
def test_a_sandboxed_bomb_is_that_sub_envs_error_and_reset_recovers(trusted):
    envs = ForkVectorEnv([BombEnv, BombEnv], trusted=trusted, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        with pytest.raises(TransportError) as info:
            envs.step(np.array([0, 1]))
        error = info.value
        assert error.reason == "too_big"
        assert getattr(error, "indices", None) == [1]
        assert MAX_OBJECTS_ENV in str(error)
        obs, _ = envs.reset(seed=1)  # replaces the killed sandbox
        assert obs.shape == (2, 2)
        obs, rewards, *_ = envs.step(np.array([0, 0]))
        assert obs.shape == (2, 2) and rewards.shape == (2,)
    finally:
        envs.close()


def test_an_untrusted_record_of_colliding_tuple_keys_is_refused_quickly():
    """Tuples of ints built to share one hash make a dict quadratic to build; an
    untrusted record may hold at most MAX_CHOSEN_HASH_KEYS tuple keys (tuple values are free)."""
    import time

    from gym_fork.transport import codec

    # hash((a, b)) collides for many pairs: a brute-force set is not needed, the bound
    # on the count is what is checked (and that decoding stops at once).
    keys = {(i, -i): 0 for i in range(codec.MAX_CHOSEN_HASH_KEYS + 1)}
    record = codec.pack({"info": keys})
    started = time.perf_counter()
    with pytest.raises(codec.DecodeTooBig, match="dict keys that are not str"):
        codec.unpack(record, allow_pickle=False, refused=[])
    assert time.perf_counter() - started < 5.0
    few = codec.pack({"info": {(i, -i): 0 for i in range(100)}})
    assert len(codec.unpack(few, allow_pickle=False, refused=[])["info"]) == 100
    values = codec.pack({"info": [(i, -i) for i in range(3 * codec.MAX_CHOSEN_HASH_KEYS)]})
    assert len(codec.unpack(values, allow_pickle=False, refused=[])["info"]) == 6144


def test_too_many_tuple_keys_reach_the_controller_as_too_big():
    from gym_fork.transport import codec

    record = codec.pack({"info": {(i, -i): 0 for i in range(codec.MAX_CHOSEN_HASH_KEYS + 1)}})
    result, _ = receive(record, trusted=False)
    assert isinstance(result, codec.DecodeTooBig), result
    assert result.reason == "too_big" and "dict keys that are not str" in str(result)
