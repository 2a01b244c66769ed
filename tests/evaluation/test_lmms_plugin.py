"""reelflow through lmms-eval (evaluation.lmms_model, registered by the `lmms_eval.models` entry
point): the local task answered by `ar` and `sparrow` gives reelflow's own answers for the same
videos and prompts, identical between the two (Sparrow is lossless), with the speed of every
answer in lmms-eval's logged samples and in the sweep's side-by-side report; bad model_args stop
with one clear message."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}


def _run(*args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_the_entry_point_names_the_backend():
    from lmms_eval.models import get_model

    from evaluation.lmms_model import Reelflow

    assert get_model("reelflow") is Reelflow


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """`python -m run -m +experiment=lmms_eval eval.method=ar,sparrow`: one command, one report."""
    out = tmp_path_factory.mktemp("lmms_sweep")
    done = _run("-m", "run", "-m", "+experiment=lmms_eval", "eval.method=ar,sparrow", f"eval.limit={LIMIT}",
                f"hydra.sweep.dir={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _job(sweep: Path, method: str) -> Path:
    for d in sweep.iterdir():
        if (d / "metrics.json").is_file() and json.loads((d / "metrics.json").read_text())["method"] == method:
            return d
    raise AssertionError(f"no {method} job in {sweep}")


def _answer(sample: dict) -> str:
    """A logged sample's answer: lmms-eval's files hold it as a string, its returned samples as a list."""
    resps = sample["filtered_resps"]
    return resps if isinstance(resps, str) else resps[0]


def _reelflow_own_answers(docs: list[dict]) -> list[str]:
    """The same questions answered by reelflow's job runner directly (no lmms-eval)."""
    from evaluation.config import compose_config
    from job.run import run_job
    from stages.types import Request
    from zoo.videos import ensure_video

    cfg = compose_config({"experiment": "ar", "model": "toy_qwen", "graph.max_new_tokens": 64})
    requests = [Request(id=d["id"], video=str(ensure_video(d["seed"], d["seconds"], d["fps"], d["size"])[0]),
                        prompt=d["prompt"]) for d in docs]
    with tempfile.TemporaryDirectory() as tmp:
        metrics = run_job(cfg, requests, Path(tmp))
    return [r["output_text"] for r in metrics.get("runs") or [metrics]]


def test_ar_and_sparrow_answer_as_reelflow_does_with_speed_beside_each_answer(sweep):
    jobs = {m: _job(sweep, m) for m in ("ar", "sparrow")}
    samples = {m: [json.loads(line) for line in (d / "samples_reelflow_toy.jsonl").read_text().splitlines()]
               for m, d in jobs.items()}
    answers = {m: [s["filtered_resps"][0] for s in rows] for m, rows in samples.items()}
    assert len(answers["ar"]) == LIMIT and answers["ar"] == answers["sparrow"]
    docs = [s["doc"] for s in samples["ar"]]
    assert answers["ar"] == _reelflow_own_answers(docs)
    for method, rows in samples.items():
        for s in rows:
            speed = s["token_counts"][0]["reelflow"]
            assert speed["method"] == method and speed["ttft_s"] > 0 and speed["wall_s"] >= speed["ttft_s"]
            assert speed["plugin_s"] >= 0 and s["token_counts"][0]["output_tokens"] == speed["n_generated"]
        metrics = json.loads((jobs[method] / "metrics.json").read_text())
        assert metrics["speed"]["ttft_s_median"] > 0 and metrics["n_answers"] == LIMIT
        assert 0 <= metrics["score"]["reelflow_toy"]["accuracy"] <= 1
        throughput = json.loads((jobs[method] / "results.json").read_text())["throughput"]
        assert throughput["avg_ttft_s_median"] == pytest.approx(metrics["speed"]["ttft_s_median"])
        assert (jobs[method] / "reelflow" / "plan.txt").is_file()          # reelflow's own run files
    sparrow = samples["sparrow"][0]["token_counts"][0]["reelflow"]
    assert sparrow["mean_accepted_length"] >= 1


def test_the_report_puts_score_and_speed_side_by_side(sweep):
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    by_method = {r["eval.method"]: r for r in rows}
    assert set(by_method) == {"ar", "sparrow"}
    assert float(by_method["ar"]["speedup"]) == pytest.approx(1.0)
    assert float(by_method["sparrow"]["speedup"]) > 0
    assert by_method["ar"]["answers_digest"] == by_method["sparrow"]["answers_digest"]
    assert by_method["ar"]["score.reelflow_toy.accuracy"] == by_method["sparrow"]["score.reelflow_toy.accuracy"]
    assert "speedup" in (sweep / "report.md").read_text()


def test_lmms_evals_own_command_line(tmp_path):
    """The README's command, as written there (with a limit and our output path), through
    `python -m evaluation`: lmms-eval's CLI unchanged, after hiding a torchvision that cannot
    load (this machine's CPU torch beside pip's CUDA torchvision stops `python -m lmms_eval` at
    its imports, whatever the model)."""
    done = _run("-m", "evaluation", "--model", "reelflow", "--model_args",
                f"experiment=ar,model=toy_qwen,run_dir={tmp_path / 'reelflow'}", "--tasks", "reelflow_toy",
                "--include_path", "evaluation/tasks", "--limit", "2", "--log_samples", "--output_path",
                str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    samples = list((tmp_path / "out").rglob("*samples_reelflow_toy*.jsonl"))
    assert samples, list((tmp_path / "out").rglob("*"))
    rows = [json.loads(line) for line in samples[0].read_text().splitlines()]
    assert len(rows) == 2 and all(r["token_counts"][0]["reelflow"]["ttft_s"] > 0 for r in rows)
    assert (tmp_path / "reelflow" / "speed.json").is_file()


def test_on_ray_the_answers_are_the_same(sweep, tmp_path):
    """`cluster=ray` in model_args: the requests run on a pool of Ray workers, with the answers
    the local runner gave."""
    done = _run("-m", "evaluation", "--model", "reelflow", "--model_args",
                f"experiment=ar,cluster=ray,cluster.workers=1,run_dir={tmp_path / 'reelflow'}", "--tasks",
                "reelflow_toy", "--include_path", "evaluation/tasks", "--limit", "2", "--log_samples", "--output_path",
                str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-3000:]
    samples = next((tmp_path / "out").rglob("*samples_reelflow_toy*.jsonl"))
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    local = [json.loads(line) for line in (_job(sweep, "ar") / "samples_reelflow_toy.jsonl").read_text().splitlines()]
    assert [_answer(r) for r in rows] == [_answer(r) for r in local[:2]]
    assert json.loads((tmp_path / "reelflow" / "metrics.json").read_text())["cluster"]["kind"] == "ray"


@pytest.mark.parametrize("args, message", [
    ("experiment=nope,model=toy_qwen", "experiment=nope is not one of reelflow's experiments"),
    ("experiment=ar,model=toy_qwen,no_such_key=1", "no_such_key=1"),
    ("experiment=train_sparrow", "trains a model"),
])
def test_bad_model_args_give_one_clear_message(args, message):
    from evaluation.config import ModelArgsError
    from evaluation.lmms_model import Reelflow

    with pytest.raises(ModelArgsError, match=re.escape(message)) as e:
        Reelflow.create_from_arg_string(args)
    assert "\n" not in str(e.value)


def test_log_likelihood_names_what_to_use_instead():
    from evaluation.lmms_model import Reelflow

    lm = Reelflow.create_from_arg_string("experiment=sparrow,model=toy_qwen")
    with pytest.raises(NotImplementedError, match="does not score log-likelihoods.*--model qwen2_5_vl"):
        lm.loglikelihood([])


def test_a_doc_whose_video_cannot_be_read_is_answered_empty_and_the_others_as_reelflow_answers(tmp_path):
    """Three docs, the middle one's video cut short: its answer is '' (scored as wrong, its error in
    speed.json), the others are matched to their own runs (by request id, not by place among the
    answered ones) and are what `python -m run` answers for their videos."""
    from collections import namedtuple

    from evaluation.lmms_model import Reelflow

    good = ROOT / "zoo" / "sample" / "toy-30s.mp4"
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(good.read_bytes()[:20000])
    lm = Reelflow.create_from_arg_string(f"experiment=ar,model=toy_qwen,run_dir={tmp_path / 'rf'}")
    lm.task_dict = {"t": {"test": {0: {"v": str(good)}, 1: {"v": str(bad)}, 2: {"v": str(good)}}}}
    request = namedtuple("request", "args")
    asks = [request(("describe the video .", {"max_new_tokens": 12, "until": []}, lambda doc: [doc["v"]], doc, "t",
                     "test")) for doc in (0, 1, 2)]
    answers = lm.generate_until(asks)
    assert answers[1].text == "" and answers[0].text == answers[2].text != ""
    assert "not a video file FFmpeg can read" in answers[1].token_counts.speed["failed"]
    speed = json.loads((tmp_path / "rf" / "speed.json").read_text())
    assert speed["answers"] == 2 and [f["doc_id"] for f in speed["failed"]] == [1]
    cli = _run("-m", "run", "data.path=zoo/sample/toy-30s.mp4", "graph.max_new_tokens=12",
               f"hydra.run.dir={tmp_path / 'cli'}")
    assert cli.returncode == 0, cli.stderr[-2000:]
    assert json.loads((tmp_path / "cli" / "metrics.json").read_text())["output_text"] == answers[0].text
