"""Memory the limits did not see (issue 18, item 5): tmpfs layers are sized, and a sandbox
that fills its /tmp is what the kernel's OOM killer picks, never the controller."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

MEMORY_V1 = "/sys/fs/cgroup/memory"

FILL_ENV = """
import os
import gymnasium as gym
import numpy as np

class FillTmp(gym.Env):
    observation_space = gym.spaces.Box(0, 1, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        chunk = os.urandom(1 << 20) * 16  # 16 MiB that no page sharing can fold
        with open("/tmp/gym_fork_fill", "wb") as f:
            for _ in range(4096):  # up to 64 GiB: the size of the layer decides
                f.write(chunk)
        return np.zeros(1, np.float32), 0.0, False, False, {}
"""


def _run(
    script: str, cgroup: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess:
    code = textwrap.dedent(FILL_ENV) + textwrap.dedent(script)
    if cgroup is None:
        command = [sys.executable, "-c", code]
    else:  # the controller and everything it starts live in the small cgroup
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$0" -c "$1"']
        command += [sys.executable, code]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # 1.1 s here
def test_a_full_tmp_is_a_clear_error_at_the_layer_size():
    out = _run("""
        from gym_fork import ForkVectorEnv
        envs = ForkVectorEnv([FillTmp], tmpfs_bytes=64 << 20, lineage_log=False)
        envs.reset(seed=0)
        try:
            envs.step(np.array([0]))
        except OSError as exc:
            print("ERROR", exc.errno, type(exc).__name__)
        envs.reset(seed=0)  # still usable
        print("USABLE", envs.step.__name__)
        envs.close()
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR 28" in out.stdout or "No space left on device" in out.stdout + out.stderr
    assert "USABLE" in out.stdout


@pytest.mark.skipif(
    not os.access(f"{MEMORY_V1}/cgroup.procs", os.W_OK),
    reason="needs a writable cgroup v1 memory controller to confine the controller",
)
@pytest.mark.slow  # 1.4 s here
def test_filling_tmp_without_limits_kills_the_sandbox_not_the_controller():
    group = f"{MEMORY_V1}/gym_fork_test_{uuid.uuid4().hex[:8]}"
    os.mkdir(group)
    try:
        with open(f"{group}/memory.limit_in_bytes", "w") as f:
            f.write(str(640 << 20))  # less than the default 1 GiB layer
        with open(f"{group}/memory.swappiness", "w") as f:
            f.write("0")
        out = _run(
            """
            from gym_fork import ForkVectorEnv
            from gym_fork.errors import SubEnvCrashed
            ballast = np.ones(24 << 17)  # the controller holds 24 MiB of its own
            envs = ForkVectorEnv([FillTmp], lineage_log=False)
            envs.reset(seed=0)
            try:
                envs.step(np.array([0]))
                print("NO ERROR")
            except SubEnvCrashed as exc:
                print("SANDBOX KILLED", exc.exitcode)
            except OSError as exc:
                print("SANDBOX ERROR", exc.errno)
            envs.reset(seed=0)
            print("CONTROLLER ALIVE", float(ballast.sum()))
            envs.close()
            """,
            cgroup=group,
        )
        assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
        assert "CONTROLLER ALIVE" in out.stdout, out.stdout
        assert "SANDBOX KILLED -9" in out.stdout, out.stdout
    finally:
        for _ in range(50):
            try:
                os.rmdir(group)
                break
            except OSError:
                import time

                time.sleep(0.1)
