"""Slab layouts: every fixed-size space round-trips through shared rows."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.utils.env_checker import data_equivalence

from gym_fork.transport.layout import async_shares, slab_node
from gym_fork.transport.slab import Slab

FIXED = [
    spaces.Box(-1, 1, (3,), np.float32),
    spaces.Box(0, 255, (4, 4, 3), np.uint8),
    spaces.Box(-5, 5, (2,), np.int16),
    spaces.Box(-1, 1, (3,), np.float16),
    spaces.Discrete(5, start=-2),
    spaces.MultiDiscrete([3, 4]),
    spaces.MultiBinary(6),
    spaces.Text(6),
    spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(0, 1, (2,))}),
    spaces.Tuple((spaces.Discrete(2), spaces.Tuple((spaces.MultiBinary(2),)))),
]


@pytest.mark.parametrize("space", FIXED, ids=repr)
def test_rows_round_trip_and_stay_independent(space):
    slab = Slab(space, space, 3)
    space.seed(0)
    samples = [space.sample() for _ in range(3)]
    for i, sample in enumerate(samples):
        slab.observations.write(i, sample)
    for i, sample in enumerate(samples):
        assert data_equivalence(slab.observations.read(i), sample)
    slab.close()


def test_variable_size_spaces_have_no_layout_but_oneof_is_shared_by_async():
    assert slab_node(spaces.Sequence(spaces.Discrete(2)), 2) is None
    assert slab_node(spaces.OneOf([spaces.Discrete(2), spaces.Box(0, 1)]), 2) is None
    assert async_shares(spaces.OneOf([spaces.Discrete(2), spaces.Box(0, 1)]))
    assert not async_shares(spaces.Graph(spaces.Box(0, 1), None))


def test_wrong_shape_is_rejected_with_the_expected_shape():
    slab = Slab(spaces.Box(0, 1, (3,)), spaces.Discrete(2), 2)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        slab.observations.write(0, np.zeros(4))
    slab.close()


def test_two_mappings_of_one_slab_share_rows():
    import os

    space = spaces.Box(0, 1, (2,), np.float64)
    owner = Slab(space, spaces.Discrete(2), 2)
    peer = Slab(space, spaces.Discrete(2), 2, region_fd=os.dup(owner.region.fd))
    peer.observations.write(1, np.array([0.25, 0.5]))
    peer.rewards[1] = 3.0
    assert owner.observations.read(1).tolist() == [0.25, 0.5]
    assert owner.rewards[1] == 3.0
    peer.close()
    owner.close()


@pytest.mark.parametrize(
    "space",
    [
        spaces.Box(-1, 1, (3,), np.float32),
        spaces.Discrete(5),
        spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(0, 1, (2,))}),
    ],
    ids=repr,
)
def test_a_slab_set_scatters_and_gathers_whole_batches_across_its_slabs(space):
    import os

    from gymnasium.vector.utils import batch_space, iterate

    from gym_fork.transport.slab import SlabSet

    counts = [3, 1, 2]
    fds = [os.memfd_create("t", os.MFD_ALLOW_SEALING) for _ in counts]
    slabs = SlabSet(space, space, counts, fds, use_observations=True)
    batch = batch_space(space, 6)
    batch.seed(1)
    for _ in range(2):  # the second time after a slab was replaced
        actions = batch.sample()
        assert slabs.accepts_actions(actions)
        slabs.write_actions(actions)
        rows = list(iterate(batch, actions))
        for i, expected in enumerate(rows):
            slab, row = slabs.where(i)
            assert data_equivalence(slab.actions.read(row), expected)
            slab.observations.write(row, expected)
            slab.rewards[row], slab.terminations[row] = i, i % 2 == 0
        assert data_equivalence(slabs.observations(), actions)
        rewards, terminations, truncations = slabs.step_columns()
        assert rewards.tolist() == list(range(6)) and truncations.tolist() == [False] * 6
        assert terminations.tolist() == [i % 2 == 0 for i in range(6)]
        assert not np.shares_memory(rewards, slabs.slabs[0].rewards)
        slabs.replace(1, os.memfd_create("t", os.MFD_ALLOW_SEALING))
    slabs.close()
