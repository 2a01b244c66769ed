"""One `python -m run` job: validate, compile, execute, and leave the run dir's files.

    plan.txt       the compiled plan
    results.jsonl  several requests: one line per request as each finishes (job/results.py)
    error.txt      the traceback of each request that failed
    trace.json, timeline.png, metrics.json, summary.md     see job/report.py
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tqdm.auto import tqdm

from graph.executor import Executor, StageFailed
from job.openmp import preload_advice, runtime_in_use
from job.prepare import graph_ports, prepare
from job.report import run_metrics, write_metrics, write_trace_files
from job.results import NAME, ResultLog, outcome, prepare_run_dir, request_ids
from models.compiling import compile_records

log = logging.getLogger(__name__)


@functools.cache
def _warn_once(message: str) -> None:
    """A warning a process gives once, however many jobs it runs (lmms-eval's batches)."""
    log.warning("%s", message)


def run_job(cfg: DictConfig, requests: list[Any], run_dir: Path, *, each: bool | None = None) -> dict[str, Any]:
    """Run every request and write the run dir's files: in this process (cluster=local), or over a
    pool of Ray workers (cluster=ray, job.ray_pool). each: whether each request's result is its own,
    written to results.jsonl as it finishes, a failed request recorded while the rest go on, and
    `cluster.resume=true` goes on from the results there. None: when there are several requests, or
    a resume is asked for, or the run dir holds results (always on Ray); False, in this process: a
    caller that needs every answer, in order, or none."""
    run_dir = Path(run_dir)
    started = time.time()
    spec, plan = prepare(cfg)
    cluster = cfg.get("cluster") or {}
    on_ray = cluster.get("kind", "local") == "ray"
    if each is None:
        each = len(requests) > 1 or bool(cluster.get("resume")) or (run_dir / NAME).exists()
    if each or on_ray:
        prepare_run_dir(cfg, run_dir)     # before anything is written into the run dir
    advice = preload_advice(str((cfg.get("executor") or {}).get("openmp", "auto")))
    if advice:
        _warn_once(advice)
    note = " (Intel's is installed: LD_PRELOAD=$(python -m job.openmp) before python)" if advice else ""
    plan_text = f"{plan.to_text()}\nOpenMP runtime: {runtime_in_use()}{note}\n"
    (run_dir / "plan.txt").write_text(plan_text)
    log.info("plan:\n%s", plan_text)
    if on_ray:
        from job.ray_pool import run_on_ray

        return run_on_ray(cfg, requests, run_dir, spec, plan)
    return _run_here(cfg, requests, run_dir, spec, plan, started, each)


def _run_here(cfg: DictConfig, requests: list[Any], run_dir: Path, spec, plan, started: float,
              each: bool) -> dict[str, Any]:
    """The requests one after another in this process. each: each one's result goes to results.jsonl
    as it finishes, a request whose stage fails (a file FFmpeg cannot read) is recorded and the rest
    go on, and the requests with results are skipped; otherwise any request's failure is the job's.
    A failed run closes its executor (graph.executor), so the next request gets a new one: the
    models, cached in this process, stay loaded, but process workers start again."""
    ex_cfg = cfg.get("executor") or {}
    warmup = int(ex_cfg.get("warmup", 0))
    progress = ex_cfg.get("progress", None)
    first_token, answer = graph_ports(cfg)
    ids = request_ids(requests)

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
    trace, setup_s, elapsed = None, 0.0, 0.0
    with (ResultLog(run_dir) if each else contextlib.nullcontext()) as results:
        if results is not None:
            results.check_requests(ids)
            rows.update(results.rows)
        todo = [i for i in range(len(requests)) if rows.get(i, {}).get("status") != "ok"]
        if len(todo) < len(requests):
            log.info("resume: %d of %d requests have results; running %d", len(requests) - len(todo), len(requests),
                     len(todo))
        ex = executor() if todo else None          # nothing left to run: no models to load
        setup_s = sum(c.t1 - c.t0 for c in ex.setup_calls) if ex else 0.0
        try:
            for _ in range(warmup if todo else 0):
                try:
                    ex.run(requests[todo[0]])
                except StageFailed as e:
                    if results is None:
                        raise
                    log.warning("warm-up on %s failed (%s); it runs again as a request", ids[todo[0]], e)
                    ex = None
                    ex = executor()
                    break
            t0 = time.perf_counter()
            bar = tqdm(todo, desc="requests", unit="req", disable=None if progress is None else not progress)
            for index in bar:
                t_request = time.perf_counter()
                try:
                    result = ex.run(requests[index])
                except StageFailed as e:
                    if results is None:
                        raise
                    log.error("%s failed: %s", ids[index], e)
                    rows[index] = {"index": index, "request": ids[index], "status": "failed", "attempts": 1,
                                   "error": str(e)}
                    results.append(rows[index], e.traceback_text)
                    bar.set_postfix(failed=results.counts()[1])
                    ex = None                      # closed by its failed run; let go of its stages before the next
                    ex = executor()
                    continue
                metrics = run_metrics(result, spec, plan, first_token, answer)
                trace = trace or (result.calls, result.t_start, metrics)
                rows[index] = {"index": index, "request": ids[index], "status": "ok", "attempts": 1,
                               "latency_s": round(time.perf_counter() - t_request, 6), "metrics": metrics}
                if results is not None:
                    results.append(rows[index])
            elapsed = time.perf_counter() - t0
        finally:
            if ex is not None:
                ex.close()
    compiles = compile_records(since=started)      # the stages' models compiled at setup, before any request
    if compiles:
        with open(run_dir / "plan.txt", "a") as f:
            f.write("\nmade at setup (compiled steps, packed weights):\n"
                    + "".join(f"  {c['what']} ({c['mode']}): {c['seconds']:.1f} s\n" for c in compiles))
    per_run, failed = outcome(rows, len(requests))
    if trace is not None and (len(todo) == len(requests) or not (run_dir / "trace.json").exists()):
        write_trace_files(cfg, run_dir, spec, plan, *trace)
    throughput = {"kind": "local", "requests": len(todo), "failed": len(failed), "elapsed_s": round(elapsed, 6),
                  "throughput_rps": round(len(todo) / elapsed, 6) if elapsed > 0 else None}
    return write_metrics(cfg, run_dir, plan, per_run, setup_s=setup_s, warmup=warmup, cluster=throughput,
                         failed=failed, compiles=compiles)
