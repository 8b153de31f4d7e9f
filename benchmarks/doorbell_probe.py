"""Wake-ups across the VM boundary: polling rings against a virtio-serial doorbell.

    .venv/bin/python benchmarks/doorbell_probe.py [--round-trips 500] [--idle 5]

One guest, booted with a virtio-serial port (gym_fork/hosts/microvm/doorbell.py runs in
it). Measured, host side:
  poll RTT       a small message to the guest and back over the polled rings
  doorbell RTT   one byte to the guest and back over the virtio-serial port (the guest
                 blocks in read(); each byte is an emulated interrupt and virtqueue kick)
  idle CPU       CPU time QEMU burns per second while the guest waits, each way
  idle vector env  CPU per idle VM of a 4-VM ForkVectorEnv after its last step, with the
                 hybrid the host uses (poll, then the doorbell after 200 ms idle) and with
                 GYM_FORK_VM_DOORBELL=0 (poll only)
"""

from __future__ import annotations

import argparse
import os
import time

from gym_fork.hosts.microvm.accel import choose_accel
from gym_fork.hosts.microvm.building.image import build_image
from gym_fork.hosts.microvm.machine import Machine, MachineConfig, new_memfd
from gym_fork.transport.channel import Channel, region_bytes


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(pid: int, seconds: float) -> float:
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def idle_vector_env(doorbell: bool, seconds: float) -> float:
    """Mean CPU share per QEMU of 4 idle microVM sandboxes."""
    import gymnasium as gym
    import numpy as np

    from gym_fork import ForkVectorEnv

    os.environ["GYM_FORK_VM_DOORBELL"] = "1" if doorbell else "0"
    envs = ForkVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 4,
        host="microvm",
        envs_per_worker=1,
        lineage_log=False,
    )
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        time.sleep(1.0)  # past the 200 ms after which a wait counts as idle
        before = [cpu_seconds(pid) for pid in envs.worker_pids]
        time.sleep(seconds)
        after = [cpu_seconds(pid) for pid in envs.worker_pids]
        return sum(b - a for a, b in zip(before, after, strict=True)) / len(before) / seconds
    finally:
        envs.close()
        del os.environ["GYM_FORK_VM_DOORBELL"]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--round-trips", type=int, default=500)
    parser.add_argument("--idle", type=float, default=5.0)
    args = parser.parse_args()
    image = build_image()
    accel, _ = choose_accel(image)
    capacity = 1 << 16
    config = MachineConfig(
        image,
        accel,
        256,
        region_bytes(capacity),
        2 << 20,
        capacity,
        extra_cmdline="gym_fork.probe=doorbell",
    )
    ram = new_memfd("gym_fork-vm-probe-ram", 256 << 20)
    slab = new_memfd("gym_fork-vm-probe-slab", config.slab_bytes)
    channel = Channel.create("probe", capacity, poll=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    machine = Machine(
        config,
        ram_fd=ram,
        shared_ram=True,
        channel_fd=channel.region.fd,
        slab_fd=slab,
        out_fd=devnull,
        err_fd=devnull,
        incoming=False,
        name="gym_fork-doorbell-probe",
    )
    ours = machine.bell
    ours.setblocking(True)
    try:
        assert channel.recv(300) == {"op": "probe-ready"}
        for _ in range(50):
            channel.send(0)
            channel.recv(10)
        poll = []
        for k in range(args.round_trips):
            started = time.perf_counter()
            channel.send(k)
            channel.recv(10)
            poll.append(time.perf_counter() - started)
        poll_idle = idle_cpu(machine.pid, args.idle)
        channel.send("switch")
        assert channel.recv(10) == "switched"
        for _ in range(50):
            ours.sendall(b"x")
            ours.recv(1)
        bell = []
        for _ in range(args.round_trips):
            started = time.perf_counter()
            ours.sendall(b"x")
            ours.recv(1)
            bell.append(time.perf_counter() - started)
        bell_idle = idle_cpu(machine.pid, args.idle)
        ours.sendall(b"q")
    finally:
        machine.kill()
        channel.close()
        for fd in (ram, slab, devnull):
            os.close(fd)
    hybrid = idle_vector_env(True, args.idle)
    polling = idle_vector_env(False, args.idle)
    print(f"accelerator {accel}; {args.round_trips} round trips each")
    for name, values, idle in (("poll", poll, poll_idle), ("doorbell", bell, bell_idle)):
        print(
            f"{name:9} RTT p50 {1e6 * pct(values, 0.5):6.0f} us  p99 {1e6 * pct(values, 0.99):6.0f}"
            f" us   idle: QEMU uses {100 * idle:5.1f}% of a core"
        )
    print(
        f"idle vector env (4 VMs): hybrid {100 * hybrid:.1f}% of a core per VM, "
        f"poll only {100 * polling:.1f}%"
    )


if __name__ == "__main__":
    main()
