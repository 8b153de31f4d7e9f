"""The isolation of a sandbox as the trusted side sees it, from the kernel's files about
the sandbox's process (/proc/<pid>/status, /proc/<pid>/ns/*, /proc/<pid>/mountinfo).

A sandbox's own report is built after env code may have run in it: an env could claim
layers it does not have. What this module reads cannot be changed from inside the
sandbox, so the isolation a vector env reports is this, not the sandbox's word.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gym_fork.system.isolation import IsolationConfig

NAMESPACES = ("mnt", "ipc", "uts", "net", "pid", "user")
CAP_SETFCAP = 31
# Mounts a sandbox writes by design (besides the writable directories it was given).
OWN_MOUNTS = frozenset(("/tmp", "/dev/shm", "/proc", "/dev/pts"))


@dataclass
class Measured:
    """What the kernel says about one process, compared with the caller's own."""

    namespaces: dict[str, bool] = field(default_factory=dict)  # True: not the caller's
    no_new_privs: bool = False
    seccomp_filters: int = 0  # 0: no filter (mode 2 with N filters otherwise)
    capabilities: int = -1  # CapEff as a bit mask, -1 if unreadable
    uid: int = -1  # its effective uid as the host sees it, -1 if unreadable
    bounding: int = -1
    writable_mounts: list[str] | None = None  # None: mountinfo unreadable
    links: dict[str, str] = field(default_factory=dict)  # namespace -> its link
    layers: dict[str, str] = field(default_factory=dict)  # /tmp, /dev/shm -> "major:minor"

    def shares_with(self, other: Measured) -> list[str]:
        """What this process shares with ``other`` that a sandbox must have of its own:
        mount and IPC namespaces, and the file systems of /tmp and /dev/shm (a tree's
        network namespace is empty and shared by design: sandbox_isolation.own_network)."""
        shared = [n for n in ("mnt", "ipc") if self.links.get(n) == other.links.get(n)]
        shared += [p for p, dev in self.layers.items() if other.layers.get(p) == dev]
        return shared

    def capabilities_text(self) -> str:
        if self.capabilities == 0 and self.bounding == 0:
            return "dropped"
        if self.capabilities in (0, 1 << CAP_SETFCAP) and self.bounding in (0, 1 << CAP_SETFCAP):
            return "dropped, but CAP_SETFCAP"
        return f"kept (CapEff {self.capabilities:#x})"

    def seccomp_text(self) -> str:
        if not self.seccomp_filters:
            return "off"
        return f"on ({self.seccomp_filters} filter{'s' * (self.seccomp_filters > 1)}, measured)"


def measure(pid: int, writable: frozenset[str] = frozenset()) -> Measured | None:
    """Read what the kernel says about process ``pid`` (a host pid); None when it is
    gone or unreadable. ``writable``: mount points it may write besides its own."""
    try:
        status = _read(f"/proc/{pid}/status").decode(errors="replace")
        links = {n: os.readlink(f"/proc/{pid}/ns/{n}") for n in NAMESPACES}
        mine = {n: os.readlink(f"/proc/self/ns/{n}") for n in NAMESPACES}
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    result = Measured(namespaces={n: links[n] != mine[n] for n in NAMESPACES}, links=links)
    result.no_new_privs = fields.get("NoNewPrivs", "0").strip() == "1"
    if fields.get("Seccomp", "0").strip() == "2":
        result.seccomp_filters = int(fields.get("Seccomp_filters", "1").strip() or 1)
    uids = fields.get("Uid", "").split()
    if len(uids) > 1 and uids[1].isdigit():
        result.uid = int(uids[1])
    try:
        result.capabilities = int(fields.get("CapEff", "").strip(), 16)
        result.bounding = int(fields.get("CapBnd", "").strip(), 16)
    except ValueError:
        pass
    try:
        mountinfo = _read(f"/proc/{pid}/mountinfo")
    except OSError:
        return result
    result.writable_mounts = _writable_mounts(mountinfo, writable)
    result.layers = _layers(mountinfo)
    return result


@dataclass
class Achieved:
    """The layers one sandbox has (gym_fork/system/isolation.py made them): as it said,
    or where its process could be measured, as the kernel says."""

    namespaces: dict[str, bool]  # mount, ipc, uts, net, pid: True where its own
    private_tmp: bool
    no_new_privs: bool
    details: dict[str, Any]  # capabilities, seccomp, the read-only view, ...
    missing: dict[str, str]  # each layer it lacks, and why


def achieved(
    tree: dict[str, Any],
    own: dict[str, Any],
    missing: dict[str, str],
    measured: Measured | None,
    others: Iterable[tuple[int, Measured | None]],
    config: IsolationConfig,
) -> Achieved:
    """The layers of a sandbox whose reports (``Isolation.report()``: what it said, after
    env code may have run in it) are ``tree`` and ``own``, lacking ``missing``. With
    ``measured`` (its process, as the kernel says) the kernel's word counts instead, and
    what it shares with ``others`` (the processes of its tree, by pid: only iterated
    then) is not its own."""
    missing = dict(missing)
    result = Achieved(
        namespaces={
            "mount": bool(own.get("mount")),
            "ipc": bool(own.get("ipc")),
            "uts": bool(tree.get("uts")),
            "net": bool(tree.get("net")),
            "pid": bool(tree.get("pid")),
        },
        private_tmp=bool(own.get("private_tmp")),
        no_new_privs=bool(own.get("no_new_privs")),
        details={
            "proc": "the tree's own" if tree.get("proc") else "the host's",
            "capabilities": own.get("capabilities", "kept"),
            "seccomp": own.get("seccomp", "off"),
            "read_only_host": bool(own.get("read_only_host")),
            "writable": list(own.get("writable", [])),
            "user_namespace": bool(own.get("user")),
            "uid": own.get("uid", tree.get("uid")),
            # Not visible in /proc: as the sandbox set it up, before any env code.
            "landlock": own.get("landlock", "off"),
        },
        missing=missing,
    )
    if measured is None:
        return result
    if config.namespaces:
        # Its own, or only claimed? Compared with the others (a source could have kept
        # its clone in its namespaces).
        for other_pid, other in others:
            shared = measured.shares_with(other) if other is not None else []
            if not config.private_tmp:
                shared = [s for s in shared if not s.startswith("/")]  # the host's, as asked
            if shared:
                missing.setdefault(
                    "shared_namespaces",
                    f"shares {', '.join(shared)} with process {other_pid} of its tree",
                )
            for name in shared:
                if name in measured.namespaces:
                    measured.namespaces[name] = False
                else:  # /tmp or /dev/shm
                    result.private_tmp = False
    seen = measured.namespaces
    result.namespaces = {
        "mount": seen["mnt"],
        "ipc": seen["ipc"],
        "uts": seen["uts"],
        "net": seen["net"],
        "pid": seen["pid"],
    }
    result.no_new_privs = measured.no_new_privs
    result.details.update(
        capabilities=measured.capabilities_text(),
        seccomp=measured.seccomp_text(),
        user_namespace=seen["user"],
        uid=measured.uid,
        read_only_host=measured.writable_mounts == [],
        measured_by="controller (/proc/<pid> of the sandbox)",
    )
    if measured.uid == 0:
        missing.setdefault("identity", "env code runs as the host's root (measured)")
    if measured.writable_mounts:
        missing.setdefault(
            "read_only_host",
            f"writable mounts of the host: {', '.join(measured.writable_mounts)}",
        )
    return result


def _layers(mountinfo: bytes) -> dict[str, str]:
    """The file system (major:minor) mounted last on /tmp and on /dev/shm."""
    found = {}
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[4] in (b"/tmp", b"/dev/shm"):
            found[parts[4].decode()] = parts[2].decode(errors="replace")
    return found


def _writable_mounts(mountinfo: bytes, writable: frozenset[str]) -> list[str]:
    allowed = OWN_MOUNTS | writable
    found = []
    for line in mountinfo.splitlines():
        parts = line.split()
        if len(parts) < 6:
            continue
        point = parts[4].decode(errors="replace")
        if b"rw" in parts[5].split(b",") and point not in allowed:
            found.append(point)
    return sorted(found)


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            if sum(map(len, chunks)) > 1 << 22:  # a sandbox's mount table is small
                break
        return b"".join(chunks)
    finally:
        os.close(fd)
