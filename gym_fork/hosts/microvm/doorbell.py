"""Guest side of the wake-up measurement: polling rings against a virtio-serial doorbell.

Every guest has a virtio-serial port named ``gf.bell`` (machine.BELL_PORT): the agent
blocks on it when its channel has been idle (ext/gf_ring.c, invariant 11).
benchmarks/doorbell_probe.py boots a guest with ``gym_fork.probe=doorbell``; the agent
then runs :func:`guest_echo` instead of waiting for env_fns: it echoes ring messages
(polling) until told to switch, then echoes bytes on the port (the guest blocks in
read(); the host's write raises an interrupt).
"""

from __future__ import annotations

import os

from gym_fork.hosts.microvm.machine import BELL_PORT
from gym_fork.transport.channel import Channel


def find_port(name: str = BELL_PORT) -> str:
    """The /dev path of the virtio-serial port called ``name``."""
    base = "/sys/class/virtio-ports"
    for entry in os.listdir(base):
        with open(os.path.join(base, entry, "name")) as f:
            if f.read().strip() == name:
                return f"/dev/{entry}"
    raise FileNotFoundError(f"no virtio-serial port named {name!r}")


def guest_echo(channel: Channel) -> None:
    fd = os.open(find_port(), os.O_RDWR)
    channel.send({"op": "probe-ready"})
    while True:
        message = channel.recv()
        if message == "switch":
            break
        channel.send(message)
    channel.send("switched")
    while True:
        byte = os.read(fd, 1)
        if byte in (b"q", b""):
            return
        os.write(fd, byte)
