"""The microVM boot template on disk, so that a new controller process skips the boot.

A boot template (a freshly booted guest frozen while its agent waits for env_fns: a RAM
memfd, a saved device state and the channel's counters) costs a full guest boot to make
(13-33 s under TCG). :func:`store` writes it to one file under the cache dir and
:func:`load` reads it back into memfds in a fraction of a second. The file is named by a
key over everything that a restore depends on: the image (digest, and the size and mtime
of its root, initramfs and kernel: the guest's page cache holds blocks of them), the VM
shape (accelerator, RAM, channel and slab sizes, ring capacity, doorbell, kernel command
line, extra QEMU arguments) and the QEMU binary (path, size, mtime), and for KVM the host
CPU.

File layout: ``MAGIC``, the header's length (8 bytes, little endian), a JSON header (key,
sizes, offsets, SHA-256 of the state, CRC-32 of the RAM data, the RAM's data extents, the
channel positions), then the state and the RAM's data extents packed one after another,
each section page aligned. Holes of the RAM memfd are not stored (untouched guest pages
stay unallocated), as :func:`gym_fork.hosts.microvm.snapshot.copy_data` does in memory.

A file is written under a temporary name and renamed into place, so a reader sees a
complete file or none. :func:`load` checks the magic, the key, the file size, both
checksums and the RAM size, and returns ``None`` with a log line for anything else: the
caller boots and writes a new entry. Where the entries live (``GYM_FORK_VM_BOOT_CACHE``)
is :mod:`.template_dir`.
``python -m gym_fork.hosts.microvm.template_cache clear`` removes every entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

from gym_fork.hosts.microvm.machine import TCG_CACHE_MB, MachineConfig, new_memfd, qemu_binary
from gym_fork.hosts.microvm.snapshot import BranchPoint
from gym_fork.hosts.microvm.template_dir import SUFFIX, cache_dir, clear, enabled
from gym_fork.system.linux import data_extents

log = logging.getLogger("gym_fork.microvm")

FORMAT = 1  # bump when the file layout or what goes into the key changes
MAGIC = b"GFBOOTT\x01"
PAGE = 4096
CHUNK = 8 << 20
KEEP = 4  # entries kept after a write (one per image and VM shape; each is ~100-200 MB)


def _file_id(path: os.PathLike | str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [str(path), None]
    return [str(path), st.st_size, st.st_mtime_ns]


def _host_cpu() -> str:
    """The host CPU's model and flags (``-cpu host`` under KVM exposes them to the guest)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read().split("\n\n")[0]
    except OSError:
        return "unknown"
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:16]


def key_fields(config: MachineConfig) -> dict:
    """Everything a restore of a boot template made under ``config`` depends on."""
    image = config.image
    return {
        "format": FORMAT,
        "image": image.digest,
        "root": _file_id(image.root),
        "initramfs": _file_id(image.initramfs),
        "kernel": _file_id(image.kernel.vmlinuz),
        "python": image.python,
        "accel": config.accel,
        "cpu": _host_cpu() if config.accel == "kvm" else "max",
        "tcg_cache_mb": TCG_CACHE_MB,
        "memory_mb": config.memory_mb,
        "channel_bytes": config.channel_bytes,
        "slab_bytes": config.slab_bytes,
        "ring_capacity": config.ring_capacity,
        "doorbell": config.doorbell,
        "cmdline": config.kernel_cmdline(),
        "extra_args": list(config.extra_args),
        "qemu": _file_id(qemu_binary() or "none"),
    }


def entry_key(config: MachineConfig) -> str:
    """The file name stem of ``config``'s entry: a hash of :func:`key_fields`."""
    blob = json.dumps(key_fields(config), sort_keys=True).encode()
    return f"{config.image.digest}-{hashlib.sha256(blob).hexdigest()[:24]}"


def entry_path(config: MachineConfig) -> Path:
    """The file that holds (or would hold) ``config``'s boot template."""
    return cache_dir() / (entry_key(config) + SUFFIX)


def _align(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _extents(fd: int) -> list[tuple[int, int]]:
    """The data extents of ``fd`` as (offset, length), holes skipped."""
    return [(start, end - start) for start, end in data_extents(fd)]


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def store(config: MachineConfig, point: BranchPoint) -> Path | None:
    """Write ``point`` (the boot template of ``config``) as the disk entry; returns its
    path, or ``None`` (with a log line) when it could not be written."""
    if not enabled():
        return None
    path = entry_path(config)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    started = time.perf_counter()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        state = os.pread(point.state_fd, os.fstat(point.state_fd).st_size, 0)
        extents = _extents(point.ram_fd)
        header: dict[str, Any] = {
            "key": entry_key(config),
            "fields": key_fields(config),
            "ram_size": os.fstat(point.ram_fd).st_size,
            "state_size": len(state),
            "state_sha256": hashlib.sha256(state).hexdigest(),
            "positions": point.positions.hex(),
            "extents": extents,
            "created": time.time(),
        }
        # Offsets depend on the header's length, which depends on the offsets: give the
        # header room for them (digits only grow the JSON by a bounded amount).
        head_room = _align(len(MAGIC) + 8 + len(json.dumps(header)) + 256)
        state_offset = head_room
        data_offset = _align(state_offset + len(state))
        data_bytes = sum(length for _, length in extents)
        header.update(
            state_offset=state_offset,
            data_offset=data_offset,
            total_size=data_offset + data_bytes,
        )
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            crc = 0
            out = data_offset
            for start, length in extents:
                done = 0
                while done < length:
                    chunk = os.pread(point.ram_fd, min(CHUNK, length - done), start + done)
                    if not chunk:
                        raise OSError(f"short read of the RAM memfd at {start + done}")
                    crc = zlib.crc32(chunk, crc)
                    _pwrite_all(fd, chunk, out)
                    out += len(chunk)
                    done += len(chunk)
            header["ram_crc32"] = crc
            blob = json.dumps(header).encode()
            if len(MAGIC) + 8 + len(blob) > head_room:
                raise OSError("the header outgrew its room")
            _pwrite_all(fd, MAGIC + struct.pack("<Q", len(blob)) + blob, 0)
            _pwrite_all(fd, state, state_offset)
            os.ftruncate(fd, header["total_size"])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        log.warning("gym_fork: could not write the microVM boot template to %s: %s", path, exc)
        return None
    log.info(
        "gym_fork: wrote the microVM boot template %s (%d MiB of RAM data) in %.2f s",
        path,
        data_bytes >> 20,
        time.perf_counter() - started,
    )
    _prune(path)
    return path


def _prune(keep: Path) -> None:
    """Keep the ``KEEP`` most recently used entries (an open one stays readable)."""
    try:
        entries = sorted(
            cache_dir().glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime, reverse=True
        )
    except OSError:
        return
    for old in [p for p in entries if p != keep][KEEP - 1 :]:
        with contextlib.suppress(OSError):
            old.unlink()


class _Corrupt(Exception):
    """An entry that must not be used; the message says why."""


def load(config: MachineConfig) -> BranchPoint | None:
    """``config``'s boot template from disk as fresh memfds, or ``None`` when there is no
    valid entry (a stale or corrupt one is removed, with a log line saying why)."""
    if not enabled():
        return None
    path = entry_path(config)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("gym_fork: cannot open the microVM boot template %s: %s", path, exc)
        return None
    ram_fd = state_fd = -1
    try:
        header = _read_header(fd, config)
        state = os.pread(fd, header["state_size"], header["state_offset"])
        if hashlib.sha256(state).hexdigest() != header["state_sha256"]:
            raise _Corrupt("the device state's checksum does not match")
        ram_fd = new_memfd("gym_fork-vm-boot-ram", header["ram_size"])
        state_fd = os.memfd_create("gym_fork-vm-boot-state", os.MFD_CLOEXEC)
        _pwrite_all(state_fd, state, 0)
        crc = 0
        source = header["data_offset"]
        for start, length in header["extents"]:
            done = 0
            while done < length:
                chunk = os.pread(fd, min(CHUNK, length - done), source)
                if not chunk:
                    raise _Corrupt("the file ends inside the RAM data")
                crc = zlib.crc32(chunk, crc)
                _pwrite_all(ram_fd, chunk, start + done)
                source += len(chunk)
                done += len(chunk)
        if crc != header["ram_crc32"]:
            raise _Corrupt("the RAM data's checksum does not match")
        point = BranchPoint(ram_fd, state_fd, bytes.fromhex(header["positions"]))
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: kept by _prune
        return point
    except (_Corrupt, OSError, ValueError, KeyError, TypeError) as exc:
        for opened in (ram_fd, state_fd):
            if opened >= 0:
                os.close(opened)
        log.warning(
            "gym_fork: the microVM boot template %s is unusable (%s): removed; booting anew",
            path,
            exc,
        )
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None
    finally:
        os.close(fd)


def _read_header(fd: int, config: MachineConfig) -> dict:
    """The checked header of an open entry (raises :class:`_Corrupt`)."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, len(MAGIC) + 8, 0)
    if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
        raise _Corrupt("bad magic: not a boot template of this format")
    (length,) = struct.unpack("<Q", head[len(MAGIC) :])
    if length > 16 << 20 or len(MAGIC) + 8 + length > size:
        raise _Corrupt("the header is truncated")
    header = json.loads(os.pread(fd, length, len(MAGIC) + 8))
    if header.get("key") != entry_key(config):
        raise _Corrupt("its key is not this image's and VM shape's")
    if header.get("fields") != json.loads(json.dumps(key_fields(config))):
        raise _Corrupt("it was made for another image or VM shape")
    if header["total_size"] != size:
        raise _Corrupt(f"its size is {size} bytes, the header says {header['total_size']}")
    if header["ram_size"] != config.memory_mb << 20:
        raise _Corrupt("its RAM size is not the VM's")
    data = sum(length for _, length in header["extents"])
    if header["data_offset"] + data != size:
        raise _Corrupt("its RAM extents do not add up to the file")
    return header


def _measure(runs: int) -> None:
    """First microVM env (construction + first reset) in new processes: without the disk
    entry (cache cleared: a full boot) and with it (a load)."""
    import subprocess

    code = (
        "import time, gymnasium as gym\n"
        "from gym_fork import ForkVectorEnv\n"
        "t = time.perf_counter()\n"
        "envs = ForkVectorEnv([lambda: gym.make('CartPole-v1')], host='microvm')\n"
        "envs.reset(seed=0)\n"
        "print(round(time.perf_counter() - t, 3))\n"
        "envs.close()\n"
    )
    rows: dict[str, list[float]] = {"without the disk entry": [], "with the disk entry": []}
    for _ in range(runs):
        for name in rows:
            if name.startswith("without"):
                clear()
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the measuring process failed:\n{done.stderr[-3000:]}")
            rows[name].append(float(done.stdout.strip().splitlines()[-1]))
    for name, values in rows.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"first microVM env in a new process, {name}: {shown} s")


def main(argv: list[str] | None = None) -> int:
    """``python -m gym_fork.hosts.microvm.template_cache clear|show|measure [runs]``."""
    args = sys.argv[1:] if argv is None else argv
    action = args[0] if args else "show"
    if action == "clear":
        print(f"removed {clear()} boot template file(s) from {cache_dir()}")
    elif action == "show":
        directory = cache_dir()
        entries = sorted(directory.glob("*" + SUFFIX)) if directory.is_dir() else []
        for path in entries:
            print(f"{path.stat().st_size >> 20:6d} MiB  {path}")
        print(f"{len(entries)} entries in {directory}" + ("" if enabled() else " (disabled)"))
    elif action == "measure":
        _measure(int(args[1]) if len(args) > 1 else 2)
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
