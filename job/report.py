"""What a job's runs become: each request's metrics (from the executor's result and the ports the
job knows), the trace files of the first run, and metrics.json with summary.md; the same files
whether the requests ran here or on Ray workers.

    trace.json     Chrome trace events of the (first) measured run
    timeline.png   Gantt chart by resource of the same run
    metrics.json   the keys of docs/design.md that apply, plus the engine's own (ideal time, overhead)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from graph.executor import RunResult
from graph.metrics import ideal_wall_s, mean_tree, peak_memory, resource_busy, stage_stats
from graph.schedule import Plan
from graph.spec import GraphSpec
from graph.trace import chrome_trace, plot_timeline, write_trace
from job.openmp import runtime_in_use

log = logging.getLogger(__name__)


def run_metrics(result: RunResult, spec: GraphSpec, plan: Plan, first_token: str | None,
                answer: str | None = None) -> dict[str, Any]:
    calls = [c for c in result.calls]
    workers = {r.name: (1 if plan.runner == "sequential" else r.workers) for r in plan.resources}
    pins = {n.name: (n.worker if plan.runner == "threaded" else None) for n in plan.nodes}
    ideal = ideal_wall_s(calls, workers, pins, {n.name: n.after for n in plan.nodes if n.after})
    wall = result.wall_s
    n_calls = len(calls)
    ttft = result.port_times.get(first_token, {}).get("first_s") if first_token else None
    # the answer: a sink item with ids that is not the first-token signal
    tokens = result.outputs.get(answer) if answer else None
    tokens = tokens or next((v for k, v in result.outputs.items() if hasattr(v, "ids") and k != first_token), None)
    reported: dict[str, Any] = {}
    for value in result.outputs.values():  # sink items may describe themselves (VideoInfo, ...)
        for v in value if isinstance(value, list) else [value]:
            if callable(getattr(v, "metrics", None)):
                reported.update(v.metrics())
    n_visual = (getattr(tokens, "meta", None) or {}).get("n_video_tokens")
    if n_visual is not None and isinstance(reported.get("video"), dict):
        reported["video"]["n_video_tokens"] = n_visual
    return {
        **reported,
        "request": getattr(result.request, "id", None),
        "output_text": getattr(tokens, "text", None),
        "output_ids": list(tokens.ids) if tokens is not None else None,
        "n_generated": len(tokens.ids) if tokens is not None else None,
        "wall_s": round(wall, 6),
        "ttft_s": round(ttft, 6) if ttft is not None else None,
        "decode_s": round(wall - ttft, 6) if ttft is not None else None,
        "ideal_wall_s": round(ideal, 6),
        "efficiency": round(ideal / wall, 4) if wall > 0 else None,
        "n_calls": n_calls,
        "overhead_per_call_us": round((wall - ideal) / n_calls * 1e6, 2) if n_calls else None,
        "busy_s": round(sum(c.busy for c in calls), 6),
        "cpu_s": result.cpu_s,
        "cores": plan.cores,
        "stages": stage_stats(calls, {n.name: n.resource for n in plan.nodes}, result.t_start),
        "resources": resource_busy(calls),
        "ports": {k: {kk: (round(vv, 6) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                  for k, v in result.port_times.items()},
        "tokens_meta": _details(tokens),
    }


def _details(tokens: Any) -> dict | None:
    """What the answer's stage says about it (stages.types.Tokens.details), for tokens_meta."""
    if tokens is None:
        return None
    return tokens.details() if callable(getattr(tokens, "details", None)) else dict(getattr(tokens, "meta", {}) or {})


def summary_table(per_run: list[dict], summary: dict, failed: list[dict] | None = None) -> str:
    """Markdown: one row per request (its score, if any, and timings), the means, the requests that
    failed with their errors, and the mean busy time per stage."""
    score_keys = list(per_run[0].get("score") or {})
    cols = ["request", *score_keys, "n_generated", "wall_s", "ttft_s", "decode_s"]

    def cell(v):
        return f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))

    def row(m, name=None):
        values = [name or m.get("request"), *[(m.get("score") or {}).get(k) for k in score_keys],
                  *[m.get(k) for k in cols[1 + len(score_keys):]]]
        return "| " + " | ".join(cell(v) for v in values) + " |"

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols), *[row(m) for m in per_run], row(summary, "**mean**")]
    if failed:
        lines += ["", "| failed request | attempts | error |", "|---|---|---|"]
        lines += [f"| {f['request']} | {f['attempts']} | {' '.join(str(f['error']).split())[:300]} |" for f in failed]
    lines += ["", "| stage | mean busy_s | calls |", "|---|---|---|"]
    for node, st in (summary.get("stages") or {}).items():
        lines.append(f"| {node} | {cell(st.get('busy_s'))} | {cell(st.get('calls'))} |")
    return "\n".join(lines) + "\n"


def _model_name(entry: Any) -> str | None:
    return entry.get("name") or entry.get("path") if isinstance(entry, dict) else entry


def write_trace_files(cfg: DictConfig, run_dir: Path, spec: GraphSpec, plan: Plan, calls: list, t_start: float,
                      m0: dict) -> None:
    """trace.json and timeline.png of one run (the first request's)."""
    taps = {(n, p) for n, node in spec.nodes.items() for p, o in node.out_ports.items() if o.tap}
    res_names = [r.name for r in plan.resources]
    write_trace(run_dir / "trace.json", chrome_trace(calls, t_start, res_names, taps,
                                                     {"experiment": cfg.get("experiment"), "runner": plan.runner}))
    title = (f"{cfg.get('experiment') or 'run'} ({plan.runner}): wall {m0['wall_s']:.3f} s, "
             f"ideal overlapped {m0['ideal_wall_s']:.3f} s ({100 * (m0['efficiency'] or 0):.0f} %)")
    plot_timeline(run_dir / "timeline.png", calls, t_start, res_names, taps, title)


def write_metrics(cfg: DictConfig, run_dir: Path, plan: Plan, per_run: list[dict], *, setup_s: float, warmup: int,
                  cluster: dict | None = None, failed: list[dict] | None = None,
                  compiles: list[dict] | None = None) -> dict[str, Any]:
    """metrics.json (and summary.md for several requests) from the requests' metrics, in request
    order: the same files whether the requests ran here or on Ray workers. failed: rows of the
    requests that have no result ({request, error, attempts}), listed in both files. compiles:
    what the job compiled at setup ({what, mode, seconds}; part of setup_s)."""
    m0 = per_run[0]
    model = OmegaConf.to_container(cfg.model, resolve=True) if cfg.get("model") else {}
    metrics: dict[str, Any] = {
        "experiment": cfg.get("experiment"),
        "model": {role: _model_name(model.get(role)) for role in ("target", "draft")},
        "video": m0.get("video"),
        "runner": plan.runner,
        "openmp": runtime_in_use(),      # the CPU kernels' OpenMP runtime (job/openmp.py)
        "setup_s": round(setup_s, 6),
        # null where the compiles happened in other processes (Ray workers), which this one cannot see
        "compile": None if compiles is None else {"seconds": round(sum(c["seconds"] for c in compiles), 3),
                                                  "what": compiles},
        "warmup_runs": warmup,
        **{k: v for k, v in m0.items() if k != "request"},
        "memory": peak_memory(),
    }
    metrics["summary"] = mean_tree(per_run)     # with one request: its own figures (sweeps read summary.*)
    if cluster:
        metrics["cluster"] = cluster
    if failed:
        metrics["failed"] = failed
    if len(per_run) > 1 or failed:
        metrics["runs"] = per_run
        metrics["wall_s_mean"] = round(sum(m["wall_s"] for m in per_run) / len(per_run), 6)
        (run_dir / "summary.md").write_text(summary_table(per_run, metrics["summary"], failed))
        log.info("%d requests%s; means: %s", len(per_run), f", {len(failed)} failed" if failed else "", ", ".join(
            f"{k} {v}" for k, v in {**metrics["summary"].get("score", {}), "wall_s": metrics["summary"].get("wall_s")}.items()))
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str))
    return metrics
