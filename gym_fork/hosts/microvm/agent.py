"""The guest agent: the worker loop inside a microVM.

Started by the guest's /init (``python -m gym_fork.hosts.microvm.agent``). It maps its
channel and the batch slab (host memfds at fixed guest-physical addresses), receives the env_fns
exactly as the process host's warm parent does (and prepares the same way: the code is
shared), answers ``ready`` and waits. That wait is the branch point: the controller
freezes the VM there and every clone resumes inside it, finds a ``become`` message in
its own channel and turns into a worker. A clone of a running worker resumes inside
the worker loop instead and gets a REBIND request with its new identity.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import time
import traceback
from typing import Any

from gym_fork.hosts.microvm.doorbell import find_port
from gym_fork.hosts.preparing import prepare_failure
from gym_fork.transport.channel import Channel
from gym_fork.transport.slab import Slab
from gym_fork.worker import protocol as P
from gym_fork.worker.loop import NO_REPLY, Worker
from gym_fork.worker.prepare import EnvSource

RNDRESEEDCRNG = 0x5207  # ioctl: make the kernel's RNG draw from its pool now


def _cmdline_value(key: str) -> str:
    with open("/proc/cmdline") as f:
        for item in f.read().split():
            if item.startswith(key + "="):
                return item.split("=", 1)[1]
    raise RuntimeError(f"the kernel command line has no {key}=")


def open_doorbell() -> int:
    """The doorbell port's fd, or -1 (then an idle wait keeps polling)."""
    try:
        return os.open(find_port(), os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return -1


def guest_report(generation: int) -> dict[str, Any]:
    """What this guest is, as measured from inside it."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    interfaces = sorted(n for n in os.listdir("/sys/class/net") if n != "lo")
    return {
        "kernel": os.uname().release,
        "boot_id": boot_id,
        "hostname": os.uname().nodename,
        "network_interfaces": interfaces,
        "generation": generation,
    }


def refresh_clock(time_ns: int) -> None:
    """A clone resumes with its parent's wall clock: take the controller's."""
    with contextlib.suppress(OSError):
        time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)


def reseed_kernel(seed: int | bytes) -> None:
    """Give this guest's kernel RNG its own state (clones share their parent's)."""
    material = seed if isinstance(seed, bytes) else f"gym_fork clone {seed}".encode()
    with open("/dev/urandom", "wb", buffering=0) as f:
        f.write(hashlib.sha256(material).digest())
        fcntl.ioctl(f.fileno(), RNDRESEEDCRNG)


def fresh_start(message: dict[str, Any]) -> None:
    """A warm parent restored from the boot template must not inherit its clock or its
    randomness (every warm parent would then share the kernel RNG and Python's and numpy's
    global generators, as no two process-host warm parents do): take the controller's
    clock and entropy, then reseed the global generators from the kernel."""
    import random

    import numpy as np

    refresh_clock(message["time_ns"])
    reseed_kernel(message["entropy"])
    random.seed()
    np.random.seed()


class GuestWorker(Worker):
    """The worker loop with the slab in guest-physical memory and a REBIND for clones."""

    def __init__(self, channel: Channel, spec: dict[str, Any], make_env, generation: int):
        super().__init__(channel, spec["indices"], spec["origins"], make_env)
        self.generation = generation
        self.isolation = guest_report(generation)

    def extra_handlers(self):
        return {P.REBIND: self.rebind}

    def open_slab(self, obs_space, act_space, num_envs: int, use_observations: bool) -> Slab:
        return Slab(
            obs_space,
            act_space,
            num_envs,
            use_observations=use_observations,
            region_fd=os.open("/dev/mem", os.O_RDWR | os.O_SYNC),
            region_offset=int(_cmdline_value("gym_fork.slab"), 16),
        )

    def rebind(self, arg: dict[str, Any]) -> tuple[object, None]:
        """Become the branch sub-env ``arg['index']`` (a restored clone of a worker)."""
        refresh_clock(arg["time_ns"])
        self.generation = arg["generation"]
        self.isolation = guest_report(self.generation)
        if arg.get("seed") is not None:
            reseed_kernel(arg["seed"])
        self.become_clone(arg["source"], arg["index"], arg.get("seed"), arg["num_envs"])
        return NO_REPLY, None


def main() -> None:
    capacity = int(_cmdline_value("gym_fork.ring_capacity"))
    fd = os.open("/dev/mem", os.O_RDWR | os.O_SYNC)
    address = int(_cmdline_value("gym_fork.channel"), 16)
    channel = Channel.attach(fd, capacity, "guest", poll=True, offset=address)
    with open("/proc/cmdline") as f:
        probing = "gym_fork.probe=doorbell" in f.read()
    if probing:  # the port is the measurement's (a virtio-serial port has one opener)
        from gym_fork.hosts.microvm.doorbell import guest_echo

        guest_echo(channel)
        return
    if _cmdline_value("gym_fork.bell") == "1":
        channel.inbox.bell_fd = open_doorbell()
    channel.send({"op": "booted"})
    # First branch point: booted, imports done. The controller freezes the VM here once
    # per image and restores a copy of it for every warm parent it needs.
    env_source = EnvSource()
    message = channel.recv()
    try:
        fresh_start(message)
        env_source.prepare(message)
    except Exception as exc:
        channel.send(prepare_failure(exc))
        return
    channel.send({"op": "ready", "isolation": guest_report(0)})
    # The branch point: the controller freezes this VM while it waits here.
    order = channel.recv()
    refresh_clock(order["time_ns"])
    worker = GuestWorker(channel, order, env_source.make_env, order["generation"])
    if worker.hello(env_source.attach_arg(order.get("attach"))):
        worker.run()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.exit(1)
