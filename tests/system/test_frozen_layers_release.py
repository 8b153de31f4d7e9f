"""Which kernels keep user.* xattrs on tmpfs (what frozen layers need: Linux 6.6+), read
from release strings as distributions and release candidates write them."""

from __future__ import annotations

import pytest

from gym_fork.system.frozen_layers import kernel_supports_layers


@pytest.mark.parametrize(
    ("release", "supported"),
    [
        ("6.18.0-13-amd64", True),
        ("6.6", True),
        ("6.10-rc1", True),
        ("6.7rc2", True),
        ("7.0.1", True),
        ("6.5.0-generic", False),
        ("6.1rc", False),
        ("5.15.0-91-generic", False),
        ("6", False),
        ("6.x", False),
        ("x.y", False),
    ],
)
def test_a_release_string_says_whether_layers_can_be_frozen(release, supported):
    assert kernel_supports_layers(release) is supported
