"""gym_fork/vector/spaces.py: a branch's spaces (VectorSpaces.for_branch)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector.utils import batch_space

from gym_fork.vector.spaces import VectorSpaces


def _spaces(n: int) -> VectorSpaces:
    single_obs = spaces.Box(0, 255, (4, 8, 8), np.uint8)
    single_act = spaces.Box(-1.0, 1.0, (3,), np.float32)
    return VectorSpaces(
        single_obs,
        batch_space(single_obs, n),
        single_act,
        batch_space(single_act, n),
        [single_obs] * n,
        "same",
    )


def test_a_branch_of_as_many_sub_envs_gets_equal_spaces_with_their_own_generators():
    source = _spaces(3)
    branch = source.for_branch("same", [2, 0, 1])
    assert branch.observation_space == batch_space(source.single_observation_space, 3)
    assert branch.action_space == batch_space(source.single_action_space, 3)
    assert branch.observation_space is not source.observation_space
    assert branch.action_space is not source.action_space
    # Seeding the branch's spaces leaves the source's samples as they were.
    source.action_space.seed(7)
    expected = source.action_space.sample()
    source.action_space.seed(7)
    branch.action_space.seed(7)
    branch.action_space.sample()
    assert np.array_equal(source.action_space.sample(), expected)


@pytest.mark.parametrize(
    "single",
    [spaces.Discrete(5), spaces.Dict({"a": spaces.Discrete(3)}), spaces.Text(12, min_length=1)],
)
def test_a_branchs_spaces_sample_as_batch_space_would_make_them(single):
    """batch_space seeds the batch with a copy of the single space's generator: a branch
    of a seeded single space samples the same, whatever its size."""
    source = VectorSpaces(
        single, batch_space(single, 3), single, batch_space(single, 3), [single] * 3, "same"
    )
    for sources in ([0, 1, 2], [0, 1]):  # as many sub-envs (copied), fewer (batched again)
        single.seed(11)
        expected = batch_space(single, len(sources)).sample()
        single.seed(11)
        branch = source.for_branch("same", sources)
        got = branch.action_space.sample()
        assert str(got) == str(expected), (sources, got, expected)
        assert branch.action_space == batch_space(single, len(sources))


def test_a_text_branchs_copies_draw_on_their_own_and_leave_the_single_space_as_it_was():
    """A Text batch is made without batch_space's deep copies (gym_fork/vector/spaces.py
    ``_batch``): each copy has a generator of its own, seeded as batch_space seeds it,
    and the single space's generator is not drawn from."""
    single = spaces.Text(8, charset="abc")
    source = VectorSpaces(
        single, batch_space(single, 2), single, batch_space(single, 2), [single] * 2, "same"
    )
    single.seed(3)
    state = single.np_random.bit_generator.state
    branch = source.for_branch("same", [0, 0, 1, 1])
    assert single.np_random.bit_generator.state == state
    generators = {id(sub.np_random) for sub in branch.observation_space.spaces}
    assert len(generators) == 4 and id(single.np_random) not in generators
    first, second = branch.observation_space.spaces[:2]
    first.seed(0)
    alone = [first.sample() for _ in range(3)]
    first.seed(0)
    second.sample()  # drawn from another copy: no effect on the first
    assert [first.sample() for _ in range(3)] == alone


def test_a_branch_of_another_size_gets_spaces_batched_for_its_size():
    source = _spaces(3)
    branch = source.for_branch("same", [1, 1, 1, 0, 2])
    assert branch.observation_space == batch_space(source.single_observation_space, 5)
    assert branch.action_space == batch_space(source.single_action_space, 5)
    assert len(branch.sub_env_observation_spaces) == 5


@pytest.mark.parametrize("bits", [np.random.PCG64, np.random.MT19937, np.random.SFC64])
def test_a_branchs_copied_generator_draws_as_its_single_spaces_own(bits):
    """The copy of a batch takes a copy of the single space's generator: set from its
    state for numpy's PCG64 and Philox, deep-copied for any other; either way it draws
    what batch_space's would and leaves the single space's untouched."""
    single = spaces.Box(-1.0, 1.0, (3,), np.float32)
    source = VectorSpaces(
        single, batch_space(single, 2), single, batch_space(single, 2), [single] * 2, "same"
    )
    single._np_random = np.random.Generator(bits(5))
    expected = batch_space(single, 2).sample()
    single._np_random = np.random.Generator(bits(5))
    branch = source.for_branch("same", [1, 0])
    assert type(branch.action_space.np_random.bit_generator) is bits
    assert np.array_equal(branch.action_space.sample(), expected)
    assert single.np_random.random() == np.random.Generator(bits(5)).random()  # untouched
    # what it spawns too: a deep copy's (its seed sequence copied, not a fresh one)
    single._np_random = np.random.Generator(bits(np.random.SeedSequence(9)))
    expected = [g.random() for g in batch_space(single, 2).np_random.spawn(2)]
    single._np_random = np.random.Generator(bits(np.random.SeedSequence(9)))
    branch = source.for_branch("same", [1, 0])
    assert [g.random() for g in branch.action_space.np_random.spawn(2)] == expected
