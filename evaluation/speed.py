"""Speed beside every answer: what a request's reelflow metrics say about how fast it was answered,
and their summaries (median, p90) beside a task's score.

    record = sample_speed(run, method="sparrow", plugin_s=0.002)    # run: one request's metrics
    summary(records)      # {"ttft_s": {"median": .., "p90": .., "n": ..}, "decode_tokens_per_s": {...}, ...}

Pure functions over the dicts job.report writes (`metrics.json` and its `runs`).
"""

from __future__ import annotations

import statistics

FIELDS = ("ttft_s", "decode_tokens_per_s", "wall_s", "n_generated", "mean_accepted_length", "acceptance_rate",
          "plugin_s")


def sample_speed(run: dict, *, method: str, plugin_s: float) -> dict:
    """One answer's speed from its request's metrics: time to the first token, decode tokens per
    second (the tokens after the first over the time after it), wall time, tokens generated, and
    for speculative methods the tokens committed per round (M, the papers' τ) and the acceptance
    rate; plugin_s: what the lmms-eval backend itself spent on this answer outside reelflow's run
    (and outside the task's own functions, such as its doc_to_visual)."""
    meta = run.get("tokens_meta") or {}
    n, ttft, decode = run.get("n_generated"), run.get("ttft_s"), run.get("decode_s")
    rate = (n - 1) / decode if n and n > 1 and decode else None
    return {"method": method, "ttft_s": ttft, "decode_tokens_per_s": rate, "wall_s": run.get("wall_s"),
            "n_generated": n, "mean_accepted_length": meta.get("mean_accepted_length"),
            "acceptance_rate": meta.get("acceptance_rate"), "plugin_s": plugin_s}


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, linear between the two nearest ranks."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary(records: list[dict]) -> dict:
    """Median, p90 and count of every speed field over the records that have it."""
    out = {}
    for name in FIELDS:
        values = [r[name] for r in records if isinstance(r.get(name), (int, float))]
        if values:
            out[name] = {"median": statistics.median(values), "p90": percentile(values, 0.9), "n": len(values)}
    return out


def flat(summary_: dict) -> dict:
    """summary() as one level of numbers ({"ttft_s_median": .., "ttft_s_p90": ..}), the shape
    lmms-eval's throughput log and a sweep report read."""
    return {f"{name}_{stat}": v for name, stats in summary_.items() for stat, v in stats.items() if stat != "n"}
