"""Sandbox backends (docs/architecture.md): the ``Host`` interface in ``base.py``, and
:func:`make_host`, the one place that picks a backend by name."""

from __future__ import annotations

from gym_fork.hosts.base import HOST_KINDS, Host, HostConfig


def make_host(config: HostConfig) -> Host:
    """The backend ``config.kind`` names, with its warm parent started and prepared.

    Each backend is imported only when asked for: a sandbox or guest importing
    ``gym_fork.hosts`` must not load the others (QEMU's, the process host's)."""
    if config.kind == "process":
        from gym_fork.hosts.process.host import ProcessHost

        return ProcessHost(config)
    if config.kind == "microvm":
        from gym_fork.hosts.microvm.host import MicroVMHost

        return MicroVMHost(config)
    if config.kind == "inline":
        from gym_fork.hosts.inline import InlineHost

        return InlineHost(config)
    raise ValueError(f"`host` must be one of {sorted(HOST_KINDS)}, got {config.kind!r}")
