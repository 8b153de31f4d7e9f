"""Values survive the ring encoding with their types, or fail with a clear error."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gym_fork.errors import EncodeError
from gym_fork.transport.codec import pack, unpack

leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.binary(max_size=20),
    hnp.arrays(hnp.scalar_dtypes(), hnp.array_shapes(min_dims=0, max_dims=3, max_side=4)),
)
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=8), inner, max_size=4),
    ),
    max_leaves=12,
)


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@settings(max_examples=200, deadline=None)
@given(values)
def test_round_trip_preserves_types_and_values(value):
    assert same(unpack(pack(value)), value)


def test_numpy_scalars_keep_their_dtype():
    for scalar in (np.float32(1.5), np.int8(-3), np.bool_(True), np.uint64(2**63)):
        out = unpack(pack(scalar))
        assert type(out) is type(scalar) and out == scalar


def test_arbitrary_objects_fall_back_to_pickle():
    value = {"set": {1, 2}, "complex": 1 + 2j, "range": range(3)}
    assert unpack(pack(value)) == value


def test_unpicklable_values_raise_a_clear_error():
    with pytest.raises(EncodeError, match="lock"):
        pack({"bad": threading.Lock()})


def test_a_graph_value_travels_as_plain_arrays_not_a_pickle():
    from gymnasium.spaces import GraphInstance

    value = GraphInstance(np.ones((3, 2)), np.arange(2), np.array([[0, 1], [1, 2]]))
    refused: list[int] = []
    back = unpack(pack(value), allow_pickle=False, refused=refused)
    assert refused == [] and type(back) is GraphInstance
    assert all(np.array_equal(a, b) for a, b in zip(back, value, strict=True))


@pytest.mark.parametrize("seq", [0, 1, 127, 128, 65535, 2**32, 2**64 - 1, 2**64, -1])
def test_the_hot_path_records_decode_as_their_msgpack_forms(seq):
    from gym_fork.transport.codec import pack_bare_request, pack_empty_reply

    request = unpack(pack_bare_request(3, seq))
    reply = unpack(pack_empty_reply(3, seq))
    assert request == unpack(pack([3, seq, None])) == [3, seq, None]
    assert reply == unpack(pack([3, seq, [None, None], None])) == [3, seq, [None, None], None]
    assert type(request[1]) is int and type(reply[1]) is int
