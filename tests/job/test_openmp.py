"""The OpenMP runtime choice: which environment a re-execution gets, and `python -m run` really
running under the runtime it was asked for, with the same answer under both."""

import json
import os
import platform
import sys
from pathlib import Path

import pytest

from job.openmp import (
    OpenMPChoiceError,
    environment_for_children,
    intel_library,
    preload_advice,
    preload_environment,
    requested,
    runtime_in_use,
)
from tests.test_run import run

LIB = Path("/opt/intel/libiomp5.so")
LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"


def test_the_last_command_line_choice_wins_and_auto_is_the_default():
    assert requested(["+experiment=ar"]) == "auto"
    assert requested(["executor.openmp=gnu", "x=1", "executor.openmp=intel"]) == "intel"
    with pytest.raises(OpenMPChoiceError, match="choose one of auto, intel, gnu"):
        requested(["executor.openmp=iomp"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a preload is a Linux (ld.so) mechanism")
def test_a_preload_is_added_once_and_keeps_what_was_preloaded():
    env = preload_environment("auto", {"PATH": "/bin", "LD_PRELOAD": "/x/libjemalloc.so"}, LIB)
    assert env["LD_PRELOAD"] == f"{LIB}:/x/libjemalloc.so" and env["PATH"] == "/bin"
    assert preload_environment("auto", env, LIB) is None               # the re-executed process: no loop
    assert preload_environment("intel", {"LD_PRELOAD": str(LIB)}, LIB) is None   # preloaded by hand
    assert preload_environment("gnu", {}, LIB) is None
    assert preload_environment("auto", {}, None) is None                # not installed: torch's own runtime
    with pytest.raises(OpenMPChoiceError, match="pip install intel-openmp"):
        preload_environment("intel", {}, None)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a preload is a Linux (ld.so) mechanism")
def test_children_get_the_preload_as_it_was_before():
    started = {"PATH": "/bin", "LD_PRELOAD": "/x/libjemalloc.so"}
    assert environment_for_children(preload_environment("auto", started, LIB)) == started
    assert environment_for_children(preload_environment("auto", {"PATH": "/bin"}, LIB)) == {"PATH": "/bin"}
    by_hand = {"LD_PRELOAD": str(LIB)}
    assert environment_for_children(by_hand) == by_hand          # the user's own preload stays


@pytest.mark.skipif(not LINUX_X86, reason="intel-openmp ships for Linux on x86-64 only")
def test_run_answers_the_same_under_either_runtime(tmp_path):
    assert intel_library() is not None, "intel-openmp is a dependency on Linux x86-64: is the install complete?"
    assert runtime_in_use() == "gnu"       # pytest itself was started without a preload
    answers, shm_before = {}, set(os.listdir("/dev/shm"))
    for choice in ("intel", "gnu"):
        out = run(f"executor.openmp={choice}", f"hydra.run.dir={tmp_path / choice}")
        assert out.returncode == 0, out.stderr
        metrics = json.loads((tmp_path / choice / "metrics.json").read_text())
        assert metrics["openmp"] == choice
        assert f"OpenMP runtime: {choice}" in (tmp_path / choice / "plan.txt").read_text()
        answers[choice] = metrics["output_ids"]
    assert answers["intel"] == answers["gnu"] and len(answers["gnu"]) > 0
    # Intel's runtime registers each process in /dev/shm: the run and its decoders leave none behind
    assert set(os.listdir("/dev/shm")) - shm_before == set()


def test_a_bad_choice_is_one_message_and_status_2(tmp_path):
    out = run("executor.openmp=iomp", f"hydra.run.dir={tmp_path}")
    assert out.returncode == 2
    assert "executor.openmp='iomp': choose one of auto, intel, gnu" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.skipif(not LINUX_X86, reason="intel-openmp is a dependency on Linux x86-64 only")
def test_a_script_without_the_preload_is_told_how_to_start_and_a_run_that_chose_is_not():
    """pytest runs as a script would, without the preload: auto gets the advice, a choice none."""
    advice = preload_advice("auto")
    assert advice is not None and "LD_PRELOAD=$(python -m job.openmp)" in advice
    assert preload_advice("gnu") is None and preload_advice("intel") is None


def test_a_library_run_under_gnus_runtime_says_so_in_its_plan(tmp_path, caplog):
    from job.run import _warn_once, run_job
    from stages.source import load_requests
    from tests.conf.test_experiments import composed

    cfg = composed(["+experiment=demo", "graph.nodes.source.stage.items=2", "graph.nodes.check.stage.rounds=2"])
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    _warn_once.cache_clear()                  # a process warns once: this test's run must be the first
    run_job(cfg, load_requests(cfg.get("data")), tmp_path / "first")
    plan = (tmp_path / "first" / "plan.txt").read_text()
    if preload_advice("auto"):
        assert "OpenMP runtime: gnu (Intel's is installed: LD_PRELOAD=$(python -m job.openmp)" in plan
        assert any("LD_PRELOAD" in r.message and r.levelname == "WARNING" for r in caplog.records)
        caplog.clear()
        run_job(cfg, load_requests(cfg.get("data")), tmp_path / "again")
        assert "Intel's is installed" in (tmp_path / "again" / "plan.txt").read_text()
        assert not any("LD_PRELOAD" in r.message for r in caplog.records)     # warned once, not a job
    else:                                     # no Intel runtime here: nothing to advise
        assert "Intel's is installed" not in plan
