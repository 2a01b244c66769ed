"""One `python -m run` job: validate, compile, execute, and leave the run dir's files.

    plan.txt       the compiled plan
    trace.json, timeline.png, metrics.json, summary.md     see job/report.py
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tqdm.auto import tqdm

from graph.executor import Executor, RunResult
from job.openmp import runtime_in_use
from job.prepare import graph_ports, prepare
from job.report import run_metrics, write_metrics, write_trace_files
from models.compiling import compile_records

log = logging.getLogger(__name__)


def run_job(cfg: DictConfig, requests: list[Any], run_dir: Path) -> dict[str, Any]:
    """Run every request and write the run dir's files: in this process (cluster=local), or over a
    pool of Ray workers (cluster=ray, job.ray_pool)."""
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
    ex_cfg = cfg.get("executor") or {}
    warmup = int(ex_cfg.get("warmup", 0))
    progress = ex_cfg.get("progress", None)
    first_token, answer = graph_ports(cfg)
    results: list[RunResult] = []
    with Executor(spec, plan, cancel_timeout_s=float(ex_cfg.get("cancel_timeout_s", 10.0)), progress=progress,
                  record=tuple(p for p in (answer,) if p)) as ex:
        for _ in range(warmup):
            ex.run(requests[0])
        t0 = time.perf_counter()
        for request in tqdm(requests, desc="requests", unit="req", disable=None if progress is None else not progress):
            results.append(ex.run(request))
        elapsed = time.perf_counter() - t0
        setup_s = sum(c.t1 - c.t0 for c in ex.setup_calls)
    compiles = compile_records(since=started)      # the stages' models compiled at setup, before any request
    if compiles:
        with open(run_dir / "plan.txt", "a") as f:
            f.write("\nmade at setup (compiled steps, packed weights):\n"
                    + "".join(f"  {c['what']} ({c['mode']}): {c['seconds']:.1f} s\n" for c in compiles))
    per_run = [run_metrics(r, spec, plan, first_token, answer) for r in results]
    first = results[0]
    write_trace_files(cfg, run_dir, spec, plan, first.calls, first.t_start, per_run[0])
    throughput = {"kind": "local", "requests": len(per_run), "elapsed_s": round(elapsed, 6),
                  "throughput_rps": round(len(per_run) / elapsed, 6) if elapsed > 0 else None}
    return write_metrics(cfg, run_dir, plan, per_run, setup_s=setup_s, warmup=warmup, cluster=throughput,
                         compiles=compiles)
