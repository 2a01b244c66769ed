"""results.jsonl: whole lines survive a crash mid-write, the latest row of a request wins, resuming
with other data is refused, and resume finds the latest run of the same command."""

from __future__ import annotations

import json

import pytest
import yaml
from omegaconf import OmegaConf

from graph.spec import ConfigError
from job.results import (
    CONFIG,
    NAME,
    RequestsFailed,
    ResultLog,
    adopt,
    config_fingerprint,
    find_resumable,
    outcome,
    prepare_run_dir,
)


def row(i, status="ok", request=None):
    return {"index": i, "request": request or f"r{i}", "status": status}


def test_a_torn_last_line_is_dropped_and_cut_off(tmp_path):
    with ResultLog(tmp_path) as log:
        log.append(row(0))
        log.append(row(1, "failed"))
    with open(tmp_path / NAME, "ab") as f:
        f.write(b'{"index": 2, "requ')                   # a write cut short by a crash
    with ResultLog(tmp_path) as log:
        assert sorted(log.rows) == [0, 1] and log.done() == {0}      # failed ones run again on resume
        log.append(row(1))
        log.append(row(2))
    lines = (tmp_path / NAME).read_text().splitlines()
    assert [json.loads(x)["index"] for x in lines] == [0, 1, 1, 2]
    with ResultLog(tmp_path) as log:
        assert log.done() == {0, 1, 2}                   # the latest row of an index wins


def test_resuming_with_other_data_is_refused(tmp_path):
    with ResultLog(tmp_path) as log:
        log.append(row(0, request="a"))
        log.check_requests(["a", "b"])
        with pytest.raises(ConfigError, match="the data differ"):
            log.check_requests(["b", "a"])


def make_run(root, name, overrides, results=True):
    d = root / "2026-11-25" / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if results:
        (d / NAME).write_text(json.dumps(row(0)) + "\n")
        (d / "trace.json").write_text("[]")
    return d


def test_resume_finds_the_latest_run_of_the_same_command(tmp_path):
    cmd = ["data=manifest", "data.manifest=m.jsonl", "cluster=ray"]
    make_run(tmp_path, "10-00-00_run", cmd)
    latest = make_run(tmp_path, "10-05-00_run", [*cmd, "cluster.resume=true"])
    make_run(tmp_path, "10-06-00_run", ["data=manifest", "data.manifest=other.jsonl", "cluster=ray"])
    make_run(tmp_path, "10-07-00_run", cmd, results=False)
    here = make_run(tmp_path, "11-00-00_run", [*cmd, "cluster.resume=true"], results=False)
    assert find_resumable(here, [*cmd, "cluster.resume=true"]) == latest.resolve()
    adopt(latest, here)
    assert (here / NAME).read_text() == (latest / NAME).read_text() and (here / "trace.json").exists()


def test_a_run_dir_with_results_is_not_overwritten_without_resume(tmp_path):
    cfg = OmegaConf.create({"model": {"target": {"path": "a"}}, "cluster": {"resume": False}})
    (tmp_path / NAME).write_text(json.dumps(row(0)) + "\n")
    with pytest.raises(ConfigError, match="cluster.resume=true"):
        prepare_run_dir(cfg, tmp_path)
    cfg.cluster.resume = True
    prepare_run_dir(cfg, tmp_path)                     # goes on from them, and records their configuration
    assert json.loads((tmp_path / CONFIG).read_text())["fingerprint"] == config_fingerprint(cfg)


def test_results_of_another_configuration_are_not_resumed(tmp_path):
    """The configuration is what the results record, whatever Hydra has since written into .hydra/:
    where and how the requests run (cluster, the progress bar) may change, nothing else."""
    cfg = OmegaConf.create({"model": {"target": {"path": "a"}}, "executor": {"progress": True},
                            "cluster": {"kind": "local", "resume": True}})
    prepare_run_dir(cfg, tmp_path)
    (tmp_path / NAME).write_text(json.dumps(row(0)) + "\n")
    moved = OmegaConf.merge(cfg, {"executor": {"progress": False}, "cluster": {"kind": "ray", "workers": 4}})
    prepare_run_dir(moved, tmp_path)
    other = OmegaConf.merge(cfg, {"model": {"target": {"path": "b"}}})
    with pytest.raises(ConfigError, match="holds results of another configuration"):
        prepare_run_dir(other, tmp_path)


def test_the_outcome_is_in_request_order_and_none_answered_is_an_error():
    rows = {1: {**row(1), "metrics": {"wall_s": 1}}, 0: {"index": 0, "request": "r0", "status": "failed",
                                                        "error": "bad file"}}
    answered, failed = outcome(rows, 3)
    assert answered == [{"wall_s": 1}] and failed == [{"request": "r0", "error": "bad file", "attempts": 1}]
    with pytest.raises(RequestsFailed, match="every request failed; the first: r0: bad file"):
        outcome({0: rows[0]}, 1)
