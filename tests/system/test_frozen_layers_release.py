"""Which kernels keep user.* xattrs on tmpfs (what frozen layers need: Linux 6.6+), read
from release strings as distributions and release candidates write them."""

from __future__ import annotations

import math

import pytest

from gym_fork.system import frozen_layers
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


@pytest.mark.parametrize("depth", range(frozen_layers.MAX_LAYERS + 1))
def test_a_clone_finds_its_layers_at_any_depth_in_few_checks(monkeypatch, depth):
    """The slots hold layers from 0 on: a clone confirms the depth its source knew with
    two checks of a slot, and finds it by bisection where that is stale (a freeze its
    source never adopted, a source that never counted), the most recent layer first
    (each check costs two lstat calls in a deep mount namespace)."""
    slots = [f"{frozen_layers.LAYERS_DIR}/{d}" for d in range(frozen_layers.MAX_LAYERS)]
    checked = []

    def ismount(path):
        checked.append(path)
        return path in slots[:depth]

    monkeypatch.setattr(frozen_layers.os.path, "ismount", ismount)
    bisection = 2 + math.ceil(math.log2(frozen_layers.MAX_LAYERS))
    for known, most in [
        (depth, 2),
        (depth - 1, 2 + bisection),
        (depth + 1, 2 + bisection),
        (0, 2 + bisection),
        (-5, bisection),
    ]:
        monkeypatch.setattr(frozen_layers, "_known_depth", known)
        checked.clear()
        assert frozen_layers.layer_paths() == slots[:depth][::-1], known
        assert len(checked) <= most, (known, checked)
        assert frozen_layers._known_depth == depth
    frozen_layers.adopted_layer()
    assert frozen_layers._known_depth == depth + 1
