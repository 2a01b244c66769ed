"""One `python -m run` job: validate, compile, execute, and leave the run dir's files.

    plan.txt       the compiled plan
    results.jsonl  several requests: one line per request as each finishes (job/results.py)
    error.txt      the traceback of each request that failed
    trace.json, timeline.png, metrics.json, summary.md     see job/report.py
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from graph.executor import Executor, StageFailed
from job.openmp import runtime_in_use
from job.prepare import graph_ports, prepare
from job.report import run_metrics, write_metrics, write_trace_files
from job.results import RequestsFailed, ResultLog, prepare_run_dir, request_ids
from models.compiling import compile_records

log = logging.getLogger(__name__)


def run_job(cfg: DictConfig, requests: list[Any], run_dir: Path, *, each: bool | None = None) -> dict[str, Any]:
    """Run every request and write the run dir's files: in this process (cluster=local), or over a
    pool of Ray workers (cluster=ray, job.ray_pool). each (here): whether each request's result is
    its own, written to results.jsonl as it finishes, a failed request recorded while the rest go on
    (None: when there are several); False for a caller that needs every answer, in order, or none."""
    run_dir = Path(run_dir)
    started = time.time()
    spec, plan = prepare(cfg)
    plan_text = f"{plan.to_text()}\nOpenMP runtime: {runtime_in_use()}\n"
    (run_dir / "plan.txt").write_text(plan_text)
    log.info("plan:\n%s", plan_text)
    cluster = cfg.get("cluster") or {}
    if cluster.get("kind", "local") == "ray":
        from job.ray_pool import run_on_ray

        return run_on_ray(cfg, requests, run_dir, spec, plan)
    return _run_here(cfg, requests, run_dir, spec, plan, started, len(requests) > 1 if each is None else each)


def _run_here(cfg: DictConfig, requests: list[Any], run_dir: Path, spec, plan, started: float,
              many: bool) -> dict[str, Any]:
    """The requests one after another in this process. many: each one's result goes to results.jsonl
    as it finishes, a request whose stage fails (a file FFmpeg cannot read) is recorded and the rest
    go on on a fresh executor (the models stay loaded), and `cluster.resume=true` skips the requests
    that have results; otherwise any request's failure is the job's."""
    ex_cfg = cfg.get("executor") or {}
    warmup = int(ex_cfg.get("warmup", 0))
    progress = ex_cfg.get("progress", None)
    first_token, answer = graph_ports(cfg)
    ids = request_ids(requests)
    if many:
        prepare_run_dir(OmegaConf.to_container(cfg.cluster, resolve=True) if cfg.get("cluster") else {}, run_dir)

    def executor() -> Executor:
        ex = Executor(spec, plan, cancel_timeout_s=float(ex_cfg.get("cancel_timeout_s", 10.0)), progress=progress,
                      record=tuple(p for p in (answer,) if p))
        try:
            ex.setup()
        except BaseException:
            ex.close()
            raise
        return ex

    rows: dict[int, dict] = {}
    trace = None
    with (ResultLog(run_dir) if many else contextlib.nullcontext()) as results:
        if many:
            results.check_requests(ids)
            rows.update(results.rows)
        todo = [i for i in range(len(requests)) if rows.get(i, {}).get("status") != "ok"]
        if len(todo) < len(requests):
            log.info("resume: %d of %d requests have results; running %d", len(requests) - len(todo), len(requests),
                     len(todo))
        ex = executor()
        setup_s = sum(c.t1 - c.t0 for c in ex.setup_calls)
        try:
            for _ in range(warmup if todo else 0):
                try:
                    ex.run(requests[todo[0]])
                except StageFailed as e:
                    if not many:
                        raise
                    log.warning("warm-up on %s failed (%s); it runs again as a request", ids[todo[0]], e)
                    ex.close()
                    ex = executor()
                    break
            t0 = time.perf_counter()
            bar = tqdm(todo, desc="requests", unit="req", disable=None if progress is None else not progress)
            for index in bar:
                t_request = time.perf_counter()
                try:
                    result = ex.run(requests[index])
                except StageFailed as e:
                    if not many:
                        raise
                    log.error("%s failed: %s", ids[index], e)
                    rows[index] = {"index": index, "request": ids[index], "status": "failed", "attempts": 1,
                                   "error": str(e)}
                    results.append(rows[index], e.traceback_text)
                    bar.set_postfix(failed=sum(r["status"] != "ok" for r in rows.values()))
                    ex.close()            # its workers may hold the failed run's state: a fresh one for the next
                    ex = executor()
                    continue
                metrics = run_metrics(result, spec, plan, first_token, answer)
                trace = trace or (result.calls, result.t_start, metrics)
                rows[index] = {"index": index, "request": ids[index], "status": "ok", "attempts": 1,
                               "latency_s": round(time.perf_counter() - t_request, 6), "metrics": metrics}
                if many:
                    results.append(rows[index])
            elapsed = time.perf_counter() - t0
        finally:
            ex.close()
    compiles = compile_records(since=started)      # the stages' models compiled at setup, before any request
    if compiles:
        with open(run_dir / "plan.txt", "a") as f:
            f.write("\nmade at setup (compiled steps, packed weights):\n"
                    + "".join(f"  {c['what']} ({c['mode']}): {c['seconds']:.1f} s\n" for c in compiles))
    ordered = [rows[i] for i in range(len(requests)) if i in rows]
    per_run = [r["metrics"] for r in ordered if r["status"] == "ok"]
    failed = [{"request": r["request"], "error": r["error"], "attempts": r.get("attempts", 1)}
              for r in ordered if r["status"] != "ok"]
    if not per_run:
        raise RequestsFailed(f"every request failed; the first: {failed[0]['request']}: {failed[0]['error']}")
    if trace is not None and (len(todo) == len(requests) or not (run_dir / "trace.json").exists()):
        write_trace_files(cfg, run_dir, spec, plan, *trace)
    throughput = {"kind": "local", "requests": len(todo), "failed": len(failed), "elapsed_s": round(elapsed, 6),
                  "throughput_rps": round(len(todo) / elapsed, 6) if elapsed > 0 else None}
    return write_metrics(cfg, run_dir, plan, per_run, setup_s=setup_s, warmup=warmup, cluster=throughput,
                         failed=failed, compiles=compiles)
