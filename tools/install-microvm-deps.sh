#!/usr/bin/env bash
# What host='microvm' needs from a Debian machine: QEMU, a static busybox and mkfs.erofs
# for the guest image. (The guest kernel comes after the venv: `gym-fork image kernel`.)
# Needs root or sudo and the package registry; does nothing when all are present.
set -euo pipefail
packages=()
command -v qemu-system-x86_64 >/dev/null || packages+=(qemu-system-x86)
command -v busybox >/dev/null || packages+=(busybox-static)
command -v mkfs.erofs >/dev/null || packages+=(erofs-utils)
if [ ${#packages[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    SUDO=sudo
else
    SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get install -y -q "${packages[@]}" >/dev/null \
    || { $SUDO apt-get update -q >/dev/null && \
         $SUDO apt-get install -y -q "${packages[@]}" >/dev/null; }
