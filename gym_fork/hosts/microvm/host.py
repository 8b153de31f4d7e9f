"""Controller side of the microVM host: one frozen warm parent VM, clones restored from it.

The warm parent is a boot template (:mod:`.boot`: a guest booted once per process from
the image, :mod:`.building.image`) resumed in a new QEMU, whose agent prepares the env_fns
exactly as the process host's warm parent does, then waits. The host
freezes it there: its RAM stays in a memfd (``share=on``: the guest wrote straight into
it) and its device state is saved with ``x-ignore-shared`` (a few hundred KB). Every
sandbox is then a QEMU that maps that memfd ``share=off`` (copy-on-write), loads the
device state and resumes inside the agent's wait, where its own channel tells it what
to become. A live ``fork()`` of a running sandbox first copies the sandbox's private RAM
into a new memfd (a migration into a paused helper QEMU), which becomes the branch
point of the clones; the source resumes unchanged.

What is shared and what is private, per clone:
- shared, read-only: the image file (virtio-blk, ``readonly=on``), the kernel, the
  initramfs; the branch point's RAM until the clone writes a page (then that page is
  the clone's own).
- private: every RAM page the clone writes (its processes, page cache and the tmpfs
  that is its writable disk layer: overlay upper dir, ``/tmp``), its device state, its
  channel region.
- shared with the controller (and sibling sandboxes of one vector env): the batch slab,
  where each sandbox writes only its own rows.

(Over ~450 lines as one job: the Host methods of one microVM warm parent and the clone
restore they share; branch points are snapshot.py's, boot templates boot.py's, QEMU
itself machine.py's, image building building/'s.)
"""

from __future__ import annotations

import os
import pathlib
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gym_fork import knobs
from gym_fork.errors import SandboxStartError
from gym_fork.hosts.base import (
    AskWorker,
    CloneOrder,
    HostConfig,
    IsolationReport,
    SharedByBranches,
    WorkerHandle,
    WorkerSpec,
)
from gym_fork.hosts.microvm.accel import choose_accel
from gym_fork.hosts.microvm.boot import boot_template, first_message, start_slabless
from gym_fork.hosts.microvm.building import image_cache
from gym_fork.hosts.microvm.building.image import GuestImage, ImageError, build_image
from gym_fork.hosts.microvm.machine import (
    Machine,
    MachineConfig,
    MachineError,
    controller_is_main_thread,
    new_memfd,
    start_watched,
)
from gym_fork.hosts.microvm.requirements import INSTALL_HINT, missing_requirements
from gym_fork.hosts.microvm.snapshot import BranchPoint, copy_data, freeze_copy
from gym_fork.hosts.output import OutputCollector
from gym_fork.hosts.preparing import init_message, raise_prepare_failure
from gym_fork.system.isolation import SandboxLimits
from gym_fork.system.linux import ProcessWatch
from gym_fork.text_safety import escape_controls
from gym_fork.transport.channel import Channel, region_bytes
from gym_fork.worker import protocol as P

BOOT_TIMEOUT_S = 600.0  # TCG boots and imports numpy/gymnasium in ~10 s; keep a margin

_EXIT_LINE = re.compile(r"gym_fork-guest-exit (\d+)")


@dataclass
class _VMSandbox:
    """What the microVM host keeps per worker sandbox: its QEMU."""

    machine: Machine

    def close(self) -> None:
        self.machine.kill()


MISSING_MODULE_HINT = (
    "host='microvm': the guest image packs the packages the controller had imported when "
    "it was built, and what they require ({packs}). Import the missing package before "
    "making the vector env, or name its distribution in GYM_FORK_VM_PACKAGES "
    "(comma separated; 'all' packs the whole environment)."
)


class MicroVMHost(SharedByBranches):
    """Boots the warm parent VM once, freezes it, and restores clones of it."""

    kind = "microvm"

    def __init__(
        self,
        config: HostConfig,
        *,
        echo_output: bool = True,
        image: GuestImage | None = None,
    ) -> None:
        isolation = config.isolation
        self.isolation_config = isolation
        if self.isolation_config.network:
            raise ValueError(
                "host='microvm' has no guest network (the VMs get no NIC): network=True "
                "is not available"
            )
        if self.isolation_config.limits != SandboxLimits():
            raise ValueError(
                "host='microvm' does not apply SandboxLimits (rlimits and cgroups are "
                "process-host tools): a VM is bounded by its RAM (vm_memory_mb) and one vCPU"
            )
        self.output: OutputCollector | None = OutputCollector(echo=echo_output)
        self._lock = threading.Lock()
        self._users = 1
        self._machines: dict[int, Machine] = {}
        self._generation = 0
        self.template: BranchPoint | None = None
        self.pid = -1
        self.gpu_pid: int | None = None  # a clone is a restored VM, not a forked process
        self.trusted = config.trusted
        missing = missing_requirements()
        if missing:
            self.output.close()
            raise SandboxStartError(
                f"host='microvm' cannot run here: missing {'; '.join(missing)}. "
                f"Install: {INSTALL_HINT}"
            )
        self._image_held: pathlib.Path | None = None
        try:
            self.image = self._held_image(image)
        except Exception as exc:
            self.output.close()
            raise SandboxStartError(f"host='microvm': no guest image: {exc}") from exc
        try:
            self.accel, self.accel_reason = choose_accel(self.image)
            self.config = MachineConfig(
                self.image,
                self.accel,
                config.vm_memory_mb,
                region_bytes(config.ring_capacity),
                config.vm_slab_mb << 20,
                config.ring_capacity,
                # GYM_FORK_VM_DOORBELL=0: idle guests keep polling (for measurements)
                doorbell=knobs.read("GYM_FORK_VM_DOORBELL") != "0",
            )
            self.slab_min_bytes = self.config.slab_bytes  # sparse: costs nothing unused
            self._die_with_controller = controller_is_main_thread()
            self._boot_warm_parent(config)
        except BaseException:
            self.close()
            raise

    def _held_image(self, given: GuestImage | None) -> GuestImage:
        """The image, held against eviction by other processes until :meth:`close`
        (built again if one evicted it between the build and the hold)."""
        for _ in range(3):
            image = given or build_image()
            if image_cache.hold(image.root.parent):
                self._image_held = image.root.parent
                return image
            if given is not None:
                raise ImageError(f"the guest image {image.root.parent} was removed")
        raise ImageError("the guest image was removed each time it was built")

    # -- the warm parent --------------------------------------------------------------
    def _boot_warm_parent(self, host_config: HostConfig) -> None:
        message = init_message(host_config)
        output = self._open_output()
        start_timeout = host_config.start_timeout
        started = time.perf_counter()
        boot, self.boot_seconds = boot_template(self.config, start_timeout or BOOT_TIMEOUT_S)
        restoring = time.perf_counter()
        ram_fd = new_memfd("gym_fork-vm-ram", self.config.memory_mb << 20)
        state_fd = os.memfd_create("gym_fork-vm-state", os.MFD_CLOEXEC)
        self.template = BranchPoint(ram_fd, state_fd, b"")
        copy_data(boot.ram_fd, ram_fd)  # the warm parent writes its own RAM: not the boot image's
        channel = Channel.create("warm parent VM", self.config.ring_capacity, poll=True)
        channel.set_positions(boot.positions)
        channel.send({**message, "time_ns": time.time_ns(), "entropy": os.urandom(32)})
        try:
            machine = start_slabless(
                self.config,
                output,
                "warm-parent",
                ram_fd,
                channel,
                incoming=True,
                die_with_controller=self._die_with_controller,
            )
        except BaseException:
            channel.close()
            raise
        self.pid = machine.pid
        try:
            boot.resume(machine)
            self.restore_seconds = time.perf_counter() - restoring
            reply = self._await_warm_parent(channel, machine, start_timeout or BOOT_TIMEOUT_S)
            self.guest = reply.get("isolation", {})
            saving = time.perf_counter()
            machine.save(state_fd)
            self.save_seconds = time.perf_counter() - saving
            self.state_bytes = os.fstat(state_fd).st_size
            self.template.positions = channel.positions()
            self.ready_seconds = time.perf_counter() - started
        finally:
            machine.kill()
            channel.close()
            output.forget("warm-parent")

    def _await_warm_parent(self, channel: Channel, machine: Machine, timeout: float) -> dict:
        reply = first_message(channel, machine, timeout)
        if reply is None:
            if not machine.alive():
                raise SandboxStartError(
                    "the warm parent VM exited before it was ready; its output:\n"
                    + escape_controls(self._open_output().tail("warm-parent", "stderr")[-4000:])
                    + machine.log()
                )
            raise SandboxStartError(
                f"the warm parent VM was not ready within {timeout} s ({self.accel})"
            )
        if reply.get("op") != "ready":
            try:
                raise_prepare_failure(reply, "the warm parent VM", trusted=self.trusted)
            except Exception as exc:
                if "ModuleNotFoundError" in repr(reply):
                    packs = ", ".join(self.image.distributions) or "the whole environment"
                    exc.add_note(MISSING_MODULE_HINT.format(packs=packs))
                raise
        return reply

    def _open_output(self) -> OutputCollector:
        """The collector of this host's VM output; refused once the host is closed."""
        if self.output is None:
            raise SandboxStartError("host='microvm' is closed: it starts no more VMs")
        return self.output

    # -- clones ---------------------------------------------------------------------
    def _next_generation(self) -> int:
        with self._lock:
            self._generation += 1
            return self._generation

    def _restore_clones(
        self,
        point: BranchPoint,
        slab_fds: Sequence[int],
        orders: list[tuple[WorkerSpec, Any]],
    ) -> list[WorkerHandle]:
        """Start one QEMU per order on ``point``; each finds its order (a ``become``
        message or a REBIND request) in its channel."""
        for pid in [pid for pid, m in self._machines.items() if not m.alive()]:
            del self._machines[pid]  # released ones (kill() reaped them)
        output = self._open_output()
        started: list[tuple[WorkerHandle, Machine]] = []
        try:
            for (spec, order), slab_fd in zip(orders, slab_fds, strict=True):
                channel = Channel.create(spec.name, self.config.ring_capacity, poll=True)
                channel.set_positions(point.positions)
                channel.send(order)
                try:
                    machine = start_watched(
                        self.config,
                        output,
                        ram_fd=point.ram_fd,
                        shared_ram=False,
                        channel_fd=channel.region.fd,
                        slab_fd=slab_fd,
                        incoming=True,
                        name="gym_fork-" + re.sub(r"[^A-Za-z0-9_-]+", "-", spec.name),
                        die_with_controller=self._die_with_controller,
                    )
                except BaseException:
                    channel.close()
                    raise
                handle = WorkerHandle(
                    spec.name,
                    list(spec.indices),
                    channel,
                    machine.pid,
                    ProcessWatch(machine.pid),
                    list(spec.origins),
                    output=output,
                    host_data=_VMSandbox(machine),
                )
                self._machines[machine.pid] = machine
                started.append((handle, machine))
            for handle, machine in started:
                if self.config.doorbell:
                    handle.channel.outbox.peer_bell_fd = machine.bell.fileno()
                point.resume(machine)
        except BaseException:
            for handle, _machine in started:
                handle.release()
            raise
        return [handle for handle, _ in started]

    def spawn(
        self,
        specs: Sequence[WorkerSpec],
        slab_fds: Sequence[int],
        ring_capacity: int,
        attach: bytes | None = None,
    ) -> list[WorkerHandle]:
        """One clone of the frozen warm parent per spec; each builds its sub-envs."""
        self._check_capacity(ring_capacity)
        point = self.template
        if point is None:
            raise SandboxStartError("host='microvm' is closed: it starts no more VMs")
        orders = [
            (
                spec,
                {
                    "op": "become",
                    "name": spec.name,
                    "indices": spec.indices,
                    "origins": spec.origins,
                    "attach": attach,
                    "generation": self._next_generation(),
                    "time_ns": time.time_ns(),
                },
            )
            for spec in specs
        ]
        try:
            return self._restore_clones(point, slab_fds, orders)
        except (MachineError, OSError) as exc:
            raise SandboxStartError(f"spawn {specs[0].name}: {exc}") from exc

    def fork(
        self,
        source: WorkerHandle,
        orders: Sequence[CloneOrder],
        num_envs: int,
        slab_fds: Sequence[int],
        ring_capacity: int,
        ask: AskWorker,
    ) -> list[WorkerHandle]:
        """Clone the running sandbox ``source`` (idle: no request in flight).

        The source's private RAM is copied once into a new frozen branch point; the
        source then resumes. (``ask`` is not needed: the controller copies the VM.)
        """
        self._check_capacity(ring_capacity)
        for slab_fd in slab_fds:
            self.check_slab(os.fstat(slab_fd).st_size)
        machine = source.host_data.machine if source.host_data is not None else None
        if machine is None or not machine.alive():
            raise SandboxStartError(f"fork: the VM of {source.name} is not running")
        point = freeze_copy(
            self.config, machine, source.channel, die_with_controller=self._die_with_controller
        )
        try:
            rebinds = [
                (
                    order.spec,
                    [
                        P.REBIND,
                        0,
                        {
                            "source": order.source_index,
                            "index": order.branch_index,
                            "seed": order.seed,
                            "num_envs": num_envs,
                            "generation": self._next_generation(),
                            "time_ns": time.time_ns(),
                        },
                    ],
                )
                for order in orders
            ]
            return self._restore_clones(point, slab_fds, rebinds)
        except (MachineError, OSError) as exc:
            raise SandboxStartError(f"fork of {source.name}: {exc}") from exc
        finally:
            point.close()  # the clones hold their own mappings of its RAM

    def _check_capacity(self, ring_capacity: int) -> None:
        if ring_capacity != self.config.ring_capacity:
            raise ValueError(
                f"this microVM host was built for rings of {self.config.ring_capacity} "
                f"bytes, not {ring_capacity}"
            )

    def check_slab(self, nbytes: int) -> None:
        """A vector env's slab must fit the slab device (a pc-dimm) every VM of this host has."""
        if nbytes > self.config.slab_bytes:
            raise ValueError(
                f"the batch slab needs {nbytes} bytes; the sandboxes of this microVM host "
                f"map {self.config.slab_bytes}: pass a larger vm_slab_mb"
            )

    # -- health, status, isolation --------------------------------------------------
    def alive(self) -> bool:
        """The frozen warm parent exists as long as this host is open."""
        return self.template is not None and self.template.ram_fd >= 0

    def tree(self) -> list[WorkerHandle]:
        """None: each VM has its own kernel, so no sandbox can signal another."""
        return []

    def exit_code(self, worker: WorkerHandle) -> int | None:
        """The guest worker's exit status if it reported one, else QEMU's."""
        pid = worker.pid
        tail = self.output.tail(str(pid), "stderr") if self.output is not None else ""
        found = _EXIT_LINE.findall(tail)
        if found:
            return int(found[-1])
        machine = self._machines.get(pid)
        if machine is None:
            return None
        return machine.process.poll()

    def measure_born(self, worker: WorkerHandle) -> None:
        """Nothing from outside: a guest is measured inside (its HELLO report)."""

    def isolation(
        self, sandbox: dict[str, Any] | None = None, pid: int | None = None
    ) -> IsolationReport:
        """What separates sandboxes here, measured inside a guest (its HELLO report)."""
        guest = (sandbox or {}) or self.guest
        with open("/proc/sys/kernel/random/boot_id") as f:
            host_boot_id = f.read().strip()
        own_kernel = bool(guest) and guest.get("boot_id") != host_boot_id
        interfaces = guest.get("network_interfaces", [])
        return IsolationReport(
            host=self.kind,
            network="off" if not interfaces else f"interfaces {interfaces}",
            namespaces={"mount": False, "ipc": False, "uts": False, "net": False, "pid": False},
            private_tmp=True,
            no_new_privs=False,
            limits={"memory_mb": self.config.memory_mb, "vcpus": 1},
            missing={} if own_kernel else {"kernel": "the guest did not report its kernel"},
            details={
                "accelerator": self.accel,
                "accelerator_reason": self.accel_reason,
                "process": True,
                "kernel": "own" if own_kernel else "unknown",
                "guest_kernel": guest.get("kernel"),
                "address_space": "copy-on-write guest RAM (MAP_PRIVATE over the branch point)",
                "disk": "read-only image, private tmpfs overlay in guest RAM",
                "image": self.image.digest,
            },
        )

    def close(self, timeout: float = 2.0) -> None:
        """Kill every VM this host started and drop the branch point."""
        for machine in list(self._machines.values()):
            machine.kill()
        self._machines.clear()
        held, self._image_held = getattr(self, "_image_held", None), None
        if held is not None:
            image_cache.release(held)
        if self.template is not None:
            self.template.close()
            self.template = None
        if self.output is not None:
            self.output.close()
            self.output = None
