"""Each host held against the :class:`~gym_fork.hosts.base.Host` Protocol, for the type
checker (``tests/test_types.py`` runs mypy over ``gym_fork/hosts``): a host whose
methods or attributes drift from the Protocol fails there, not in a user's run.

Returning an *instance* where ``Host`` is expected checks every member, instance
attributes included (an assignment of the class to ``type[Host]`` would not). Nothing
imports this module at run time; its imports are for the checker only, so loading it
would not load the backends either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gym_fork.hosts.base import Host
    from gym_fork.hosts.inline import InlineHost
    from gym_fork.hosts.microvm.host import MicroVMHost
    from gym_fork.hosts.process.host import ProcessHost


def _process_host(host: ProcessHost) -> Host:
    return host


def _microvm_host(host: MicroVMHost) -> Host:
    return host


def _inline_host(host: InlineHost) -> Host:
    return host
