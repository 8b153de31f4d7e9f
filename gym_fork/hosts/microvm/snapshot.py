"""The microVM host's branch points: a frozen VM as a RAM memfd, a saved device state
and its channel's counters, and how one is made from a running VM (:func:`freeze_copy`)
and resumed in a new QEMU (:meth:`BranchPoint.resume`).

A branch point's RAM is mapped ``share=off`` by every clone restored from it, so the
clones share its pages copy-on-write; the boot templates (:mod:`.boot`, kept on disk by
:mod:`.template_cache`) and the warm parent are branch points too.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field

from gym_fork.hosts.microvm.machine import Machine, MachineConfig, new_memfd
from gym_fork.system.linux import data_extents
from gym_fork.transport.channel import Channel


@dataclass
class BranchPoint:
    """A frozen VM: its RAM memfd, its saved device state, its channel's counters."""

    ram_fd: int
    state_fd: int
    positions: bytes
    created: float = field(default_factory=time.perf_counter)

    def resume(self, machine: Machine) -> None:
        """Load this point's state into ``machine`` (started ``incoming``), run it, and
        ring its doorbell: what it waits for was written before its QEMU existed."""
        reader = os.open(f"/proc/self/fd/{self.state_fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            machine.restore(reader)
        finally:
            os.close(reader)
        machine.ring_bell()

    def close(self) -> None:
        """Close its memfds (clones restored from it keep their own mappings)."""
        for fd in (self.ram_fd, self.state_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.ram_fd = self.state_fd = -1


def copy_data(source: int, target: int) -> None:
    """Copy a memfd's data extents (skipping holes: untouched guest pages stay unallocated)."""
    for start, end in data_extents(source):
        done = start
        while done < end:
            done += os.copy_file_range(source, target, end - done, done, done)


def freeze_copy(
    config: MachineConfig, machine: Machine, channel: Channel, *, die_with_controller: bool
) -> BranchPoint:
    """A branch point holding the running ``machine``'s current RAM and device state
    (and ``channel``'s counters), copied by a migration into a paused helper QEMU; the
    source resumes unchanged afterwards."""
    ram_fd = new_memfd("gym_fork-vm-branch-ram", config.memory_mb << 20)
    state_fd = os.memfd_create("gym_fork-vm-branch-state", os.MFD_CLOEXEC)
    dummy_channel = new_memfd("gym_fork-vm-helper", config.channel_bytes)
    dummy_slab = new_memfd("gym_fork-vm-helper", config.slab_bytes)
    devnull = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    helper = None
    sending, receiving = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    point = BranchPoint(ram_fd, state_fd, b"")
    try:
        helper = Machine(
            config,
            ram_fd=ram_fd,
            shared_ram=True,
            channel_fd=dummy_channel,
            slab_fd=dummy_slab,
            out_fd=devnull,
            err_fd=devnull,
            incoming=True,
            paused=True,
            name="gym_fork-branch-point",
            die_with_controller=die_with_controller,
        )
        machine.stop()
        point.positions = channel.positions()
        # All of the source's memory moves (its RAM is private, so x-ignore-shared
        # would skip nothing; and on the helper it would refuse RAM for a shared
        # block). The helper's channel and slab are throw-away copies.
        helper._ignore_shared(False)
        helper.command("getfd", {"fdname": "gf-in-ram"}, fds=(receiving.fileno(),))
        helper.command("migrate-incoming", {"uri": "fd:gf-in-ram"})
        machine._ignore_shared(False)
        # QEMU throttles migrations to 128 MiB/s by default; this one is a local copy.
        machine.command("migrate-set-parameters", {"max-bandwidth": 64 << 30})
        machine.command("getfd", {"fdname": "gf-out-ram"}, fds=(sending.fileno(),))
        machine.command("migrate", {"uri": "fd:gf-out-ram"})
        machine._wait_migration("copying the RAM of a running VM")
        helper._wait_migration("receiving the RAM of a running VM")
        helper.save(state_fd)
    except BaseException:
        point.close()
        raise
    finally:
        sending.close()
        receiving.close()
        for fd in (dummy_channel, dummy_slab, devnull):
            os.close(fd)
        if helper is not None:
            helper.kill()
        if machine.alive():
            with contextlib.suppress(Exception):
                machine.cont()
    return point
