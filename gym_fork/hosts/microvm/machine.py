"""One QEMU process: a guest booted from the image, or restored from a frozen one.

Every piece of guest memory is a memfd that the controller made and QEMU maps through
``/proc/self/fd/N``: guest RAM (``share=on`` for a VM that will be a branch point,
``share=off`` — a private, copy-on-write mapping — for a clone), the channel region and
the batch slab (two ``pc-dimm`` devices at fixed addresses, always shared). Nothing is written to
``/dev/shm`` or disk, so nothing outlives the processes that hold the fds. Device state
moves through ``fd:`` migrations with ``x-ignore-shared``: shared RAM is not copied.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from gym_fork.hosts.microvm.building.image import GuestImage
from gym_fork.hosts.microvm.qmp import QMP, QMPError
from gym_fork.hosts.output import OutputCollector
from gym_fork.system import linux

# Guest-physical addresses of the channel and slab memory. They are pc-dimm devices at
# fixed addresses (not ivshmem PCI BARs: a BAR gets its address only when the guest
# programs it, and QEMU's x-ignore-shared restore insists that a shared block sits at
# the same address before the device state is loaded). The guest kernel is told not to
# use them as RAM (acpi_no_memhotplug) and the agent maps them through /dev/mem.
DEVICE_MEMORY_BASE = 1 << 32
TCG_CACHE_MB = 16
BELL_PORT = "gf.bell"  # name of the doorbell's virtio-serial port in the guest


class MachineError(RuntimeError):
    """QEMU could not start, save or restore a guest."""


@dataclass(frozen=True)
class MachineConfig:
    """What every VM of one host shares: identical devices, so state moves between them."""

    image: GuestImage
    accel: str  # "kvm" or "tcg"
    memory_mb: int
    channel_bytes: int  # size of the channel device (a power of two)
    slab_bytes: int  # size of the slab device (a power of two)
    ring_capacity: int
    doorbell: bool = True  # an idle guest blocks on a virtio-serial doorbell
    extra_cmdline: str = ""  # appended to the kernel command line (measurements)
    extra_args: tuple[str, ...] = ()  # appended to QEMU's arguments (measurements)

    @property
    def channel_address(self) -> int:
        return DEVICE_MEMORY_BASE

    @property
    def slab_address(self) -> int:
        return DEVICE_MEMORY_BASE + self.channel_bytes

    def kernel_cmdline(self) -> str:
        # no_timer_check: under TCG on a loaded host the kernel's IO-APIC timer check can
        # miss its ticks and panic ("IO-APIC + timer doesn't work!", seen at load 9 on 2
        # cores); the emulated timer works, the check is what fails.
        return (
            "console=ttyS1 quiet loglevel=3 panic=-1 mitigations=off acpi_no_memhotplug "
            "no_timer_check "
            f"gym_fork.ring_capacity={self.ring_capacity} "
            f"gym_fork.channel={self.channel_address:#x} gym_fork.slab={self.slab_address:#x} "
            f"gym_fork.bell={int(self.doorbell)}"
            + (" " + self.extra_cmdline if self.extra_cmdline else "")
        )


def qemu_binary() -> str | None:
    return shutil.which("qemu-system-x86_64")


def new_memfd(name: str, size: int) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


class QemuFds(NamedTuple):
    """The fds a QEMU process gets, by what they are to it."""

    ram: int
    channel: int
    slab: int
    out: int
    err: int
    qmp: int
    bell: int


def qemu_arguments(
    binary: str,
    config: MachineConfig,
    fds: QemuFds,
    shared_ram: bool,
    incoming: bool,
    paused: bool,
    name: str,
) -> list[str]:
    """QEMU's command line for one VM of ``config`` (see :class:`Machine`)."""
    ram_fd, channel_fd, slab_fd, out_fd, err_fd = fds.ram, fds.channel, fds.slab, fds.out, fds.err
    image = config.image
    share = "on" if shared_ram else "off"
    args = [
        binary,
        "-name",
        name,
        "-machine",
        "q35,memory-backend=gf-ram",
        "-accel",
        # TCG's translation cache is private to each clone: a small one keeps a
        # clone's own memory small (a step loop's guest code fits many times over).
        "kvm" if config.accel == "kvm" else f"tcg,tb-size={TCG_CACHE_MB}",
        "-cpu",
        "host" if config.accel == "kvm" else "max",
        "-m",
        f"{config.memory_mb}M,slots=2,"
        f"maxmem={(config.memory_mb << 20) + config.channel_bytes + config.slab_bytes}",
        "-smp",
        "1",
        "-nodefaults",
        "-no-user-config",
        "-no-reboot",
        "-display",
        "none",
        "-nic",
        "none",
        # SeaBIOS would print its banner on the first serial port (the guest's stdout)
        "-fw_cfg",
        "name=etc/sercon-port,string=0",
        "-object",
        f"memory-backend-file,id=gf-ram,size={config.memory_mb}M,"
        f"mem-path=/proc/self/fd/{ram_fd},share={share}",
        "-kernel",
        str(image.kernel.vmlinuz),
        "-initrd",
        str(image.initramfs),
        "-append",
        config.kernel_cmdline(),
        "-drive",
        f"file={image.root},format=raw,readonly=on,if=virtio",
        "-object",
        f"memory-backend-file,id=gf-channel,size={config.channel_bytes},"
        f"mem-path=/proc/self/fd/{channel_fd},share=on",
        "-device",
        f"pc-dimm,id=gf-channel-dimm,memdev=gf-channel,addr={config.channel_address:#x}",
        "-object",
        f"memory-backend-file,id=gf-slab,size={config.slab_bytes},"
        f"mem-path=/proc/self/fd/{slab_fd},share=on",
        "-device",
        f"pc-dimm,id=gf-slab-dimm,memdev=gf-slab,addr={config.slab_address:#x}",
        "-chardev",
        f"file,id=gf-out,path=/proc/self/fd/{out_fd}",
        "-serial",
        "chardev:gf-out",
        "-chardev",
        f"file,id=gf-err,path=/proc/self/fd/{err_fd}",
        "-serial",
        "chardev:gf-err",
        "-device",
        "virtio-serial-pci,id=gf-serial",
        "-chardev",
        f"socket,id=gf-bell,fd={fds.bell}",
        "-device",
        f"virtserialport,chardev=gf-bell,name={BELL_PORT}",
        "-chardev",
        f"socket,id=gf-qmp,fd={fds.qmp}",
        "-mon",
        "chardev=gf-qmp,mode=control",
    ]
    args += config.extra_args
    if incoming:
        args += ["-incoming", "defer"]
    if paused:
        args.append("-S")
    return args


class Machine:
    """A QEMU process and its QMP session.

    ``ram_fd`` is the guest RAM; ``shared_ram`` maps it MAP_SHARED (the VM's writes land
    in the memfd) or MAP_PRIVATE (copy-on-write over it). ``incoming`` starts the VM
    waiting for :meth:`restore`; ``paused`` keeps it stopped after a restore.
    """

    def __init__(
        self,
        config: MachineConfig,
        *,
        ram_fd: int,
        shared_ram: bool,
        channel_fd: int,
        slab_fd: int,
        out_fd: int,
        err_fd: int,
        incoming: bool,
        paused: bool = False,
        name: str = "gym_fork",
        die_with_controller: bool = True,
        extra_fds: tuple[int, ...] = (),
    ) -> None:
        binary = qemu_binary()
        if binary is None:
            raise MachineError("QEMU is not installed: apt-get install qemu-system-x86")
        self.config = config
        self.name = name
        qmp_ours, qmp_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The doorbell: a virtio-serial port whose host end is ours (every VM has it, so
        # that device state moves between them; the guest uses it when gym_fork.bell=1).
        self.bell, bell_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.bell.setblocking(False)
        fds = QemuFds(
            ram_fd, channel_fd, slab_fd, out_fd, err_fd, qmp_theirs.fileno(), bell_theirs.fileno()
        )
        args = qemu_arguments(binary, config, fds, shared_ram, incoming, paused, name)
        try:
            self._launch(args, (*fds, *extra_fds), die_with_controller)
        except BaseException:
            qmp_ours.close()
            self.bell.close()
            raise
        finally:
            qmp_theirs.close()
            bell_theirs.close()
        self._connect(qmp_ours)

    def _launch(self, args: list[str], fds: tuple[int, ...], die_with_controller: bool) -> None:
        """Start QEMU with ``fds`` passed; its own messages go to ``log_fd``, apart from
        the guest's output, and are shown on failure."""
        preexec = _die_with_controller if die_with_controller else None
        self.log_fd = os.memfd_create(f"{self.name}-qemu-log", os.MFD_CLOEXEC)
        try:
            self.process = subprocess.Popen(
                args,
                pass_fds=fds,
                stdin=subprocess.DEVNULL,
                stdout=self.log_fd,
                stderr=self.log_fd,
                preexec_fn=preexec,
            )
        except BaseException:
            os.close(self.log_fd)
            raise
        self.pid = self.process.pid

    def _connect(self, qmp_ours: socket.socket) -> None:
        """The QMP session (QEMU's greeting read): else QEMU is killed and its log shown."""
        try:
            self.qmp: QMP | None = QMP(qmp_ours)
        except (QMPError, OSError) as exc:
            qmp_ours.close()
            time.sleep(0.05)
            log = self.log()
            self.kill()
            raise MachineError(f"{self.name}: QEMU did not start: {exc}\n{log}") from exc

    # -- migration ------------------------------------------------------------------
    def command(self, name: str, arguments: dict | None = None, fds: tuple[int, ...] = ()):
        """A QMP command; failures carry what QEMU printed."""
        if self.qmp is None:
            raise MachineError(f"{self.name}: the VM was killed")
        try:
            return self.qmp.command(name, arguments, fds)
        except (QMPError, OSError) as exc:
            time.sleep(0.05)  # let a dying QEMU finish its last words
            raise MachineError(f"{self.name}: {exc}\n{self.log()}".rstrip()) from exc

    def _ignore_shared(self, state: bool = True) -> None:
        self.command(
            "migrate-set-capabilities",
            {"capabilities": [{"capability": "x-ignore-shared", "state": state}]},
        )

    def _wait_migration(self, what: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            status = self.command("query-migrate").get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled"):
                info = self.command("query-migrate")
                raise MachineError(
                    f"{self.name}: {what} {status}: {info.get('error-desc')}\n{self.log()}"
                )
            if time.monotonic() > deadline:
                raise MachineError(f"{self.name}: {what} did not finish within {timeout} s")
            time.sleep(0.001)

    def stop(self) -> None:
        self.command("stop")

    def cont(self) -> None:
        self.command("cont")

    def save(self, fd: int) -> None:
        """Stop the guest and write its state to ``fd`` (shared RAM is skipped)."""
        self.stop()
        self._ignore_shared()
        self.command("getfd", {"fdname": "gf-out-state"}, fds=(fd,))
        self.command("migrate", {"uri": "fd:gf-out-state"})
        self._wait_migration("saving the state")

    def restore(self, fd: int) -> None:
        """Load a state saved by :meth:`save` (started with ``incoming``) and run."""
        self._ignore_shared()
        self.command("getfd", {"fdname": "gf-in-state"}, fds=(fd,))
        self.command("migrate-incoming", {"uri": "fd:gf-in-state"})
        self._wait_migration("restoring the state")
        if self.command("query-status")["status"] != "running":
            self.cont()

    # -- lifetime -------------------------------------------------------------------
    def log(self) -> str:
        """What QEMU itself printed (not the guest), without its routine warnings."""
        if self.log_fd < 0:
            return ""
        data = os.pread(self.log_fd, 1 << 16, 0).decode(errors="replace")
        lines = [line for line in data.splitlines() if "fw_cfg item names" not in line]
        return "\n".join(lines)

    def ring_bell(self) -> None:
        """Wake the guest if it blocks on its doorbell (after a restore: the order it
        waits for was written before this QEMU existed)."""
        with contextlib.suppress(BlockingIOError, OSError):
            self.bell.send(b"\0")

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        qmp = getattr(self, "qmp", None)
        if qmp is not None:
            qmp.close()
            self.qmp = None
        if self.log_fd >= 0:
            os.close(self.log_fd)
            self.log_fd = -1
        self.bell.close()


def start_watched(
    config: MachineConfig,
    output: OutputCollector,
    *,
    ram_fd: int,
    shared_ram: bool,
    channel_fd: int,
    slab_fd: int,
    incoming: bool,
    name: str,
    die_with_controller: bool,
    key: str | None = None,
) -> Machine:
    """A :class:`Machine` whose guest output ``output`` watches under ``key`` (default:
    its QEMU's pid)."""
    (out_r, out_w), (err_r, err_w) = output.new_pipes()
    try:
        machine = Machine(
            config,
            ram_fd=ram_fd,
            shared_ram=shared_ram,
            channel_fd=channel_fd,
            slab_fd=slab_fd,
            out_fd=out_w,
            err_fd=err_w,
            incoming=incoming,
            name=name,
            die_with_controller=die_with_controller,
        )
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
    output.watch(str(machine.pid) if key is None else key, out_r, err_r)
    return machine


def _die_with_controller() -> None:
    linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGKILL)


def controller_is_main_thread() -> bool:
    """PDEATHSIG follows the creating thread: only tie VMs to a main-thread controller."""
    return threading.current_thread() is threading.main_thread()
