"""A reply cannot drive the controller's decoder (boundary II, issue 30 item 1).

On the main of the time, a ~1 KiB ``info`` of ~200 nested tuples made the decoder
recurse one C unpack context per level until the controller died of SIGSEGV (no
``except``, no ``close()``); dict keys built to share one hash (complex numbers, numpy
scalars) made a 0.9 MiB reply hold ``step()`` for 10-15 s, deaf to its timeout. The
crashes are tried in a child interpreter: a segfault there fails the test, not pytest.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
from gymnasium.spaces import GraphInstance

from gym_fork.errors import ControlMessageError
from gym_fork.transport import codec
from gym_fork.transport.channel import Channel
from gym_fork.transport.codec import DecodeTooBig, pack, unpack
from gym_fork.transport.control import recv_message

REPO = Path(__file__).resolve().parents[2]


def nested_ext(code: int, depth: int, leaf: bytes = b"\x90") -> bytes:
    """A record of ``depth`` ext values of ``code`` each holding the next (as a
    one-item list, the way a tuple packs), built without recursing."""
    record = leaf
    for _ in range(depth):
        payload = b"\x91" + record
        record = msgpack.ExtType(code, payload)
        record = msgpack.packb(record)
    return record


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter of this venv, with the repo importable."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


@pytest.mark.parametrize("trusted", [False, True])
@pytest.mark.parametrize("code", [codec.EXT_TUPLE, codec.EXT_GRAPH, codec.EXT_PLAIN])
def test_deeply_nested_ext_values_are_refused_not_a_crash(code, trusted):
    """200 levels segfaulted the reader; 5000 are refused just as quickly."""
    child = run_child(
        f"""
        from gym_fork.transport import codec
        from tests.transport.test_decoder_cannot_be_driven import nested_ext
        for depth in (200, 5000):
            record = nested_ext({code}, depth)
            try:
                codec.unpack(record, allow_pickle={trusted}, refused=[])
            except codec.DecodeTooBig as exc:
                print(depth, len(record), "refused:", exc)
            else:
                print(depth, "decoded")
        """
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-2000:])
    lines = child.stdout.splitlines()
    assert len(lines) == 2 and all("refused:" in line for line in lines), child.stdout
    assert f"more than {codec.MAX_EXT_DEPTH} deep" in lines[0]


def test_mixed_ext_nesting_counts_every_level():
    """Tuples inside plain values inside Graphs share one depth count."""
    record = b"\x90"
    codes = [codec.EXT_TUPLE, codec.EXT_GRAPH, codec.EXT_PLAIN]
    for level in range(codec.MAX_EXT_DEPTH + 1):
        record = msgpack.packb(msgpack.ExtType(codes[level % 3], b"\x91" + record))
    with pytest.raises(DecodeTooBig, match="deep"):
        unpack(record, allow_pickle=False, refused=[])


@pytest.mark.parametrize(
    "inner",
    [b"\x91" * 1000 + b"\xc0", b"\x81\xa4kind" + b"\x91" * 1000 + b"\xc0"],
    ids=["deep-list", "deep-kind"],
)
def test_a_plain_value_nested_1000_deep_is_refused_as_a_pickle(inner):
    """A Space/EnvSpec/Generator ext value whose data nests lists ~1000 deep (within
    msgpack's own stack) is rebuilt by Python code: it is refused like a pickle, not
    raised as a RecursionError out of the controller's decode."""
    record = msgpack.packb([msgpack.ExtType(codec.EXT_PLAIN, inner)])
    refused: list[int] = []
    (value,) = unpack(record, allow_pickle=False, refused=refused)
    assert isinstance(value, codec.RefusedPickle) and refused == [len(inner)]


@pytest.mark.parametrize("trusted", [False, True])
def test_tuples_nested_up_to_the_bound_decode_exactly(trusted):
    value: object = (1, "a")
    for _ in range(codec.MAX_EXT_DEPTH - 1):
        value = (value, 2)
    assert unpack(pack(value), allow_pickle=trusted, refused=[]) == value
    graph = GraphInstance(np.zeros((2, 3)), None, np.zeros((0, 2), np.int64))
    back = unpack(pack({"g": (graph,)}), allow_pickle=trusted, refused=[])["g"][0]
    assert type(back) is GraphInstance and back.nodes.shape == (2, 3)


def colliding_complex(n: int) -> list[np.complex128]:
    """``n`` distinct complex numbers with one hash: hash(complex(x, y)) is
    hash(x) + 1000003 * hash(y), so x = 1000003 * k, y = -k all hash to 0 (k >= 2)."""
    keys = [np.complex128(complex(1_000_003 * k, -k)) for k in range(2, n + 2)]
    assert len({hash(k) for k in keys}) == 1
    return keys


@pytest.mark.parametrize(
    "make_keys",
    [
        colliding_complex,
        lambda n: [(i, -i) for i in range(n)],
        lambda n: [GraphInstance(np.int64(i), None, None) for i in range(n)],  # namedtuples
    ],
    ids=["complex", "tuples", "graphs"],
)
def test_chosen_hash_keys_are_charged_to_one_budget(make_keys):
    keys = make_keys(codec.MAX_CHOSEN_HASH_KEYS + 1)
    # Spread over many dicts: the budget is the record's, not one map's.
    halves = [dict.fromkeys(keys[::2], 0), dict.fromkeys(keys[1::2], 0)]
    record = pack({"info": halves})
    started = time.perf_counter()
    with pytest.raises(DecodeTooBig, match="dict keys that are not str"):
        unpack(record, allow_pickle=False, refused=[])
    assert time.perf_counter() - started < 5.0
    few = pack({"info": dict.fromkeys(keys[:100], 0)})
    assert len(unpack(few, allow_pickle=False, refused=[])["info"]) == 100
    # as values they are free; and a trusted reader does not count
    assert len(unpack(pack({"v": keys}), allow_pickle=False, refused=[])["v"]) == len(keys)
    assert len(unpack(record, allow_pickle=True)["info"][0]) == len(halves[0])


def test_keys_whose_hash_a_sandbox_cannot_choose_are_free():
    info = {
        "s": {f"k{i}": i for i in range(5000)},
        "i": {i: i for i in range(5000)},
        "b": {bytes([i % 256, i // 256]): 0 for i in range(5000)},
        "f": {i + 0.5: 0 for i in range(5000)},
        "n": {None: 1, True: 2},
    }
    assert unpack(pack(info), allow_pickle=False, refused=[]) == info


def test_a_controllers_channel_end_starts_untrusted():
    controller = Channel.create("trust default", 1 << 16)
    worker = Channel.attach(os.dup(controller.region.fd), 1 << 16, "trust default")
    try:
        assert controller.allow_pickle is False and worker.allow_pickle is True
        worker.send({"value": {1, 2}})  # a set travels pickled
        got = controller.recv(timeout=5)
        assert isinstance(got["value"], codec.RefusedPickle) and controller.refused
    finally:
        controller.close()
        worker.close()


def test_a_control_message_holding_a_pickle_is_refused_unloaded(tmp_path):
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ours, theirs = socket.socketpair()
    payload = pack({"op": "ready", "isolation": {"x": Boom()}})
    sender = threading.Thread(
        target=theirs.sendall, args=(struct.pack("<II", len(payload), 0) + payload,)
    )
    try:
        sender.start()
        with pytest.raises(ControlMessageError, match="pickled value") as info:
            recv_message(ours)
        assert info.value.reason == "decode"
        assert not marker.exists()
    finally:
        sender.join()
        ours.close()
        theirs.close()


ENVS = """
import gymnasium as gym
import numpy as np
from gymnasium import spaces


class Hostile(gym.Env):
    observation_space = spaces.Box(-1, 1, (2,))
    action_space = spaces.Discrete(3)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action):
        info = {}
        if int(action) == 1:
            deep = ()
            for _ in range(200):
                deep = (deep,)
            info = {"deep": deep}
        elif int(action) == 2:
            info = {
                "keys": {
                    np.complex128(complex(1_000_003 * k, -k)): 0 for k in range(2, 5_000)
                }
            }
        return np.zeros(2, np.float32), 0.0, False, False, info
"""


@pytest.mark.slow  # 1.4 s here
@pytest.mark.parametrize("action", [1, 2], ids=["nested tuples", "colliding keys"])
def test_a_hostile_reply_is_that_sub_envs_error_in_a_living_controller(tmp_path, action):
    """As a user runs it: a training script whose env sends the reply; the script
    survives, gets an error naming the sub-env within its timeout, and goes on."""
    (tmp_path / "hostile_envs.py").write_text(ENVS)
    child = run_child(
        f"""
        import sys, time
        sys.path.insert(0, {str(tmp_path)!r})
        import numpy as np
        from gym_fork import ForkVectorEnv
        from gym_fork.errors import TransportError
        from hostile_envs import Hostile
        envs = ForkVectorEnv([Hostile, Hostile], envs_per_worker=1, timeout=10)
        try:
            envs.reset(seed=0)
            started = time.monotonic()
            try:
                envs.step(np.array([0, {action}]))
            except TransportError as exc:
                print("error", exc.reason, getattr(exc, "indices", None))
            print("took", round(time.monotonic() - started, 2))
            envs.reset(seed=1)
            obs, *_ = envs.step(np.array([0, 0]))
            print("after", obs.shape)
        finally:
            envs.close()
        print("closed")
        """,
        timeout=300,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-3000:])
    lines = child.stdout.splitlines()
    assert lines[0] == "error too_big [1]", child.stdout
    assert float(lines[1].split()[1]) < 10, child.stdout  # the step's own timeout
    assert lines[2:] == ["after (2, 2)", "closed"], child.stdout


def colliding_timestamps(n: int) -> list[tuple[int, int]]:
    """``n`` (seconds, nanoseconds) pairs whose msgpack Timestamps share one hash: a
    Timestamp hashes as the tuple (seconds, nanoseconds), and CPython's tuple hash (an
    xxHash round per item) can be inverted for the first item given the second."""
    mask, prime = (1 << 64) - 1, (1 << 61) - 1
    p1, p2, p5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
    p1_inverse, p2_inverse = pow(p1, -1, 1 << 64), pow(p2, -1, 1 << 64)
    target, out, nanos = 0x123456789ABCDEF, [], 0
    while len(out) < n:
        before_second = (target - nanos * p2) & mask
        rotated = (before_second * p1_inverse) & mask
        lane = ((((rotated >> 31) | (rotated << 33)) & mask) - p5) & mask
        first = (lane * p2_inverse) & mask  # the hash the seconds must have
        if first < prime - 1:
            out.append((first, nanos))
        nanos += 1
    return out


def test_timestamp_keys_msgpack_builds_past_the_ext_hook_cost_no_quadratic_time():
    """msgpack decodes ext -1 to a Timestamp itself, so the chosen-hash budget never saw
    them: 12,000 colliding keys (192 KB) took 9 s. From an untrusted sandbox a Timestamp
    is its float seconds."""
    pairs = colliding_timestamps(12_000)
    assert len({hash(msgpack.Timestamp(s, ns)) for s, ns in pairs[:20]}) == 1
    body = bytearray(b"\xdf" + struct.pack(">I", len(pairs)))
    for seconds, nanos in pairs:
        body += b"\xc7\x0c\xff" + struct.pack(">Iq", nanos, seconds) + b"\xc0"
    started = time.perf_counter()
    value = unpack(bytes(body), allow_pickle=False, refused=[])
    assert time.perf_counter() - started < 2.0
    assert len(value) == len(pairs) and all(type(k) is float for k in value)
    stamp = pack({"t": msgpack.Timestamp(5, 7)})
    assert unpack(stamp, allow_pickle=False, refused=[]) == {"t": 5.000000007}
    assert unpack(stamp) == {"t": msgpack.Timestamp(5, 7)}  # a trusted peer's: as sent


@pytest.mark.parametrize(
    "record",
    [
        # a numpy scalar whose dtype is 1,000,000 structured fields (3 MB)
        msgpack.packb(msgpack.ExtType(codec.EXT_NPSCALAR, b"i1," * 10**6 + b"\0\0")),
        # a Box space whose dtype text is as long (as space_codec encodes a Box)
        msgpack.packb(
            msgpack.ExtType(
                codec.EXT_PLAIN,
                pack(
                    {
                        "kind": "space",
                        "space": {
                            "kind": "box",
                            "low": np.zeros(1, np.int8),
                            "high": np.ones(1, np.int8),
                            "dtype": "i1," * 10**6,
                        },
                    }
                ),
            )
        ),
    ],
    ids=["npscalar", "space"],
)
def test_a_dtype_text_is_bounded_before_numpy_parses_it(record):
    """numpy parses a structured dtype's text field by field under the GIL: a 15 MB one
    held step() 32 s and took 1.7 GB of the controller."""
    started = time.perf_counter()
    refused: list[int] = []
    try:
        value = unpack(record, allow_pickle=False, refused=refused)
    except ValueError as exc:
        assert "dtype text" in str(exc)
    else:  # a space that does not decode is refused as a pickle would be
        assert isinstance(value, codec.RefusedPickle) and refused, value
    assert time.perf_counter() - started < 0.5
