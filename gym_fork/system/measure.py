"""The isolation of a sandbox as the trusted side sees it, from the kernel's files about
the sandbox's process (/proc/<pid>/status, /proc/<pid>/ns/*, /proc/<pid>/mountinfo).

A sandbox's own report is built after env code may have run in it: an env could claim
layers it does not have. What this module reads cannot be changed from inside the
sandbox, so the isolation a vector env reports is this, not the sandbox's word.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

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
    bounding: int = -1
    writable_mounts: list[str] | None = None  # None: mountinfo unreadable
    links: dict[str, str] = field(default_factory=dict)  # namespace -> its link
    layers: dict[str, str] = field(default_factory=dict)  # /tmp, /dev/shm -> "major:minor"

    def shares_with(self, other: Measured) -> list[str]:
        """What this process shares with ``other`` that a sandbox must have of its own:
        mount and IPC namespaces, and the file systems of /tmp and /dev/shm (a tree's
        network namespace is empty and shared by design: isolation._own_network)."""
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
