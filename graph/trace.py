"""What a run leaves to look at: trace.json (Chrome trace-event format; opens in Perfetto or
chrome://tracing, one process per resource and one row per worker) and timeline.png (a Gantt
chart by resource, the picture that shows overlap)."""

from __future__ import annotations

import json
from pathlib import Path


def _rows(calls: list, resources: list[str]) -> list[tuple[str, str]]:
    """(resource, worker) rows in plan order, then worker name order."""
    seen = sorted({(c.resource, c.worker) for c in calls},
                  key=lambda rw: (resources.index(rw[0]) if rw[0] in resources else len(resources), len(rw[1]), rw[1]))
    return seen


def chrome_trace(calls: list, t_start: float, resources: list[str], taps: set[tuple[str, str]], meta: dict | None = None) -> dict:
    events: list[dict] = []
    rows = _rows(calls, resources)
    pid_of = {r: i + 1 for i, r in enumerate(dict.fromkeys(r for r, _ in rows))}
    tid_of = {}
    for res, worker in rows:
        tid_of[(res, worker)] = len([k for k in tid_of if k[0] == res]) + 1
    for res, pid in pid_of.items():
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": res}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
    for (res, worker), tid in tid_of.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid_of[res], "tid": tid, "args": {"name": worker}})
    us = lambda t: round((t - t_start) * 1e6, 1)
    for c in calls:
        pid, tid = pid_of[c.resource], tid_of[(c.resource, c.worker)]
        name = c.node if c.phase == "call" else f"{c.node}:{c.phase}"
        events.append({"ph": "X", "name": name, "cat": c.phase, "pid": pid, "tid": tid, "ts": us(c.t0),
                       "dur": round((c.t1 - c.t0) * 1e6, 1),
                       "args": {"item": c.item, "busy_ms": round(c.busy * 1e3, 3), "blocked_ms": round(c.blocked * 1e3, 3)}})
        for part, t0, t1 in getattr(c, "parts", ()):     # ctx.timer parts: slices nested in the call
            events.append({"ph": "X", "name": f"{c.node}.{part}", "cat": "part", "pid": pid, "tid": tid,
                           "ts": us(t0), "dur": round((t1 - t0) * 1e6, 1), "args": {"item": c.item}})
        for port, t, _ in c.emits:
            if (c.node, port) in taps:
                events.append({"ph": "i", "s": "t", "name": f"tap {c.node}.{port}", "pid": pid, "tid": tid, "ts": us(t)})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta or {}}


def write_trace(path: Path, trace: dict) -> None:
    Path(path).write_text(json.dumps(trace))


def plot_timeline(path: Path, calls: list, t_start: float, resources: list[str], taps: set[tuple[str, str]],
                  title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(calls, resources)
    nodes = list(dict.fromkeys(c.node for c in sorted(calls, key=lambda c: c.t0)))
    cmap = plt.get_cmap("tab10" if len(nodes) <= 10 else "tab20")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(nodes)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.55 * max(1, len(rows))))
    for y, (res, worker) in enumerate(rows):
        for c in calls:
            if (c.resource, c.worker) != (res, worker):
                continue
            x0, w = c.t0 - t_start, max(c.t1 - c.t0, 1e-6)
            ax.broken_barh([(x0, w)], (y - 0.38, 0.76), facecolors=color[c.node],
                           edgecolors="black", linewidth=0.3, alpha=0.55 if c.phase != "call" else 0.95)
            if c.blocked > 0.2 * w:  # shade calls that mostly waited on a full channel
                ax.broken_barh([(x0, w)], (y - 0.38, 0.76), facecolors="none", hatch="///", edgecolors="grey", linewidth=0)
            for port, t, _ in c.emits:
                if (c.node, port) in taps:
                    ax.plot([t - t_start] * 2, [y - 0.45, y + 0.45], color="black", linewidth=1.2)
    ax.set_yticks(range(len(rows)), [w if w == r else f"{r}: {w}" for r, w in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds since run start")
    handles = [matplotlib.patches.Patch(color=color[n], label=n) for n in nodes]
    if taps:
        handles.append(matplotlib.lines.Line2D([], [], color="black", label="tap published"))
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5), frameon=False, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
