"""The microVM tests run only where QEMU, a kernel and the image tools are present;
elsewhere they are skipped with what is missing (CI installs all of them)."""

from __future__ import annotations

import pytest

from gym_fork.hosts.microvm.requirements import INSTALL_HINT, missing_requirements


def pytest_collection_modifyitems(config, items):
    missing = missing_requirements()
    for item in items:
        if "tests/microvm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.microvm)
            if missing:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"host='microvm' needs {'; '.join(missing)} ({INSTALL_HINT})"
                    )
                )
