"""trusted=False is the default on every host (issue 18, item 4): nothing a sandbox sends
is unpickled unless the user passes trusted=True (or GYM_FORK_TRUSTED=1).

Before, the process host trusted its sandboxes by default: an exception whose
``__reduce__`` runs code, raised in a sub-env's ``step``, ran that code in the
controller with the user's privileges when it was unpickled there.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import Space, spaces

from gym_fork import ForkVectorEnv, PickleRefused, SubEnvError
from gym_fork.errors import BadObservationError, EncodeError, like_builtin
from gym_fork.vector import config
from tests.helpers import SpaceEnv


@pytest.fixture(autouse=True)
def no_trust_from_the_environment(monkeypatch):
    monkeypatch.delenv("GYM_FORK_TRUSTED", raising=False)


class HostileError(ValueError):
    """Unpickling it runs ``open(path, "w")`` in whoever loads it (a marker file)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"hostile step, marker {path}")
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class HostileStepEnv(SpaceEnv):
    """Steps normally, except that a step with action 2 raises HostileError."""

    def __init__(self, marker: str) -> None:
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(3), max_len=50, trunc_prob=0)
        self.marker_path = marker

    def step(self, action):
        if int(action) == 2:
            self.explode()
        return super().step(action)

    def explode(self):
        raise HostileError(self.marker_path)


class Opaque:
    """A custom object: msgpack cannot carry it, so it could only travel pickled."""

    def __init__(self) -> None:
        self.value = 7


class OpaqueEnv(SpaceEnv):
    def __init__(self) -> None:
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2))
        self.opaque = Opaque()


def test_the_default_is_untrusted_on_every_host():
    assert config.VectorConfig.__dataclass_fields__["trusted"].default is False
    assert config.trusted_from_environment() is False
    for host in ("process", "inline"):
        envs = ForkVectorEnv([OpaqueEnv], host=host, lineage_log=False)
        try:
            assert envs.trusted is False
        finally:
            envs.close()


@pytest.mark.parametrize(
    ("value", "trusted"),
    [("1", True), ("true", True), ("Yes", True), ("0", False), ("false", False), ("", False)],
)
def test_gym_fork_trusted_opts_in(monkeypatch, value, trusted):
    monkeypatch.setenv("GYM_FORK_TRUSTED", value)
    assert config.trusted_from_environment() is trusted


def test_a_gym_fork_trusted_value_that_is_not_a_yes_or_no_is_an_error(monkeypatch):
    monkeypatch.setenv("GYM_FORK_TRUSTED", "maybe")
    with pytest.raises(ValueError, match="GYM_FORK_TRUSTED"):
        config.trusted_from_environment()


def test_a_hostile_exception_in_step_runs_nothing_under_the_default(tmp_path):
    marker = tmp_path / "pwned"
    envs = ForkVectorEnv(
        [lambda: HostileStepEnv(str(marker))] * 2, envs_per_worker=1, lineage_log=False
    )
    try:
        envs.reset(seed=0)
        caught = None
        try:
            envs.step(np.array([0, 2]))  # sub-env 1 raises
        except ValueError as exc:  # the hostile class subclasses ValueError
            caught = exc
        assert caught is not None
        assert not marker.exists(), "the controller unpickled the sandbox's exception"
        assert isinstance(caught, SubEnvError)
        assert caught.index == 1 and caught.gym_fork_index == 1
        assert caught.type_name == "HostileError"
        assert "hostile step" in str(caught)
        # The original traceback, as text: the frames inside the sandbox.
        assert "in explode" in caught.remote_traceback
        assert "HostileError: hostile step" in caught.remote_traceback
        assert any("sub-env 1" in note and "in explode" in note for note in caught.__notes__)
        # The vector env stays usable.
        obs, *_ = envs.step(np.array([0, 1]))
        assert obs.shape == (2, 2)
    finally:
        envs.close()
    assert not marker.exists()


def test_the_hostile_exception_is_loaded_only_with_trusted_true(tmp_path):
    marker = tmp_path / "pwned"
    envs = ForkVectorEnv([lambda: HostileStepEnv(str(marker))], trusted=True, lineage_log=False)
    try:
        envs.reset(seed=0)
        with pytest.raises(Exception):  # noqa: B017 - whatever the payload made of it
            envs.step(np.array([2]))
        assert marker.exists()  # AsyncVectorEnv's behaviour, now opt-in
    finally:
        envs.close()


def test_a_value_that_needs_pickling_names_trusted_true():
    envs = ForkVectorEnv([OpaqueEnv, OpaqueEnv], envs_per_worker=1, lineage_log=False)
    try:
        envs.reset(seed=0)
        with pytest.raises(PickleRefused, match=r"trusted=True") as info:
            envs.get_attr("opaque")
        assert "sub-env(s) [0]" in str(info.value)
        assert envs.get_attr("t") == (0, 0)  # plain data still travels; env usable
    finally:
        envs.close()
    envs = ForkVectorEnv([OpaqueEnv], trusted=True, lineage_log=False)
    try:
        envs.reset(seed=0)
        assert envs.get_attr("opaque")[0].value == 7
    finally:
        envs.close()


def test_gym_fork_and_gymnasium_error_types_survive_as_types():
    """A sandbox's exception is rebuilt by type name from code the controller has
    loaded already (never from the sandbox's bytes)."""

    def rebuilt(type_name):
        return like_builtin(SubEnvError, type_name)(
            f"{type_name}: m", index=0, type_name=type_name, traceback=""
        )

    assert isinstance(rebuilt("BadObservationError"), BadObservationError)
    assert isinstance(rebuilt("EncodeError"), EncodeError | TypeError)
    assert isinstance(rebuilt("ResetNeeded"), gym.error.ResetNeeded)
    assert str(rebuilt("KeyError")) == "KeyError: m"  # not KeyError's quoted repr
    # A builtin that needs more than a message: its nearest base that does not.
    assert isinstance(rebuilt("UnicodeDecodeError"), UnicodeError)
    assert isinstance(rebuilt("ExceptionGroup"), SubEnvError)
    assert type(rebuilt("HostileError")) is SubEnvError


class PlainCustomSpace(Space):
    """A user's own space type without a registered encoder (Gymnasium's suite has one)."""

    def __init__(self, size=3):
        super().__init__((size,), np.int64, seed=0)
        self.size = size
        self.inner = spaces.Discrete(size)

    def sample(self, mask=None, probability=None):
        return self.np_random.integers(0, self.size, (self.size,))

    def contains(self, x):
        return np.shape(x) == (self.size,)

    def __eq__(self, other):
        return isinstance(other, PlainCustomSpace) and other.size == self.size


class CustomSpaceEnv(SpaceEnv):
    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2))
        self.observation_space = PlainCustomSpace()

    def reset(self, *, seed=None, options=None):
        gym.Env.reset(self, seed=seed)
        return np.zeros(3, np.int64), {}

    def step(self, action):
        return np.ones(3, np.int64), 0.0, False, False, {}


def test_a_custom_space_travels_by_reference_under_the_default():
    envs = ForkVectorEnv([CustomSpaceEnv] * 2, shared_memory=False, lineage_log=False)
    try:
        assert isinstance(envs.single_observation_space, PlainCustomSpace)
        assert envs.single_observation_space == PlainCustomSpace()
        assert envs.single_observation_space.inner == spaces.Discrete(3)
        obs, _ = envs.reset(seed=0)
        assert [list(o) for o in obs] == [[0, 0, 0], [0, 0, 0]]
    finally:
        envs.close()


def test_space_codec_by_reference_generators_and_specs_without_pickles():
    from gym_fork.transport.codec import pack, unpack
    from gym_fork.transport.space_codec import (
        SpaceRefused,
        space_from_data,
        space_to_data,
        value_from_data,
        value_to_data,
    )

    space = PlainCustomSpace(4)
    space.sample()  # its Generator has moved on: the copy continues from the same state
    data = unpack(pack(space_to_data(space)), allow_pickle=False)
    assert data["kind"] == "reference"
    copy = space_from_data(data, trusted=False)
    assert copy == space and copy.dtype == space.dtype and copy.shape == space.shape
    assert (copy.sample() == space.sample()).all()
    # A class this controller has not imported is refused, never imported.
    data["module"] = "gym_fork_no_such_module"
    with pytest.raises(SpaceRefused, match="trusted=True"):
        space_from_data(data, trusted=False)
    data["module"], data["qualname"] = "builtins", "dict"
    with pytest.raises(SpaceRefused, match="not a space class"):
        space_from_data(data, trusted=False)

    spec = gym.make("CartPole-v1").spec
    rng = np.random.default_rng(5)
    rng.random()
    for value in (spec, rng, spaces.Box(0, 1, (2,)), PlainCustomSpace()):
        encoded = unpack(pack(value_to_data(value)), allow_pickle=False)
        assert "pickled" not in repr(encoded)
        back = value_from_data(encoded, trusted=False)
        if isinstance(value, np.random.Generator):
            assert back.bit_generator.state == value.bit_generator.state
        else:
            assert back == value
    assert value_to_data(object()) is None


def test_what_get_attr_users_read_most_travels_as_plain_data_under_the_default():
    envs = ForkVectorEnv([lambda: gym.make("CartPole-v1")] * 2, lineage_log=False)
    try:
        envs.reset(seed=0)
        assert [spec.id for spec in envs.get_attr("spec")] == ["CartPole-v1"] * 2
        assert envs.get_attr("observation_space")[0] == envs.single_observation_space
        rngs = envs.np_random
        assert all(isinstance(rng, np.random.Generator) for rng in rngs)
    finally:
        envs.close()
