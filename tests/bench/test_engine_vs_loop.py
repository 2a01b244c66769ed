"""bench.engine_vs_loop: both sides decode the same tokens (else it stops), and it reports the
per-token times of the rounds after the warm-up one."""

from __future__ import annotations

import re

import pytest

from bench.engine_vs_loop import main
from models.registry import release_all

SHORT = ["--", "data.toy.seconds=12", "data.toy.first_seed=240", "graph.max_new_tokens=12",
         "model.target.compile=off", "bench.fps=2"]


@pytest.fixture(autouse=True)
def _release():
    yield
    release_all()


def test_it_times_the_engine_and_the_loop_round_by_round(capsys):
    main(["--videos", "1", "--rounds", "3", *SHORT])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 1", "round 2"]
    for line in lines:
        engine, loop, ratio = (float(x) for x in re.findall(r"(\d+\.\d+)", line))
        # each figure is printed to 2 decimals
        assert engine > 0 and loop > 0 and ratio == pytest.approx(engine / loop, rel=0.02)


def test_one_round_is_refused():
    with pytest.raises(SystemExit):
        main(["--rounds", "1"])


def test_the_profile_tables_of_the_last_rounds_loops(capsys):
    """One more round than the timed ones, under the profiler, and not among the printed rounds."""
    main(["--videos", "1", "--rounds", "2", "--profile", *SHORT])
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("round ")] == ["round 1"]
    assert "by total host time" in out and "by their own host time" in out
    names = {line.split()[0] for line in out.splitlines() if line.split()}
    assert {"verify", "draft_token"} <= names and "aten::mm" in names    # the rounds' timers as regions, and the ops
