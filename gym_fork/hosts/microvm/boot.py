"""The microVM boot templates: a freshly booted guest frozen while its agent waits for
its env_fns, made once per controller process and VM shape (:func:`boot_template`).

A boot template is a branch point (:mod:`.snapshot`): every microVM host of the process
with that shape copies its RAM and resumes it as its warm parent, so only the first one
boots a guest (:func:`boot_guest`, 13-33 s under TCG). A boot is kept on disk too
(:mod:`.template_cache`), so a new process loads it instead of booting.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

from gym_fork import progress
from gym_fork.errors import RingTimeout, SandboxStartError
from gym_fork.hosts.microvm import template_cache
from gym_fork.hosts.microvm.machine import Machine, MachineConfig, new_memfd, start_watched
from gym_fork.hosts.microvm.snapshot import BranchPoint
from gym_fork.hosts.output import OutputCollector
from gym_fork.text_safety import escape_controls
from gym_fork.transport.channel import Channel

_LOCK = threading.Lock()
_TEMPLATES: dict[MachineConfig, BranchPoint] = {}


def boot_template(config: MachineConfig, timeout: float) -> tuple[BranchPoint, float]:
    """The frozen, freshly booted guest for ``config`` (kernel up, agent imported and
    waiting for its env_fns), loaded from disk or booted once per controller process;
    and the seconds this call spent making it (0 when it was there already). Its memfds
    are named ``gym_fork-vm-boot-*`` and live until :func:`release_boot_templates`."""
    with _LOCK:
        point = _TEMPLATES.get(config)
        if point is not None and point.ram_fd >= 0:
            return point, 0.0
        started = time.perf_counter()
        point = template_cache.load(config)
        if point is None:
            with progress.task(f"booting the microVM guest ({config.accel}, once)", delay=0.5):
                point = boot_guest(config, timeout)
            template_cache.store(config, point)
        _TEMPLATES[config] = point
        return point, time.perf_counter() - started


def release_boot_templates(*, disk: bool = False) -> None:
    """Free the boot templates of this process (the next microVM host loads or boots
    again); with ``disk``, also remove every boot template kept on disk."""
    with _LOCK:
        for point in _TEMPLATES.values():
            point.close()
        _TEMPLATES.clear()
        if disk:
            template_cache.clear()


def start_slabless(
    config: MachineConfig,
    output: OutputCollector,
    key: str,
    ram_fd: int,
    channel: Channel,
    *,
    incoming: bool,
    die_with_controller: bool = True,
) -> Machine:
    """A VM with shared RAM and no vector env (a boot or a warm parent): its slab device
    is a throw-away memfd; its output is watched under ``key``."""
    slab_fd = new_memfd("gym_fork-vm-no-slab", config.slab_bytes)
    try:
        return start_watched(
            config,
            output,
            ram_fd=ram_fd,
            shared_ram=True,
            channel_fd=channel.region.fd,
            slab_fd=slab_fd,
            incoming=incoming,
            name=f"gym_fork-{key}",
            die_with_controller=die_with_controller,
            key=key,
        )
    finally:
        os.close(slab_fd)


def first_message(channel: Channel, machine: Machine, timeout: float) -> dict | None:
    """The first message ``machine``'s guest sends on ``channel``; ``None`` when its
    QEMU exits or ``timeout`` seconds pass first (``machine.alive()`` tells which)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return channel.recv(0.2)
        except RingTimeout:
            if not machine.alive() or time.monotonic() > deadline:
                return None


def boot_guest(config: MachineConfig, timeout: float) -> BranchPoint:
    """Boot a guest under ``config`` until its agent says it is booted, and freeze it
    there: a new branch point (a full boot, whatever is cached)."""
    with contextlib.ExitStack() as undone_if_failing:
        ram_fd = new_memfd("gym_fork-vm-boot-ram", config.memory_mb << 20)
        undone_if_failing.callback(os.close, ram_fd)
        state_fd = os.memfd_create("gym_fork-vm-boot-state", os.MFD_CLOEXEC)
        undone_if_failing.callback(os.close, state_fd)
        channel = Channel.create("booting VM", config.ring_capacity, poll=True)
        undone_if_failing.callback(channel.close)
        output = OutputCollector(echo=False)
        undone_if_failing.pop_all()
    point = BranchPoint(ram_fd, state_fd, b"")
    machine = None
    try:
        machine = start_slabless(config, output, "boot", ram_fd, channel, incoming=False)
        message = first_message(channel, machine, timeout)
        if message is None:
            why = "exited" if not machine.alive() else f"took over {timeout} s"
            raise SandboxStartError(
                f"the guest ({config.accel}) {why} before its agent started; its output:\n"
                + escape_controls(output.tail("boot", "stderr")[-4000:])
                + escape_controls(output.tail("boot", "stdout")[-2000:])
                + machine.log()
            )
        if message.get("op") != "booted":
            raise SandboxStartError(f"the guest agent said {message!r:.200} instead of booted")
        machine.save(state_fd)
        point.positions = channel.positions()
    except BaseException:
        point.close()
        raise
    finally:
        if machine is not None:
            machine.kill()
        channel.close()
        output.close()
    return point
