"""reelflow as an lmms-eval model: any reelflow graph answers lmms-eval's video tasks, with its speed
beside every answer.

    pip install -e '.[eval]'
    python -m evaluation --model reelflow --model_args experiment=sparrow,model=toy_qwen \\
        --tasks reelflow_toy --include_path evaluation/tasks --log_samples --output_path outputs/lmms_eval

Registered through lmms-eval's entry points (group `lmms_eval.models`, see pyproject.toml), so
lmms-eval needs no edit. `model_args`: `experiment` (the graph: ar, sparrow, vanilla_sd,
parallelvlm, quickvideo, ...), `model` (the model entry), `run_dir` (where reelflow's run files
go), and any other key is a Hydra override (`model.target.compile=auto`, `cluster=ray`, ...).

Every request of a generation setting runs through reelflow's own job runner in one job (the
models load once; the same graph, plan.txt, metrics.json and traces as `python -m run`), with the
task's `max_new_tokens` and temperature. A doc whose video cannot be read, or whose run fails, is
answered with an empty string, as lmms-eval's own video models answer a video they cannot load: it
scores as wrong, its error is logged and listed under `failed` in `speed.json`, and the
evaluation goes on. Each answer comes back as lmms-eval's GenerationResult;
its token counts carry reelflow's speed for that answer (evaluation.speed: TTFT, decode tokens per
second, wall time, M and acceptance where they apply, and the backend's own cost), so
`--log_samples` writes them beside every answer, and their medians and p90s go to lmms-eval's
throughput summary and to `speed.json` in the run dir.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from lmms_eval.api.instance import GenerationResult, TokenCounts
from lmms_eval.api.model import lmms
from lmms_eval.models.model_utils.gen_metrics import log_metrics
from lmms_eval.models.registry_v2 import ModelManifest
from omegaconf import open_dict

from evaluation.config import check_graph, compose_config
from evaluation.speed import flat, sample_speed, summary
from job.results import RequestsFailed

ROOT = Path(__file__).resolve().parent.parent
# lmms-eval passes these to every model; reelflow's resources config decides devices and batching
LMMS_EVAL_KEYS = ("batch_size", "max_batch_size", "device")
log = logging.getLogger("reelflow.evaluation")


def manifest() -> ModelManifest:
    """The entry point's payload: `--model reelflow`."""
    return ModelManifest(model_id="reelflow", simple_class_path="evaluation.lmms_model.Reelflow")


@dataclass
class SpeedCounts(TokenCounts):
    """lmms-eval's per-answer token counts, with reelflow's speed of that answer beside them (what
    `--log_samples` writes under `token_counts`)."""

    speed: dict | None = None

    def to_dict(self) -> dict:
        return {**super().to_dict(), "reelflow": self.speed}


class Reelflow(lmms):
    """lmms-eval's `simple` model interface over a reelflow graph (see the module doc)."""

    is_simple = True

    def __init__(self, experiment: str = "ar", model: str = "toy_qwen", run_dir: str | None = None, **model_args):
        super().__init__()
        for key in LMMS_EVAL_KEYS:
            model_args.pop(key, None)
        self.method = experiment
        self.cfg = compose_config({"experiment": experiment, "model": model, **model_args})
        check_graph(self.cfg)
        stamp = time.strftime("%Y-%m-%d/%H-%M-%S")
        self.run_dir = Path(run_dir) if run_dir else ROOT / "outputs" / "lmms_eval" / f"{stamp}_{experiment}"
        self.records: list[dict] = []       # one speed record per answer, in request order
        self.failures: list[dict] = []      # the docs without an answer: {task, doc_id, error}
        self.calls = 0                      # generate_until calls: each writes a run dir of its own

    # ------------------------------------------------------------------------- answering

    def generate_until(self, requests) -> list[GenerationResult]:
        from job.run import run_job
        from stages.types import Request

        start, in_jobs = time.perf_counter(), 0.0
        rows = [self._row(req.args) for req in requests]
        seen: dict[str, int] = {}
        for row in rows:      # lmms-eval repeats a request (its `repeats`, a rank's padding): each is its own
            seen[row["id"]] = seen.get(row["id"], 0) + 1
            if seen[row["id"]] > 1:
                row["id"] = f"{row['id']}#{seen[row['id']] - 1}"
        in_tasks = sum(row["visual_s"] for row in rows)    # the task's own doc_to_visual (may make the video)
        answers: list[GenerationResult | None] = [None] * len(rows)
        groups: dict[tuple, list[int]] = {}
        for i, row in enumerate(rows):
            groups.setdefault(row["setting"], []).append(i)
        runs: dict[int, dict] = {}
        errors: dict[int, str] = {}
        base = self.run_dir if not self.calls else self.run_dir / f"call-{self.calls}"
        self.calls += 1
        for g, (setting, members) in enumerate(groups.items()):
            cfg = self._cfg_for(setting)
            run_dir = base if len(groups) == 1 else base / f"setting-{g}"
            run_dir.mkdir(parents=True, exist_ok=True)
            batch = [Request(id=rows[i]["id"], video=rows[i]["video"], prompt=rows[i]["prompt"]) for i in members]
            t0 = time.perf_counter()
            try:
                run_job(cfg, batch, run_dir, each=True)     # each answer its own: a bad video fails alone
            except RequestsFailed:
                pass                                        # every doc of this setting failed: each is named below
            in_jobs += time.perf_counter() - t0
            found, failed = _by_member(run_dir, members, [rows[i]["id"] for i in members])
            runs.update(found)
            errors.update(failed)
        plugin_s = (time.perf_counter() - start - in_jobs - in_tasks) / max(1, len(rows))
        for i, row in enumerate(rows):
            if i in errors:
                log.error("reelflow: %s doc %s has no answer (answered ''): %s", row["task"], row["doc_id"], errors[i])
                self.failures.append({"task": row["task"], "doc_id": row["doc_id"], "error": errors[i]})
                answers[i] = GenerationResult("", SpeedCounts(output_tokens=0, speed={"failed": errors[i]}))
                continue
            run = runs[i]
            text = _cut(run.get("output_text") or "", row["until"])
            speed = sample_speed(run, method=self.method, plugin_s=plugin_s)
            speed.update({"task": row["task"], "doc_id": row["doc_id"]})
            self.records.append(speed)
            answers[i] = GenerationResult(text, SpeedCounts(output_tokens=run.get("n_generated"), speed=speed))
            self.cache_hook.add_partial("generate_until", (row["prompt"], row["gen_kwargs"]), text)
        self._report()
        return answers

    def _row(self, args: tuple) -> dict:
        context, gen_kwargs, doc_to_visual, doc_id, task, split = args
        t0 = time.perf_counter()
        visuals = doc_to_visual(self.task_dict[task][split][doc_id])
        visual_s = time.perf_counter() - t0
        visuals = visuals if isinstance(visuals, list) else [visuals]
        videos = [v for v in visuals if isinstance(v, (str, Path))]
        if len(videos) != 1 or len(visuals) != 1:
            kinds = ", ".join(type(v).__name__ for v in visuals) or "nothing"
            raise ValueError(f"reelflow answers about one video by its path; task {task} doc {doc_id} gives {kinds}")
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.get("until") or []
        setting = (int(gen_kwargs.get("max_new_tokens", self.cfg.graph.get("max_new_tokens", 256))),
                   float(gen_kwargs.get("temperature", 0) if gen_kwargs.get("do_sample", True) else 0))
        return {"id": f"{task}/{doc_id}", "task": task, "doc_id": doc_id, "video": str(videos[0]), "prompt": context,
                "gen_kwargs": gen_kwargs, "until": [until] if isinstance(until, str) else list(until),
                "setting": setting, "visual_s": visual_s}

    def _cfg_for(self, setting: tuple[int, float]):
        max_new_tokens, temperature = setting
        cfg = self.cfg.copy()
        with open_dict(cfg):
            cfg.graph.max_new_tokens = max_new_tokens
            if "sampling" in cfg.graph:
                cfg.graph.sampling.temperature = temperature
            elif temperature:
                raise ValueError(f"reelflow: experiment={self.method} decodes greedily; the task asks for "
                                 f"temperature {temperature}")
        return cfg

    def _report(self) -> None:
        """The answers' speed: speed.jsonl (one line an answer) and speed.json (medians, p90s) in
        the run dir, and lmms-eval's throughput log."""
        stats = summary(self.records)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "speed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.records))
        (self.run_dir / "speed.json").write_text(json.dumps({"method": self.method, "answers": len(self.records),
                                                             **stats, "failed": self.failures}, indent=1))
        wall = sum(r["wall_s"] or 0 for r in self.records)
        tokens = sum(r["n_generated"] or 0 for r in self.records)
        log_metrics(total_elapsed_time=wall, total_gen_tokens=tokens, avg_speed=tokens / wall if wall else 0.0,
                    additional_metrics={**flat(stats), "total_requests": len(self.records),
                                        "failed_requests": len(self.failures)})

    # ------------------------------------------------------------------------- what a graph cannot do

    def loglikelihood(self, requests):
        raise NotImplementedError(
            f"reelflow (experiment={self.method}) generates answers; it does not score log-likelihoods, which "
            "multiple-choice-by-likelihood tasks need. Use the task's generate_until variant with reelflow, or "
            "lmms-eval's own model for the checkpoint (e.g. --model qwen2_5_vl) for this task.")

    def generate_until_multi_round(self, requests):
        raise NotImplementedError(f"reelflow (experiment={self.method}) answers one question a video; "
                                  "multi-round tasks need lmms-eval's own model for the checkpoint.")


def _cut(text: str, until: list[str]) -> str:
    """The answer up to the first stop string the task gives (what lmms-eval's own models do)."""
    for stop in until:
        if stop and stop in text:
            text = text.split(stop, 1)[0]
    return text


def _by_member(run_dir: Path, members: list[int], ids: list[str]) -> tuple[dict[int, dict], dict[int, str]]:
    """Each member's own run from the job's results.jsonl, found by its request id (never by its
    place among the answered ones), or its error: ({member: metrics}, {member: error})."""
    from job.results import ResultLog

    with ResultLog(run_dir) as results:
        by_id = {row["request"]: row for row in results.rows.values()}
    runs, errors = {}, {}
    for member, request in zip(members, ids):
        row = by_id.get(request)
        if row is not None and row["status"] == "ok":
            runs[member] = row["metrics"]
        else:
            errors[member] = row["error"] if row is not None else "no result"
    return runs, errors
