"""The layers below ForkVectorEnv default to the safe side (issue 30, item 8): built
directly, without the facade's trusted=False, a HostConfig, a WorkerPool, the warm
parent's prepare-failure path and a worker's error records load nothing a sandbox sent
(a pickle runs code), and say so in what they raise.

Before, each of them defaulted to trusted=True: only the facade set it right, and any
other caller (a new host, a tool, a test) unpickled what a sandbox sent."""

from __future__ import annotations

import os

import cloudpickle
import pytest

from gym_fork.errors import SandboxStartError, SubEnvError
from gym_fork.hosts.base import HostConfig
from gym_fork.hosts.preparing import prepare_failure, raise_prepare_failure
from gym_fork.vector.faults import errors_exception, worker_exception
from gym_fork.vector.pool import WorkerPool


class HostileError(ValueError):
    """Loading it makes the directory ``path`` in whoever loads it (a marker)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"hostile, marker {path}")
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def test_a_host_config_and_a_worker_pool_built_directly_are_untrusted():
    assert HostConfig(kind="process", env_fns=()).trusted is False
    assert WorkerPool(host=None).trusted is False  # type: ignore[arg-type]


def _prepare_reply(marker: str) -> dict:
    """A warm parent's reply after its env_fns' preparation raised HostileError."""
    try:
        raise HostileError(marker)
    except HostileError as exc:
        return prepare_failure(exc)


def test_a_prepare_failure_is_not_unpickled_unless_trusted(tmp_path):
    marker = tmp_path / "unpickled"
    reply = _prepare_reply(str(marker))
    with pytest.raises(SandboxStartError) as raised:
        raise_prepare_failure(reply, "the warm parent")
    assert not marker.exists(), "the warm parent's pickled exception was loaded"
    assert "HostileError: hostile, marker" in str(raised.value)
    with pytest.raises(SandboxStartError):  # trusted=True, as asked, loads it
        raise_prepare_failure(reply, "the warm parent", trusted=True)
    assert marker.exists()


def test_a_workers_error_record_is_not_unpickled_unless_trusted(tmp_path):
    marker = tmp_path / "unpickled"
    record = {
        "index": 0,
        "type": "HostileError",
        "bases": ["ValueError"],
        "message": "hostile",
        "traceback": "tb",
        "pickled": cloudpickle.dumps(HostileError(str(marker))),
    }
    assert isinstance(worker_exception(record), SubEnvError)
    assert isinstance(errors_exception([record]), SubEnvError)
    assert not marker.exists(), "the worker's pickled exception was loaded"
    worker_exception(record, trusted=True)
    assert marker.exists()
