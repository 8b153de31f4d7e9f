"""Runs and the rotated log (issue 22, item 3): each root records its run (time, argv,
env ids, cwd, host, pid); the log is rotated and still read whole, by concurrent writers
too; a hostile run record is bounded, escaped or skipped; trees of runs that reuse fixed
ids stay apart."""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

import gymnasium as gym
import pytest

from gym_fork.lineage import LineageLog, parse_since, read_logs, render_html, render_tree
from gym_fork.lineage.rotation import MAX_BYTES_VAR, rotated_paths


def test_a_root_records_its_run():
    def cartpole():
        return gym.make("CartPole-v1")

    from gym_fork import ForkVectorEnv

    before = time.time()
    envs = ForkVectorEnv([cartpole], envs_per_worker=1)
    try:
        run = envs.lineage.record.run
        branch = envs.fork("b", indices=[0])
        assert branch.lineage.record.run is None  # a branch's run is its root's
        branch.close()
    finally:
        envs.close()
    assert run["pid"] == os.getpid() and run["hostname"] == socket.gethostname()
    assert run["started"] <= before  # the process started before it made the env
    assert run["argv"][0] == sys.argv[0][:256] and run["cwd"] == os.getcwd()
    assert run["env_ids"] == ["CartPole-v1"] and run["makers"] == [cartpole.__qualname__]
    events = read_logs(os.environ["GYM_FORK_LINEAGE_LOG"])
    mine = envs.lineage.branch_id
    (logged,) = [e for e in events if e["event"] == "root_ready" and e["branch_id"] == mine]
    assert logged["run"] == run
    assert "run" not in next(
        e for e in events if e.get("branch_id") == "b" and e["event"] == "branch_created"
    )


def test_the_log_is_rotated_and_still_read_whole(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    log = LineageLog(log_path, max_bytes=4000)
    line = {"event": "closed", "branch_id": "r", "closed": 1.0, "exit_status": "x" * 60}
    size = len(json.dumps(line, sort_keys=True)) + 1 + 4  # + the count, up to 4 digits
    for n in range(300):
        log.append({**line, "closed": float(n)})
    files = [p for p in (*rotated_paths(log_path), log_path) if p.exists()]
    assert len(files) == 3  # lineage.jsonl.2, .1 and the log itself
    assert all(p.stat().st_size <= 4000 for p in files), [p.stat().st_size for p in files]
    events = read_logs(log_path)
    kept = [e["closed"] for e in events]
    # The newest records, in order: two full rotated files and the log; the oldest gone.
    assert kept == [float(n) for n in range(300 - len(kept), 300)]
    assert len(kept) >= 2 * (4000 // size)


def test_concurrent_writers_rotate_once_each_time_and_lose_no_line(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    writers, per_writer = 4, 150

    def write(w: int) -> None:
        log = LineageLog(log_path, max_bytes=20_000)  # its own fd and lock
        for n in range(per_writer):
            log.append({"event": "note", "branch_id": f"w{w}", "time": float(n)})

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    events = read_logs(log_path)  # ~31 KB in all: fits in the log and its rotated files
    assert events.skipped == 0
    assert sorted((e["branch_id"], e["time"]) for e in events) == sorted(
        (f"w{w}", float(n)) for w in range(writers) for n in range(per_writer)
    )
    for w in range(writers):  # each writer's lines in its order across the files
        mine = [e["time"] for e in events if e["branch_id"] == f"w{w}"]
        assert mine == sorted(mine)


def test_a_bad_rotation_size_warns_and_keeps_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_BYTES_VAR, "lots")
    with pytest.warns(UserWarning, match=f"{MAX_BYTES_VAR}='lots' is not a positive"):
        LineageLog(tmp_path / "lineage.jsonl").append({"event": "note", "branch_id": "r"})
    assert (tmp_path / "lineage.jsonl").stat().st_size > 0


def test_a_planted_rotated_name_costs_the_rotation_not_the_line(tmp_path):
    log_path = tmp_path / "lineage.jsonl"
    log_path.write_text("x" * 100 + "\n")
    (tmp_path / "lineage.jsonl.2").mkdir()  # .1 cannot be moved over a directory
    (tmp_path / "lineage.jsonl.1").write_text("{}\n")
    with pytest.warns(UserWarning, match="not rotated"):
        LineageLog(log_path, max_bytes=50).append({"event": "note", "branch_id": "r"})
    assert log_path.read_text().endswith('"branch_id": "r", "event": "note"}\n')


def hostile_root(branch_id: str, **run) -> dict:
    return {"event": "root_ready", "branch_id": branch_id, "parent_branch_id": None,
            "num_envs": 1, "created": 50.0, "run": {"started": 50.0, "pid": 7, **run}}  # fmt: skip


def test_a_hostile_run_record_is_bounded_escaped_or_skipped(tmp_path):
    huge = ["evil.py", *(["A" * 10_000] * 1_000)]  # 10 MB: under the longest line read
    events = [
        hostile_root("huge-argv", argv=huge, cwd="/" + "d" * 100_000, hostname="h" * 5000),
        hostile_root("control", argv=["\x1b]0;pwned\x07\x1b[2J<script>x</script>"],
                     env_ids=["Cart\x9bPole"], hostname="a\u202eb"),
        hostile_root("bad-env", env_ids=[5]),
        hostile_root("bad-pid", pid="seven"),
        hostile_root("bad-argv", argv=[1, 2]),
        hostile_root("bad-started", started="yesterday"),
        {**hostile_root("not-a-dict"), "run": ["started", 1]},
        hostile_root("late", started=1e300),  # a time no clock shows
    ]  # fmt: skip
    log_path = tmp_path / "lineage.jsonl"
    log_path.write_text("".join(json.dumps(e) + "\n" for e in events))
    read = read_logs(log_path)
    assert [e["branch_id"] for e in read] == ["huge-argv", "control", "late"]
    assert read.skipped == 5
    text = render_tree(read)
    assert "\x1b" not in text and "\x07" not in text and "\x9b" not in text
    assert "\u202e" not in text and "\\u202e" in text
    assert max(len(line) for line in text.splitlines()) < 700
    assert "evil.py" in text and "time ?" in text
    page = render_html(read)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert len(page) < 40_000  # 50 MB of argv does not reach the page
    assert "huge-argv" in render_tree(read, root="huge-argv")


def test_runs_with_the_same_fixed_ids_are_separate_trees():
    def root(started: float) -> list[dict]:
        return [
            hostile_root("search-root", started=started, argv=[f"run{started:.0f}.py"]),
            {"event": "branch_created", "branch_id": "expand", "parent_branch_id": "search-root",
             "num_envs": 2, "source_indices": [0], "copies": 2},
            {"event": "closed", "branch_id": "expand", "closed": started, "exit_status": "closed"},
        ]  # fmt: skip

    events = root(100.0) + root(200.0)
    assert render_tree(events, last=1).splitlines()[1:] == [
        "search-root baseline=None x1 [open]",
        "└── expand from [0] x2 -> 2 sub-envs [closed]",
    ]
    assert render_tree(events).count("expand from") == 2


def test_since_reads_durations_and_dates():
    now = 1_000_000.0
    assert parse_since("10m", now) == now - 600
    assert parse_since("2h", now) == now - 7200
    assert parse_since("1.5d", now) == now - 1.5 * 86400
    assert parse_since("2026-12-01T10:00") == datetime.datetime(2026, 12, 1, 10).timestamp()
    with pytest.raises(ValueError, match=r"'soon'.*30s, 10m"):
        parse_since("soon")
