"""A throw-away multi-node Ray cluster on one machine, bound to the loopback interface.

Used by the tests, the example and the benchmark. Every Ray process it starts listens on
and dials 127.0.0.1 only, keeps its session files under a private temporary directory
(removed at exit) and is gone when the context manager exits.

Three settings are needed for that (Ray 2.9 to 2.60):

- ``node_ip_address="127.0.0.1"`` for every node (the GCS, raylets, object managers and
  workers then bind to it);
- ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` in the driver *before* ``import ray``:
  ``ray.init(address="127.0.0.1:PORT")`` otherwise rewrites a loopback address into the
  machine's own address (``resolve_ip_for_localhost``) and dials the GCS there;
- ``ray.init(..., _node_ip_address="127.0.0.1")`` for the driver's own address.

``RAY_TMPDIR`` moves ``/tmp/ray`` (sessions, sockets, ``ray_current_cluster``) into the
private directory, and ``RAY_USAGE_STATS_ENABLED=0`` keeps Ray from reporting usage.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

LOOPBACK = "127.0.0.1"
ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}
# Node death is noticed by GCS health checks (default: 5 misses of a 3 s probe); a test
# cluster detects it within about a second instead.
FAST_FAILURE_DETECTION = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


def set_loopback_env() -> None:
    """Set the environment a loopback driver needs; call it before ``import ray``."""
    for key, value in ENV.items():
        os.environ.setdefault(key, value)


@dataclass
class LoopbackCluster:
    """A running local cluster: ``cluster`` is Ray's ``cluster_utils.Cluster``."""

    cluster: Any
    temp_dir: str
    head_node_id: str
    pids: set[int] = field(default_factory=set)

    @property
    def address(self) -> str:
        """The GCS address (``127.0.0.1:PORT``)."""
        return self.cluster.address

    def worker_nodes(self) -> list[Any]:
        """Ray node handles of the non-head nodes (for ``remove_node``)."""
        return list(self.cluster.worker_nodes)

    def add_node(self, num_cpus: int = 1) -> Any:
        """Start one more loopback node; returns its handle (``.node_id``)."""
        node = self.cluster.add_node(
            num_cpus=num_cpus, node_ip_address=LOOPBACK, include_dashboard=False
        )
        self.pids |= session_pids(self.temp_dir)
        return node

    def remove_node(self, node: Any) -> None:
        """Kill every process of one node, as a lost machine would."""
        self.cluster.remove_node(node, allow_graceful=False)

    def listeners(self) -> list[tuple[str, str, int]]:
        """(local address, process name, pid) of every TCP/UDP socket that a process of
        this cluster listens on, from ``ss -tulnp``."""
        return [row for row in _ss("-tulnpH") if row[2] in self.live_pids()]

    def connections(self) -> list[tuple[str, str, int]]:
        """(peer address, process name, pid) of the cluster's established TCP connections."""
        return [row for row in _ss("-tnpH", peer=True) if row[2] in self.live_pids()]

    def live_pids(self) -> set[int]:
        """Pids of the cluster's processes that are still running."""
        self.pids |= session_pids(self.temp_dir)
        return {p for p in self.pids if _alive(p)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.update(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def session_pids(temp_dir: str) -> set[int]:
    """Processes that belong to a cluster: those naming its temp dir on their command line
    (GCS, raylets, agents, workers before they rename themselves) and their descendants."""
    roots = set()
    needle = temp_dir.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    roots.add(int(entry))
        except OSError:
            continue
    found, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(_children(pid))
    return found


def _ss(flags: str, peer: bool = False) -> list[tuple[str, str, int]]:
    out = subprocess.run(["ss", flags], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if "users:" not in line or len(parts) < 5:
            continue
        # -tulnpH rows start with the netid column, -tnpH rows with the state column
        local, remote = (parts[4], parts[5]) if flags.startswith("-tul") else (parts[3], parts[4])
        users = line[line.index("users:") :]
        for chunk in users.split("(")[2:]:
            name = chunk.split('"')[1] if '"' in chunk else "?"
            if "pid=" in chunk:
                pid = int(chunk.split("pid=")[1].split(",")[0].rstrip(")"))
                rows.append((remote if peer else local, name, pid))
    return rows


def is_loopback(address: str) -> bool:
    """Whether an ``ss`` address (``127.0.0.1:80``, ``[::ffff:127.0.0.1]:80``,
    ``[::1]:80``) is on the loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    host = host.split("%")[0]
    if host.startswith("::ffff:"):
        host = host[len("::ffff:") :]
    return host.startswith("127.") or host == "::1" or host == "localhost"


@contextlib.contextmanager
def loopback_cluster(
    num_nodes: int = 3,
    num_cpus: int = 1,
    *,
    connect: bool = True,
    system_config: dict[str, Any] | None = None,
) -> Iterator[LoopbackCluster]:
    """Start ``num_nodes`` Ray nodes (head included) of ``num_cpus`` CPUs each on this
    machine, bound to 127.0.0.1, connect this process to them (``connect=True``), and
    tear everything down at exit: the driver, every node, the session directory.

    Raises RuntimeError at exit if a process of the cluster outlived the teardown.
    """
    set_loopback_env()
    if "ray" in sys.modules and os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER") != "0":
        raise RuntimeError("set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 before importing ray")
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        raise RuntimeError("loopback_cluster() needs a process not yet connected to Ray")
    # Short: Ray puts unix sockets under it (108-byte path limit).
    temp_dir = tempfile.mkdtemp(prefix="gfray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in ("RAY_TMPDIR",)}
    os.environ["RAY_TMPDIR"] = temp_dir
    cluster = None
    handle = None
    try:
        config = dict(FAST_FAILURE_DETECTION)
        config.update(system_config or {})
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": num_cpus,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "_system_config": config,
            },
        )
        for _ in range(num_nodes - 1):
            cluster.add_node(num_cpus=num_cpus, node_ip_address=LOOPBACK, include_dashboard=False)
        head_node_id = cluster.head_node.node_id
        handle = LoopbackCluster(cluster, temp_dir, head_node_id)
        if connect:
            ray.init(address=cluster.address, _node_ip_address=LOOPBACK, log_to_driver=False)
        handle.pids |= session_pids(temp_dir)
        yield handle
    finally:
        pids = handle.live_pids() if handle is not None else session_pids(temp_dir)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        deadline = time.monotonic() + 10
        left = {p for p in pids | session_pids(temp_dir) if _alive(p)}
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = {p for p in left if _alive(p)}
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if left:
            raise RuntimeError(f"Ray processes outlived the loopback cluster: {sorted(left)}")
