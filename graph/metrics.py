"""Run metrics as pure functions of the executor's call records.

`ideal_wall_s` replays the run with every call taking exactly its measured busy time and no
scheduling cost: a call starts when its inputs were emitted (a tap counts from the moment it was
published, not when its producer returned), its node's previous call has ended (and, for its first
call, the nodes it waits for with `after:` have), and a worker of its resource is free. That is the
best this graph could do on these resources with these stages, so `wall_s / ideal_wall_s` is the
executor's efficiency, and (wall − ideal) / calls its overhead.
"""

from __future__ import annotations

import heapq
import math
import resource as _resource
import sys
from typing import Any, Iterable


def ideal_schedule(calls: Iterable[Any], workers: dict[str, int], pins: dict[str, int | None],
                   after: dict[str, tuple[str, ...]] | None = None) -> dict[int, tuple[float, float]]:
    """call id -> (ideal start, ideal end), seconds from the run's start. after: node -> the
    nodes whose last call must end before its first starts (the graph's `after:`)."""
    after = after or {}
    slots = {r: [0.0] * n for r, n in workers.items()}           # free time of each worker
    pinned_free: dict[tuple[str, int], float] = {}
    node_end: dict[str, float] = {}
    out: dict[int, tuple[float, float]] = {}
    for c in sorted(calls, key=lambda c: c.t0):
        waits = [node_end.get(a, 0.0) for a in after.get(c.node, ())] if c.node not in node_end else []
        ready = max([out[pid][0] + off for pid, off in c.deps if pid in out] + [node_end.get(c.node, 0.0)] + waits)
        pin = pins.get(c.node)
        if pin is not None:
            start = max(ready, pinned_free.get((c.resource, pin), 0.0))
            pinned_free[(c.resource, pin)] = start + c.busy
        else:
            heap = slots[c.resource]
            free = heapq.heappop(heap)
            start = max(ready, free)
            heapq.heappush(heap, start + c.busy)
        out[c.id] = (start, start + c.busy)
        node_end[c.node] = start + c.busy
    return out


def ideal_wall_s(calls: list, workers: dict[str, int], pins: dict[str, int | None],
                 after: dict[str, tuple[str, ...]] | None = None) -> float:
    sched = ideal_schedule(calls, workers, pins, after)
    return max((end for _, end in sched.values()), default=0.0)


def stage_stats(calls: Iterable[Any], resources: dict[str, str], t_start: float = 0.0) -> dict[str, dict]:
    """Per node: busy, blocked and engine seconds, calls, the span from its first call's start
    to its last call's end (start_s, end_s: seconds from `t_start`, the run's start), for a
    stage that timed parts of its calls (ctx.timer), `timers`: {name: {"s": total, "n": count, "min": the shortest}},
    and for one that counted (ctx.count), `counts`: {name: the sum over its calls}."""
    stats: dict[str, dict] = {}
    for c in calls:
        s = stats.setdefault(c.node, {"busy_s": 0.0, "calls": 0, "blocked_s": 0.0, "engine_s": 0.0,
                                      "resource": resources[c.node], "start_s": math.inf, "end_s": -math.inf})
        s["busy_s"] += c.busy
        s["blocked_s"] += c.blocked
        s["engine_s"] += c.engine
        s["calls"] += c.phase == "call"
        for part, t0, t1 in getattr(c, "parts", ()):
            timer = s.setdefault("timers", {}).setdefault(part, {"s": 0.0, "n": 0, "min": math.inf})
            timer["s"] += t1 - t0
            timer["n"] += 1
            timer["min"] = min(timer["min"], t1 - t0)
        for name, amount in getattr(c, "counts", {}).items():
            counts = s.setdefault("counts", {})
            counts[name] = counts.get(name, 0) + amount
        if c.phase != "setup":
            s["start_s"], s["end_s"] = min(s["start_s"], c.t0 - t_start), max(s["end_s"], c.t1 - t_start)
    for s in stats.values():           # a node that only ran its setup has no span
        if s["start_s"] == math.inf:
            s["start_s"] = s["end_s"] = None
    rounded = ("busy_s", "blocked_s", "engine_s", "start_s", "end_s")
    for s in stats.values():
        for timer in s.get("timers", {}).values():
            timer["s"], timer["min"] = round(timer["s"], 6), round(timer["min"], 6)
    return {k: {**v, **{r: round(v[r], 6) for r in rounded if v[r] is not None}} for k, v in stats.items()}


def resource_busy(calls: Iterable[Any]) -> dict[str, float]:
    busy: dict[str, float] = {}
    for c in calls:
        busy[c.resource] = busy.get(c.resource, 0.0) + c.busy
    return {k: round(v, 6) for k, v in busy.items()}


def peak_memory() -> dict[str, int | None]:
    rss = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss
    children = _resource.getrusage(_resource.RUSAGE_CHILDREN).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    cuda = None
    try:
        import torch

        if torch.cuda.is_available():
            cuda = int(torch.cuda.max_memory_allocated())
    except ImportError:
        pass
    return {"peak_rss_bytes": int(rss * scale), "peak_children_rss_bytes": int(children * scale),
            "peak_cuda_bytes": cuda}


def cpu_seconds() -> float | None:
    """CPU seconds (user + system) used so far by this process, all its threads, and its child
    processes, live (read from /proc) or reaped: the work a run did on the cores, wherever it ran
    (decoder processes included). None where /proc is missing."""
    import os

    me, reaped = _resource.getrusage(_resource.RUSAGE_SELF), _resource.getrusage(_resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + reaped.ru_utime + reaped.ru_stime
    if not os.path.isdir("/proc/self"):
        return None
    tick, parent = os.sysconf("SC_CLK_TCK"), os.getpid()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()      # after "(comm)", which may hold spaces
        except OSError:
            continue                                               # gone meanwhile
        if int(fields[1]) == parent:                               # fields: state ppid ... utime(11) stime(12)
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def mean_tree(runs: list[dict]) -> dict:
    """The mean of every numeric leaf the runs share (nested dicts recursed; lists of numbers of
    one length averaged element by element, e.g. per-position acceptance; booleans, strings and
    other lists skipped): the summary of a multi-request run."""
    out: dict = {}
    for key in runs[0]:
        values = [r.get(key) for r in runs]
        if all(isinstance(v, dict) for v in values):
            sub = mean_tree(values)
            if sub:
                out[key] = sub
        elif all(_number(v) for v in values):
            out[key] = round(sum(values) / len(values), 6)
        elif (all(isinstance(v, list) and v and all(map(_number, v)) for v in values)
              and len({len(v) for v in values}) == 1):
            out[key] = [round(sum(col) / len(col), 6) for col in zip(*values)]
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
