"""`python -m run +experiment=lmms_eval`: lmms-eval on a task with reelflow as its model, as a
reelflow job, so that a comparison of methods is one sweep with one report:

    python -m run -m +experiment=lmms_eval eval.method=ar,sparrow       # the local task, side by side

Each job runs lmms-eval's evaluator in this process (`--model reelflow`, the entry point) and
writes into its run dir: lmms-eval's results (results.json) and logged samples
(samples_<task>.jsonl, each answer with its speed), reelflow's own run files under reelflow/, and
metrics.json: the task's scores, the speed summary (medians and p90s, evaluation.speed), the
answers and a digest of them (equal digests: identical answers), and the backend's share of
the time. The sweep's report puts score and speed side by side, with each method's ratio to `ar`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from evaluation.config import ModelArgsError, hydra_value
from evaluation.speed import flat, summary

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parent.parent


def model_arg_string(args: dict) -> str:
    """lmms-eval's `model_args` string (k=v,k=v); a value with a comma cannot travel in it."""
    bad = [k for k, v in args.items() if "," in hydra_value(v)]
    if bad:
        raise ModelArgsError(f"eval.model_args: {', '.join(bad)}: a value with a comma cannot pass through lmms-eval")
    return ",".join(f"{k}={hydra_value(v)}" for k, v in args.items())


def _answer(sample: dict) -> str:
    """A logged sample's (first) answer: a list in the samples lmms-eval returns, a string in its files."""
    resps = sample.get("filtered_resps") or [""]
    return resps if isinstance(resps, str) else str(resps[0])


def digest(answers: list[str]) -> str:
    """A short fingerprint of the answers in order: two runs with equal digests answered alike."""
    return hashlib.sha256("\n\x00".join(answers).encode()).hexdigest()[:12]


def run_lmms_eval(cfg: DictConfig, run_dir: Path) -> dict:
    """Evaluate `cfg.eval` (method, model, tasks, limit, model_args) and write the run dir's files
    (see the module doc). Returns metrics.json's content."""
    from lmms_eval.evaluator import simple_evaluate
    from lmms_eval.models.model_utils.gen_metrics import reset_logged_metrics
    from lmms_eval.tasks import TaskManager

    e = OmegaConf.to_container(cfg.eval, resolve=True)
    args = {"experiment": e["method"], "model": e["model"], "run_dir": str(Path(run_dir) / "reelflow"),
            **(e.get("model_args") or {})}
    tasks = list(e["tasks"])
    reset_logged_metrics()
    start = time.perf_counter()
    # lmms-eval reads a task's data files relative to the working directory: the project root
    with contextlib.chdir(ROOT):
        manager = TaskManager(include_path=[str(ROOT / p) for p in e.get("include_path") or []])
        results = simple_evaluate(model="reelflow", model_args=model_arg_string(args), tasks=tasks,
                                  limit=e.get("limit"), log_samples=True, task_manager=manager)
    wall = time.perf_counter() - start
    if results is None:
        raise RuntimeError("lmms-eval returned no results (a non-zero rank of a distributed run?)")
    run_dir = Path(run_dir)
    samples = results.pop("samples", {})
    for task, rows in samples.items():
        with open(run_dir / f"samples_{task}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row, default=str) + "\n")
    (run_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    records = [s["token_counts"][0]["reelflow"] for rows in samples.values() for s in rows
               if s.get("token_counts") and s["token_counts"][0] and s["token_counts"][0].get("reelflow")]
    answers = [_answer(s) for rows in samples.values() for s in rows]
    score = {task: {k.split(",")[0]: v for k, v in metrics.items()
                    if isinstance(v, (int, float)) and "stderr" not in k and k != "alias"}
             for task, metrics in results.get("results", {}).items()}
    answered_s = sum(r["wall_s"] or 0 for r in records)
    metrics = {"experiment": cfg.get("experiment"), "method": e["method"], "tasks": tasks, "score": score,
               "speed": flat(summary(records)), "answers": answers, "answers_digest": digest(answers),
               "n_answers": len(answers), "wall_s": round(wall, 6),
               "plugin_share": (sum(r["plugin_s"] for r in records) / answered_s) if answered_s else None,
               "lmms_eval_version": results.get("lmms_eval_version")}
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    log.info("%s on %s: %s; %d answers, median TTFT %s s", e["method"], ", ".join(tasks), score, len(answers),
             metrics["speed"].get("ttft_s_median"))
    return metrics
