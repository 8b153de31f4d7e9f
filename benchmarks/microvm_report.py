"""Figures of the microVM host (one run; the accelerator is printed with them).

  .venv/bin/python benchmarks/microvm_report.py [--clones 20] [--fanout 16]

boot       cold boot of the guest to a waiting agent, frozen as the boot template
           (once per controller process and image)
parent     warm parent ready: restore a copy of the boot template, prepare the env
           (CartPole-v1, from_parent), save the device state (x-ignore-shared)
spawn      a clone of the frozen parent: QEMU start + state load + first step
           (reset_mode="clone" reset of one sub-env, then a step)
fork       fork() of a running sub-env: freeze-copy of its RAM (helper QEMU),
           state save, clone restore, REBIND, first step of the branch
fan-out    fork(copies=N) of one running sub-env + one step of all N
pss        PSS of each of the N clones after their first step (the whole QEMU process,
           and its guest-RAM mapping alone), against guest RAM
step       round trip of one step (1 CartPole sub-env), microVM vs process host
"""

from __future__ import annotations

import argparse
import statistics
import time

import gymnasium as gym
import numpy as np

from gym_fork import ForkVectorEnv
from gym_fork.hosts.microvm.boot import release_boot_templates


def cartpole():
    return gym.make("CartPole-v1")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def ms(values: list[float]) -> str:
    return (
        f"p50 {1e3 * pct(values, 0.5):7.1f} ms  p99 {1e3 * pct(values, 0.99):7.1f} ms  "
        f"(n={len(values)})"
    )


def guest_ram_pss(pid: int) -> int:
    """PSS of the guest-RAM mapping alone (the part shared copy-on-write), in bytes."""
    total, inside = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(" ", 1)[0]
            if "-" in first and ":" not in first:
                inside = "gym_fork-vm" in line and "ram" in line
            elif inside and first == "Pss:":
                total += int(line.split()[1]) * 1024
    return total


def us(values: list[float]) -> str:
    return f"p50 {1e6 * pct(values, 0.5):7.0f} us  p99 {1e6 * pct(values, 0.99):7.0f} us"


def step_round_trip(host: str, steps: int) -> list[float]:
    envs = ForkVectorEnv([cartpole], host=host, lineage_log=False)
    try:
        envs.reset(seed=0)
        action = np.zeros(1, dtype=np.int64)
        for _ in range(50):
            envs.step(action)
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            envs.step(action)
            times.append(time.perf_counter() - started)
        return times
    finally:
        envs.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clones", type=int, default=20)
    parser.add_argument("--fanout", type=int, default=16)
    parser.add_argument("--steps", type=int, default=500)
    args = parser.parse_args()

    release_boot_templates()
    started = time.perf_counter()
    envs = ForkVectorEnv.from_parent(cartpole, 1, seed=0, host="microvm", lineage_log=False)
    first = time.perf_counter() - started
    host = envs.sandboxes.host
    report = envs.isolation
    print(f"accelerator: {report['accelerator']} ({report['accelerator_reason']})")
    print(f"guest: kernel {report['guest_kernel']}, {envs.vm_memory_mb} MiB RAM, 1 vCPU")
    print(f"boot       {host.boot_seconds:7.2f} s  cold boot to a waiting agent (boot template)")
    warm = host.ready_seconds - host.boot_seconds
    # The host times the restore and the save; the rest is the guest preparing the env
    # (plus QEMU's start and the channel set-up, which the host does not time apart).
    prepare = warm - host.restore_seconds - host.save_seconds
    print(
        f"parent     {1e3 * warm:7.1f} ms  restore {1e3 * host.restore_seconds:.1f}"
        f" + prepare {1e3 * prepare:.1f} + save {1e3 * host.save_seconds:.1f} ms "
        f"(device state {host.state_bytes / 1024:.0f} KiB); first vector env in {first:.2f} s"
    )
    try:
        envs.reset()
        spawn = []
        for _ in range(args.clones):
            t = time.perf_counter()
            envs.reset()  # reset_mode="clone": a fresh clone of the frozen parent
            envs.step(np.zeros(1, dtype=np.int64))
            spawn.append(time.perf_counter() - t)
        print(f"spawn      {ms(spawn)}  clone of the frozen parent + first step")

        fork = []
        for k in range(args.clones):
            envs.step(np.zeros(1, dtype=np.int64))
            t = time.perf_counter()
            branch = envs.fork(f"f{k}")
            branch.step(np.zeros(1, dtype=np.int64))
            fork.append(time.perf_counter() - t)
            branch.close()
        print(f"fork       {ms(fork)}  live fork of a running sub-env + first step")

        t = time.perf_counter()
        fan = envs.fork("fan", copies=args.fanout)
        fan.step(np.zeros(args.fanout, dtype=np.int64))
        fan_s = time.perf_counter() - t
        pss = [row["pss"] for row in fan.stats()]
        ram = [guest_ram_pss(pid) for pid in fan.worker_pids]
        guest = envs.vm_memory_mb << 20
        print(f"fan-out    {fan_s:7.2f} s  fork(copies={args.fanout}) + one step of all")
        print(
            f"pss        median {statistics.median(pss) / 2**20:.1f} MiB per clone QEMU "
            f"(max {max(pss) / 2**20:.1f}) = 1/{guest / statistics.median(pss):.0f} of guest RAM;"
            f" its guest-RAM mapping {statistics.median(ram) / 2**20:.1f} MiB "
            f"= 1/{guest / statistics.median(ram):.0f}"
        )
        fan.close()
    finally:
        envs.close()

    vm = step_round_trip("microvm", args.steps)
    proc = step_round_trip("process", args.steps)
    print(f"step VM    {us(vm)}")
    print(f"step proc  {us(proc)}  (VM / process: {pct(vm, 0.5) / pct(proc, 0.5):.0f}x at p50)")


if __name__ == "__main__":
    main()
