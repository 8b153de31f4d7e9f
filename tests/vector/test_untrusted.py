"""An untrusted sandbox (trusted=False; the microVM default) cannot run code in the
controller: nothing it sends is unpickled (hardening issue)."""

from __future__ import annotations

import numpy as np
import pytest
from gymnasium import Space, spaces

from gym_fork import ForkVectorEnv, PickleRefused, SandboxStartError, SubEnvError
from tests.helpers import SpaceEnv


class _Payload:
    """Unpickling this runs ``open(path, "w")`` in whoever loads it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class HostileError(ValueError):
    """An exception whose pickle carries the payload."""

    def __init__(self, path: str) -> None:
        super().__init__("hostile")
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


class HostileEnv(SpaceEnv):
    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2), max_len=50, trunc_prob=0)

    def raise_hostile(self, path):
        raise HostileError(path)

    def payload(self, path):
        return _Payload(path)

    def odd_info(self):
        return {1, 2, 3}  # a set: msgpack cannot carry it, the codec pickles it


@pytest.mark.parametrize("trusted", [False, True])
def test_a_hostile_exception_runs_code_only_in_a_controller_that_trusts(tmp_path, trusted):
    marker = tmp_path / "pwned"
    envs = ForkVectorEnv([HostileEnv], trusted=trusted, lineage_log=False)
    try:
        envs.reset(seed=0)
        with pytest.raises(Exception) as info:
            envs.call("raise_hostile", str(marker))
        if trusted:  # the AsyncVectorEnv behaviour: the pickle is loaded
            assert marker.exists()
        else:
            assert not marker.exists()
            assert isinstance(info.value, SubEnvError)
            assert info.value.type_name == "HostileError"
            assert "raise_hostile" in info.value.remote_traceback
    finally:
        envs.close()


def test_a_pickled_call_result_is_refused_and_the_vector_env_stays_usable(tmp_path):
    marker = tmp_path / "pwned"
    envs = ForkVectorEnv([HostileEnv, HostileEnv], trusted=False, envs_per_worker=1)
    try:
        envs.reset(seed=0)
        with pytest.raises(PickleRefused, match="refused"):
            envs.call("payload", str(marker))
        with pytest.raises(PickleRefused):
            envs.call("odd_info")
        assert not marker.exists()
        assert envs.step(np.array([0, 1]))[0].shape == (2, 2)
        assert envs.call("add", 1) == (3, 3)  # t=1 after one step, + 1 + 1
        with pytest.raises(ValueError, match="use `step` directly"):  # a builtin type stays
            envs.call("step", 0)
    finally:
        envs.close()


class GridSpace(Space):
    def __init__(self):
        super().__init__((2,), np.float32)
        self.check = lambda x: True  # not plain data: the space cannot travel by reference

    def sample(self, mask=None, probability=None):
        return np.zeros(2, np.float32)

    def contains(self, x):
        return True


class GridEnv(SpaceEnv):
    def __init__(self):
        super().__init__(spaces.Box(-1, 1, (2,)), spaces.Discrete(2))
        self.observation_space = GridSpace()


def test_an_unregistered_space_from_an_untrusted_sandbox_is_refused():
    with pytest.raises(SandboxStartError, match="pickled space"):
        ForkVectorEnv([GridEnv], trusted=False, shared_memory=False)
