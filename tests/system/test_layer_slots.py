"""How a clone finds the frozen layers its source's mount namespace holds
(gym_fork/system/layer_slots.py): the depth it knew, confirmed, else a bisection."""

from __future__ import annotations

import math

import pytest

from gym_fork.system import layer_slots


@pytest.mark.parametrize("depth", range(layer_slots.MAX_LAYERS + 1))
def test_a_clone_finds_its_layers_at_any_depth_in_few_checks(monkeypatch, depth):
    """The slots hold layers from 0 on: a clone confirms the depth its source knew with
    two checks of a slot, and finds it by bisection where that is stale (a freeze its
    source never adopted, a source that never counted), the most recent layer first
    (each check costs two lstat calls in a deep mount namespace)."""
    slots = [f"{layer_slots.LAYERS_DIR}/{d}" for d in range(layer_slots.MAX_LAYERS)]
    checked = []

    def ismount(path):
        checked.append(path)
        return path in slots[:depth]

    monkeypatch.setattr(layer_slots.os.path, "ismount", ismount)
    bisection = 2 + math.ceil(math.log2(layer_slots.MAX_LAYERS))
    for known, most in [
        (depth, 2),
        (depth - 1, 2 + bisection),
        (depth + 1, 2 + bisection),
        (0, 2 + bisection),
        (-5, bisection),
    ]:
        monkeypatch.setattr(layer_slots, "_known_depth", known)
        checked.clear()
        assert layer_slots.layer_paths() == slots[:depth][::-1], known
        assert len(checked) <= most, (known, checked)
        assert layer_slots._known_depth == depth
    layer_slots.adopted_layer()
    assert layer_slots._known_depth == depth + 1
