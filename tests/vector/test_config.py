"""VectorConfig.from_arguments without sandboxes: every bad argument is named, the
defaults are ForkVectorEnv's, the derived fields, ForkVectorEnv's options as read-only
attributes and the API reference's parameter table (milliseconds)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.vector import AutoresetMode

from gym_fork.hosts.base import PrepareRecipe
from gym_fork.vector.config import VectorConfig, check_env_fns, check_parent_count
from gym_fork.vector.fork_vector_env import ForkVectorEnv

# The constructor's arguments that are not VectorConfig fields (the lineage's, and
# from_parent's PrepareRecipe).
_NOT_OPTIONS = frozenset({"self", "branch_id", "lineage_log", "_prepare"})


def cartpole():
    return gym.make("CartPole-v1")


FNS = [cartpole] * 4


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"worker": print}, ValueError, "custom pipe-based `worker`"),
        ({"max_concurrency": 1.5}, ValueError, "`max_concurrency` must be an integer"),
        ({"max_concurrency": 0}, ValueError, "`max_concurrency` must be a positive"),
        ({"envs_per_worker": 0}, ValueError, "`envs_per_worker` must be 'auto' or an int"),
        ({"envs_per_worker": True}, ValueError, "`envs_per_worker`"),
        ({"envs_per_worker": "two"}, ValueError, "`envs_per_worker`"),
        ({"ring_bytes": 5000}, ValueError, "`ring_bytes` must be a power of two"),
        ({"ring_bytes": 2048}, ValueError, "`ring_bytes`"),
        ({"reset_mode": "fresh"}, ValueError, "`reset_mode` must be 'in_place' or 'clone'"),
        (
            {"reset_mode": "clone", "envs_per_worker": 2},
            ValueError,
            "reset_mode='clone' needs one sandbox per sub-env",
        ),
        ({"gpu_fork_policy": "ignore"}, ValueError, "gpu_fork_policy must be 'refuse' or"),
        ({"host": "docker"}, ValueError, "`host` must be one of"),
        ({"timeout": 0}, ValueError, "`timeout` must be a positive number"),
        ({"timeout": True}, ValueError, "`timeout`"),
        ({"timeout": "1"}, ValueError, "`timeout`"),
        ({"writable_paths": "/tmp"}, TypeError, "`writable_paths` must be a list"),
        ({"writable_paths": [3]}, TypeError, "`writable_paths` entries must be paths"),
        ({"writable_paths": ["/no/such/dir"]}, ValueError, "is not an existing directory"),
        ({"writable_paths": ["/"]}, ValueError, "cannot hold '/'"),
        ({"tmpfs_bytes": 1024}, ValueError, "`tmpfs_bytes` must be an int of at least 1 MiB"),
        ({"tmpfs_bytes": True}, ValueError, "`tmpfs_bytes`"),
        ({"autoreset_mode": "sometimes"}, ValueError, "sometimes"),
        ({"no_such_option": 1}, TypeError, "unexpected keyword argument(s): no_such_option"),
    ],
)
def test_every_bad_argument_is_named(kwargs, error, text):
    with pytest.raises(error) as raised:
        VectorConfig.from_arguments(FNS, **kwargs)
    assert text in str(raised.value)


@pytest.mark.parametrize(
    ("env_fns", "error", "text"),
    [
        ([], ValueError, "needs at least one env_fn"),
        ("CartPole-v1", TypeError, "env_fns must be a list"),
        ([cartpole, 3], TypeError, "env_fns[1] is a int, not a function"),
    ],
)
def test_bad_env_fns_are_named(env_fns, error, text):
    with pytest.raises(error) as raised:
        VectorConfig.from_arguments(env_fns)
    assert text in str(raised.value)


def test_an_env_already_built_is_named():
    env = cartpole()
    try:
        with pytest.raises(TypeError, match=r"\(an env already built\)"):
            check_env_fns([env])
    finally:
        env.close()


def test_the_defaults_are_the_constructors(monkeypatch):
    monkeypatch.delenv("GYM_FORK_HOST", raising=False)
    monkeypatch.delenv("GYM_FORK_TRUSTED", raising=False)
    config = VectorConfig.from_arguments(FNS, envs_per_worker=1)
    assert config.num_envs == 4 and config.env_fns == tuple(FNS)
    assert config.host == "process" and config.trusted is False
    assert config.autoreset_mode is AutoresetMode.NEXT_STEP
    assert config.shared_memory and config.copy and config.reset_mode == "in_place"
    assert config.origins == (0, 1, 2, 3)
    assert config.worker_groups() == [[0], [1], [2], [3]]


def test_environment_defaults(monkeypatch):
    monkeypatch.setenv("GYM_FORK_HOST", "inline")
    monkeypatch.setenv("GYM_FORK_TRUSTED", "yes")
    config = VectorConfig.from_arguments(FNS)
    assert config.host == "inline" and config.trusted is True
    monkeypatch.setenv("GYM_FORK_TRUSTED", "maybe")
    with pytest.raises(ValueError, match="GYM_FORK_TRUSTED must be"):
        VectorConfig.from_arguments(FNS)


def test_grouping_and_branches():
    config = VectorConfig.from_arguments(
        [cartpole] * 5, envs_per_worker=2, autoreset_mode="SameStep"
    )
    assert config.autoreset_mode is AutoresetMode.SAME_STEP
    assert config.worker_groups() == [[0, 1], [2, 3], [4]]
    branch = config.for_branch([4, 4, 1])
    assert branch.num_envs == 3 and branch.envs_per_worker == 1
    assert branch.origins == (4, 4, 1)


def test_a_recipe_builds_every_sub_env_from_the_first_env_fn():
    config = VectorConfig.from_arguments(FNS, prepare=PrepareRecipe(None, None, 3))
    assert config.origins == (0, 0, 0, 0)
    assert config.host_config().env_fns == (cartpole,)


def test_the_startup_allowance_is_added_to_the_timeout():
    assert VectorConfig.from_arguments(FNS, timeout=2).host_config().start_timeout == 12.0
    assert VectorConfig.from_arguments(FNS).host_config().start_timeout is None


def test_from_parent_count():
    kwargs: dict = {}
    assert check_parent_count(3, kwargs) == 3 and kwargs == {"envs_per_worker": 1}
    for bad, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="num_envs"):
            check_parent_count(bad, {})
    with pytest.raises(ValueError, match="envs_per_worker=1"):
        check_parent_count(2, {"envs_per_worker": 2})


def _constructor_parameters() -> dict[str, inspect.Parameter]:
    parameters = dict(inspect.signature(ForkVectorEnv.__init__).parameters)
    del parameters["self"]
    return parameters


def test_the_constructor_forwards_every_option_with_the_configs_defaults(monkeypatch):
    monkeypatch.delenv("GYM_FORK_HOST", raising=False)
    monkeypatch.delenv("GYM_FORK_TRUSTED", raising=False)
    options = {
        name: parameter.default
        for name, parameter in _constructor_parameters().items()
        if name not in _NOT_OPTIONS and parameter.default is not inspect.Parameter.empty
    }
    assert {"batch_size", "timeout", "writable_paths", "vm_slab_mb"} <= set(options)
    assert VectorConfig.from_arguments(FNS, **options) == VectorConfig.from_arguments(FNS)


def test_the_constructor_hands_each_argument_to_the_config_under_its_own_name(monkeypatch):
    seen = {}

    class Stop(Exception):
        pass

    def capture(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(VectorConfig, "from_arguments", capture)
    options = [n for n in _constructor_parameters() if n not in _NOT_OPTIONS]
    marks = {name: object() for name in options}  # a value of its own for each
    with pytest.raises(Stop):
        ForkVectorEnv(**marks)
    assert {name: seen[name] for name in options} == marks
    assert set(seen) == set(options) | {"prepare"}


def test_every_option_is_a_read_only_attribute_over_the_config():
    envs = ForkVectorEnv.__new__(ForkVectorEnv)  # no sandboxes: only the attributes
    envs.config = VectorConfig.from_arguments(FNS, timeout=3.0, batch_size=2, host="inline")
    assert (envs.timeout, envs.batch_size, envs.num_envs, envs.worker) == (3.0, 2, 4, None)
    assert envs.env_fns == tuple(FNS) and envs.autoreset_mode is AutoresetMode.NEXT_STEP
    for name in ("timeout", "copy", "num_envs", "reset_mode"):
        with pytest.raises(AttributeError):
            setattr(envs, name, None)


def test_the_api_references_parameter_table_names_every_constructor_argument():
    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "api.md").read_text()
    section = page.split("### ForkVectorEnv parameters", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE)
    public = [name for name in _constructor_parameters() if not name.startswith("_")]
    assert rows == public  # each once, in the signature's order
