"""gym_fork.autotune: offline measurement of the groupings, and its recommendation."""

from __future__ import annotations

import gymnasium as gym
import pytest

from gym_fork import autotune
from gym_fork.vector.autotune import candidate_groupings
from gym_fork.vector.config import auto_envs_per_worker


def make_cartpole():
    return gym.make("CartPole-v1")


def test_candidates_cover_one_per_sandbox_per_core_and_all_in_one():
    assert candidate_groupings(8, 2) == [1, 2, 4, 8]
    assert candidate_groupings(2, 2) == [1, 2]
    assert candidate_groupings(1, 16) == [1]
    assert candidate_groupings(64, 16) == [1, 2, 4, 32, 64]


def test_auto_grouping_is_by_core_count_alone(monkeypatch):
    monkeypatch.setattr("gym_fork.vector.config.available_cores", lambda: 2)
    assert auto_envs_per_worker(2) == 1  # no special case for one machine shape
    assert auto_envs_per_worker(8) == 4
    assert auto_envs_per_worker(8, "clone") == 1


@pytest.mark.slow  # 1.9 s here
def test_autotune_measures_every_candidate_and_recommends_the_fastest(capsys):
    lines: list[str] = []
    result = autotune(
        [make_cartpole] * 2,
        seconds=0.2,
        rounds=2,
        candidates=[2, 1, 2],
        network=False,
        progress=lines.append,
    )
    # a progress line before any try and one per try (4: 2 groupings x 2 rounds)
    assert len(lines) == 5 and "2 grouping(s) x 2 round(s)" in lines[0], lines
    assert lines[-1].startswith("autotune [4/4] round 2") and "steps/s" in lines[-1]
    assert sorted(result.steps_per_second) == [1, 2]
    assert all(len(v) == 2 and min(v) > 0 for v in result.rounds.values())
    fastest = max(result.steps_per_second, key=result.steps_per_second.get)
    assert result.envs_per_worker == fastest
    text = str(result)
    assert f"envs_per_worker={fastest}" in text and "fastest" in text


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seconds": 0}, ValueError, "seconds"),
        ({"rounds": 0}, ValueError, "rounds"),
        ({"candidates": [3]}, ValueError, "candidate"),
        ({"candidates": [True]}, ValueError, "candidate"),
        ({"envs_per_worker": 2}, TypeError, "envs_per_worker"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        autotune([make_cartpole] * 2, **kwargs)


def test_autotune_reports_progress_on_stderr_by_default(capsys):
    autotune([make_cartpole], seconds=0.05, rounds=1, candidates=[1], network=False)
    err = capsys.readouterr().err
    assert "autotune [1/1] round 1, envs_per_worker=1:" in err, err
