"""Pictures of a lineage log: the layout, and a real tree search drawn as HTML and PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from gym_fork.lineage import read_log, render_html, render_png
from gym_fork.lineage.picture import branch_nodes, select_trees

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def created(branch_id: str, parent: str | None, num_envs: int = 1, **fields) -> dict:
    kind = "root_ready" if parent is None else "branch_created"
    return {"event": kind, "branch_id": branch_id, "parent_branch_id": parent,
            "num_envs": num_envs, **fields}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def fonts_loaded(tmp_path_factory):
    """matplotlib keeps the font files it has used open: draw once before the first
    test's leak check takes its snapshot of open fds."""
    events = [created("warm", None), created("up", "warm", source_indices=[0], copies=1)]
    render_png(events, tmp_path_factory.mktemp("warm") / "warm.png")


def test_layout_centres_parents_over_their_children():
    events = [
        created("r", None, 2),
        created("a", "r"),
        created("b", "r"),
        created("a1", "a"),
        created("a2", "a"),
        created("a3", "a"),
        created("orphan", "not-in-this-log"),
        created("r2", None),
    ]
    nodes, roots = branch_nodes(events)
    assert roots == ["r", "orphan", "r2"]
    assert [nodes[k].row for k in ("a1", "a2", "a3", "b")] == [0, 1, 2, 3]
    assert nodes["a"].row == 1  # midway between a1 and a3
    assert nodes["r"].row == 2  # midway between a (1) and b (3)
    assert (nodes["r"].depth, nodes["a"].depth, nodes["a1"].depth) == (0, 1, 2)
    # One empty row between trees.
    assert nodes["orphan"].row == 5 and nodes["r2"].row == 7
    assert select_trees(nodes, roots, root="a2") == ["r"]
    assert select_trees(nodes, roots, last=2) == ["orphan", "r2"]
    with pytest.raises(KeyError):
        select_trees(nodes, roots, root="missing")


def test_a_deep_chain_does_not_recurse(tmp_path):
    events = [created("b0", None)] + [created(f"b{i}", f"b{i - 1}") for i in range(1, 3000)]
    nodes, _ = branch_nodes(events)
    assert nodes["b2999"].depth == 2999
    assert all(node.row == 0 for node in nodes.values())
    assert "b2999" in render_html(events)


def test_html_escapes_what_it_shows():
    page = render_html([created("<img src=x onerror=alert(1)>", None)], title="a & b")
    assert "<img" not in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<title>a &amp; b</title>" in page


def load_demo():
    spec = importlib.util.spec_from_file_location(
        "lineage_demo", ROOT / "docs" / "guides" / "lineage_demo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_real_tree_search_is_drawn(tmp_path):
    """The docs' demo search (one level deep): its forks, seeds, pids and statuses reach
    the HTML page, and the PNG is drawn."""
    demo = load_demo()
    log = tmp_path / "lineage.jsonl"
    node, chosen = demo.search(log, depth=1, rollout_steps=10)
    try:
        pids = list(node.worker_pids)
        events = read_log(log)
    finally:
        node.close()
    assert len(chosen) == 1
    nodes, roots = branch_nodes(events)
    assert roots == ["cartpole-root"]
    assert set(nodes) == {"cartpole-root", "expand-0", "rollouts-0-a0", "rollouts-0-a1"}
    assert nodes["expand-0"].status == "open"  # read before it was closed
    statuses = {nodes[f"rollouts-0-a{a}"].status for a in (0, 1)}
    assert statuses == {"closed", "terminated"}
    assert nodes["rollouts-0-a1"].seeds == [10, 11, 12, 13]
    page = render_html(events, title="demo")
    assert "reseeded 10..13" in page
    assert ", ".join(str(p) for p in pids) in page
    assert "fork " in page and " ms" in page
    png = tmp_path / "demo.png"
    render_png(events, png)
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert png.stat().st_size > 10_000
