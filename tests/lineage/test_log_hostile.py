"""The lineage log against a hostile sandbox (hardening, issue 18): the controller (root)
follows no path a sandbox may have planted there and trusts no string it reads back.

A sandbox that can reach the log's directory may replace the log with a symlink, a hard
link, a FIFO or a directory, or append lines of its own; none of that makes the
controller write elsewhere, hang, crash a user's step, draw a wrong tree or emit markup.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from gym_fork import cli
from gym_fork.lineage import LineageLog, read_log, render_html, render_tree
from gym_fork.lineage.picture import branch_nodes, select_trees
from gym_fork.lineage.png import render_png

ROOT = Path(__file__).resolve().parents[2]
PRECIOUS = b"root-owned, not the sandbox's to write\n"
EVENT = {"event": "closed", "branch_id": "root-1", "closed": 2.0, "exit_status": "closed"}


def created(branch_id, parent=None, **fields) -> dict:
    kind = "root_ready" if parent is None else "branch_created"
    event = {"event": kind, "branch_id": branch_id, "parent_branch_id": parent, "num_envs": 1}
    return {**event, **fields}


@pytest.fixture(scope="module", autouse=True)
def fonts_loaded(tmp_path_factory):
    """matplotlib keeps the font files it has used open: draw once before the first
    test's leak check takes its snapshot of open fds (as test_picture does)."""
    if importlib.util.find_spec("matplotlib") is not None:
        events = [created("warm"), created("up", "warm", source_indices=[0], copies=1)]
        render_png(events, tmp_path_factory.mktemp("warm") / "warm.png")


def write_lines(path: Path, lines: list) -> Path:
    text = [line if isinstance(line, str) else json.dumps(line) for line in lines]
    path.write_text("\n".join(text) + "\n")
    return path


def victim(tmp_path: Path) -> Path:
    target = tmp_path / "victim"
    target.write_bytes(PRECIOUS)
    return target


def append_refused(log: LineageLog) -> str:
    """Append one event, which must be refused with a warning (not an exception)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.append(EVENT)
    messages = [str(w.message) for w in caught if "lineage log" in str(w.message)]
    assert messages, "no warning named the refused lineage log"
    assert str(log.path) in messages[0]
    return messages[0]


HUNG = object()


def in_thread(fn, timeout: float = 5.0):
    """fn() in a thread: its result (an exception is returned), or HUNG."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as exc:  # returned to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return out[0] if out else HUNG


# -- writing: no path the sandbox planted is followed -------------------------------------


def test_a_symlinked_log_is_not_written_through(tmp_path):
    target = victim(tmp_path)
    log_path = tmp_path / "state" / "lineage.jsonl"
    log_path.parent.mkdir()
    log_path.symlink_to(target)
    message = append_refused(LineageLog(log_path))
    assert "symlink" in message
    assert target.read_bytes() == PRECIOUS
    assert log_path.is_symlink()


def test_a_vector_env_with_a_symlinked_log_warns_and_works(tmp_path):
    from gym_fork import ForkVectorEnv
    from tests.helpers import SpaceEnv

    target = victim(tmp_path)
    log_path = tmp_path / "lineage.jsonl"
    log_path.symlink_to(target)
    from gymnasium import spaces

    with pytest.warns(UserWarning, match="lineage log"):
        envs = ForkVectorEnv([lambda: SpaceEnv(spaces.Box(-1, 1, (2,)))], lineage_log=str(log_path))
    try:
        envs.reset(seed=0)
        assert envs.step([0])[0].shape == (1, 2)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            envs.close()
    assert target.read_bytes() == PRECIOUS


def test_a_hard_link_to_another_file_is_not_written(tmp_path):
    target = victim(tmp_path)
    log_path = tmp_path / "lineage.jsonl"
    os.link(target, log_path)
    assert "link" in append_refused(LineageLog(log_path))
    assert target.read_bytes() == PRECIOUS


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file away")
def test_a_log_owned_by_another_user_is_not_written(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    log_path.write_bytes(PRECIOUS)
    os.chown(log_path, 65534, 65534)
    assert "owned by uid 65534" in append_refused(LineageLog(log_path))
    assert log_path.read_bytes() == PRECIOUS


def test_a_fifo_log_is_refused_without_hanging(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    os.mkfifo(log_path)
    log = LineageLog(log_path)
    # No reader: a blocking open for writing would wait forever.
    result = in_thread(lambda: append_refused(log))
    if result is HUNG:  # unblock the writer so that the test can end
        os.close(os.open(log_path, os.O_RDONLY | os.O_NONBLOCK))
    assert isinstance(result, str), result
    # A reader holds it open (the sandbox, waiting for what the controller writes).
    reader = os.open(log_path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert "not a regular file" in in_thread(lambda: append_refused(log))
        with contextlib.suppress(BlockingIOError):  # (no writer has it open)
            assert os.read(reader, 4096) == b""  # nothing was written into it
    finally:
        os.close(reader)
    # Reading it back does not hang either, and says why.
    error = in_thread(lambda: read_log(log_path))
    assert isinstance(error, OSError) and "not a regular file" in str(error), error


def test_a_directory_in_place_of_the_log_is_refused(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    log_path.mkdir()
    append_refused(LineageLog(log_path))
    assert isinstance(in_thread(lambda: read_log(log_path)), OSError)


def test_the_log_directory_is_made_private(tmp_path):
    log_path = tmp_path / "new" / "gym_fork" / "lineage.jsonl"
    LineageLog(log_path).append(EVENT)
    assert stat.S_IMODE(log_path.parent.stat().st_mode) == 0o700
    assert read_log(log_path) == [EVENT]


def test_a_world_writable_directory_without_the_sticky_bit_is_refused(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    log_path = directory / "lineage.jsonl"
    assert "writable by others" in append_refused(LineageLog(log_path))
    assert not log_path.exists()


def test_a_symlinked_log_is_not_read(tmp_path, capsys):
    target = write_lines(tmp_path / "elsewhere.jsonl", [created("secret-root")])
    log_path = tmp_path / "lineage.jsonl"
    log_path.symlink_to(target)
    with pytest.raises(OSError, match="symlink"):
        read_log(log_path)
    assert cli.main(["lineage", str(log_path)]) == 2
    out = capsys.readouterr()
    assert "symlink" in out.out + out.err and "secret-root" not in out.out


# -- reading: every value typed, a malformed line skipped and counted --------------------

MALFORMED = [
    "{not json",
    "[1, 2, 3]",
    '"a string"',
    json.dumps({"event": 5, "branch_id": "x"}),
    json.dumps(created(7)),  # an id that is not a str
    json.dumps(created("bad-count", num_envs="many")),
    json.dumps(created("bool-count", num_envs=True)),
    json.dumps(created("bad-parent", parent=["root-1"])),
    json.dumps(created("bad-time", created="yesterday")),
    '{"event": "root_ready", "branch_id": "nan-time", "created": NaN}',
    '{"event": "root_ready", "branch_id": "inf-time", "created": 1e999}',
    '{"event": "root_ready", "branch_id": "huge", "num_envs": ' + "9" * 5000 + "}",
    json.dumps(created("bad-seeds", parent="root-1", seeds=["x"], source_indices=[0])),
    json.dumps(created("bad-indices", parent="root-1", source_indices="0")),
    json.dumps(created("bad-timings", timings={"fork_s": "fast"})),
    json.dumps(created("bad-pids", pids=[1.5])),
    json.dumps({"event": "closed", "branch_id": "root-1", "exit_status": 3}),
]


def test_malformed_lines_are_skipped_and_counted(tmp_path, capsys):
    good = [
        created("root-1", baseline_id="abc", created=1.0, timings={"fork_s": 0.01}),
        created("kid", "root-1", source_indices=[0], copies=2, seeds=[5, None]),
        {"event": "closed", "branch_id": "kid", "closed": 3.0, "exit_status": "closed"},
    ]
    log_path = write_lines(tmp_path / "lineage.jsonl", [good[0], *MALFORMED, *good[1:]])
    events = read_log(log_path)
    assert events == good
    assert events.skipped == len(MALFORMED)
    tree = render_tree(events)
    assert tree.splitlines()[0].startswith("root-1")
    assert "kid" in tree and "bad" not in tree and "huge" not in tree
    # The command prints the tree and says how many lines it skipped.
    assert cli.main(["lineage", str(log_path)]) == 0
    out = capsys.readouterr()
    assert "root-1" in out.out and f"{len(MALFORMED)} malformed" in out.err
    page = tmp_path / "page.html"
    assert cli.main(["lineage", str(log_path), "--html", str(page)]) == 0
    assert "kid" in page.read_text() and "bad-count" not in page.read_text()


def test_renderers_given_raw_events_skip_the_malformed_ones():
    raw = [json.loads(line) for line in MALFORMED[3:9]] + [[1], None, "x"]
    raw.append(created("fine"))
    nodes, roots = branch_nodes(raw)
    assert roots == ["fine"] and list(nodes) == ["fine"]
    assert render_tree(raw).startswith("fine")


def test_a_parent_cycle_never_hangs_and_draws_a_tree(tmp_path):
    # "a" names "b" as its parent before "b" exists, "b" names "a"; "c" is its own parent.
    log_path = write_lines(
        tmp_path / "lineage.jsonl",
        [created("a", "b"), created("b", "a"), created("c", "c")],
    )
    page = tmp_path / "page.html"
    run = subprocess.run(
        [sys.executable, "-m", "gym_fork", "lineage", str(log_path), "--html", str(page),
         "--root", "b"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    nodes, roots = branch_nodes(read_log(log_path))
    assert roots == ["a", "c"] and nodes["a"].children == ["b"]
    assert select_trees(nodes, roots, root="b") == ["a"]
    lines = render_tree(read_log(log_path)).splitlines()
    assert [line.split()[0] for line in lines] == ["a", "└──", "c"]
    assert lines[1].split()[1] == "b"


def test_a_duplicate_branch_id_keeps_its_first_record():
    events = [created("r"), created("k", "r"), created("k", "r", num_envs=9)]
    assert render_tree(events).count("k from") == 1
    nodes, _ = branch_nodes(events)
    assert nodes["k"].num_envs == 1 and nodes["r"].children == ["k"]


# -- output: no markup, no terminal control from the log ---------------------------------

SCRIPT = "<script>alert(1)</script>"
ATTR = '" onload="x'


def hostile_events() -> list[dict]:
    return [
        created(SCRIPT, baseline_id=SCRIPT, created=1.0, exit_status=ATTR,
                timings={SCRIPT + "_s": 0.1}),
        created(ATTR, SCRIPT, source_indices=[0], copies=1, seeds=[1]),
        created("plain", baseline_id=ATTR),
    ]  # fmt: skip


def test_the_html_page_escapes_every_string_from_the_log(tmp_path):
    log_path = write_lines(tmp_path / "lineage.jsonl", hostile_events())
    page_path = tmp_path / "page.html"
    assert cli.main(["lineage", str(log_path), "--html", str(page_path), "--all"]) == 0
    for page in (page_path.read_text(), render_html(read_log(log_path))):
        assert "<script" not in page.lower()
        assert ATTR not in page and 'onload="' not in page  # no attribute can open
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # shown, as text
        assert "&quot; onload=&quot;x" in page


def test_the_text_tree_carries_no_terminal_control_characters():
    events = [created("evil\x1b]0;pwned\x07\x1b[2J", baseline_id="b\x9b31m"), created("ok")]
    tree = render_tree(events)
    assert "\x1b" not in tree and "\x07" not in tree and "\x9b" not in tree
    assert "evil" in tree and "ok" in tree


def test_the_png_does_not_parse_log_strings_as_mathtext(tmp_path):
    pytest.importorskip("matplotlib")
    events = [created("a$\\frac{1}{$b", baseline_id="$\\sqrt{$"), created("k$x$", "a$\\frac{1}{$b")]
    render_png(events, tmp_path / "tree.png")
    assert (tmp_path / "tree.png").read_bytes()[:4] == b"\x89PNG"
