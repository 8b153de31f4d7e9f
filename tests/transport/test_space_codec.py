"""Spaces and metadata as plain data: every Gymnasium space round-trips; pickles are
loaded only for a trusted sandbox (transport/space_codec.py)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import Space, spaces

from gym_fork.transport.codec import pack, unpack
from gym_fork.transport.space_codec import (
    SpaceRefused,
    mapping_from_data,
    mapping_to_data,
    register_space,
    space_from_data,
    space_to_data,
)

SPACES = [
    spaces.Box(-1, 1, (3,), np.float32),
    spaces.Box(np.array([0, -2]), np.array([1, 5]), dtype=np.int64),
    spaces.Discrete(7, start=1),
    spaces.MultiDiscrete([[2, 5], [3, 4]], start=[[1, 1], [0, 0]]),
    spaces.MultiBinary([2, 3]),
    spaces.Text(8, min_length=2, charset="abc"),
    spaces.Dict({"pos": spaces.Box(-1, 1, (2,)), "id": spaces.Discrete(4)}),
    spaces.Tuple((spaces.MultiBinary(2), spaces.Box(0, 1, (1,)))),
    spaces.OneOf((spaces.Discrete(3), spaces.Box(0, 1, (2,)))),
    spaces.Sequence(spaces.Discrete(4), stack=True),
    spaces.Graph(spaces.Box(0, 1, (2,)), spaces.Discrete(3)),
]


class GridSpace(Space):
    """A user's own space type."""

    def __init__(self, size: int):
        super().__init__((size, size), np.int8)
        self.size = size

    def __eq__(self, other):
        return isinstance(other, GridSpace) and other.size == self.size


@pytest.mark.parametrize("space", SPACES, ids=lambda s: type(s).__name__)
def test_every_gymnasium_space_round_trips_without_pickles(space):
    data = unpack(pack(space_to_data(space)))
    assert "pickled" not in repr(data)
    assert space_from_data(data, trusted=False) == space


def test_an_unregistered_space_travels_pickled_and_only_a_trusted_controller_loads_it():
    space = GridSpace(3)
    space.check = lambda x: True  # not plain data: it cannot travel by reference
    data = unpack(pack(space_to_data(space)))
    with pytest.raises(SpaceRefused, match="pickled space"):
        space_from_data(data, trusted=False)
    assert space_from_data(data, trusted=True) == GridSpace(3)


def test_a_registered_custom_space_is_plain_data():
    class Ring(GridSpace):
        pass

    register_space(Ring, "test-ring", lambda s: {"size": s.size}, lambda d, _t: Ring(d["size"]))
    data = unpack(pack(space_to_data(Ring(4))))
    assert space_from_data(data, trusted=False) == Ring(4)


@pytest.mark.parametrize(
    "data",
    [
        {"kind": "box", "low": [0], "high": [1], "dtype": "|O"},
        {"kind": "nope"},
        {"kind": "discrete"},
        ["not", "a", "space"],
    ],
)
def test_what_a_hostile_sandbox_might_send_is_refused_with_a_clear_error(data):
    with pytest.raises(SpaceRefused):
        space_from_data(data, trusted=False)


def test_metadata_keeps_plain_values_and_refuses_pickles_when_untrusted():
    metadata = {"render_modes": ["rgb_array"], "render_fps": 30, "odd": {1, 2}}
    data = unpack(pack(mapping_to_data(metadata)))
    assert mapping_from_data(data, trusted=True) == metadata
    untrusted = mapping_from_data(data, trusted=False)
    assert untrusted["render_fps"] == 30 and untrusted["render_modes"] == ["rgb_array"]
    assert "refused" in untrusted["odd"]
