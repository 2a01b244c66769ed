"""Turn a multirun dir into report.md (a table), report.csv (every scalar) and report.png.

    python -m graph.report outputs/multirun/2026-11-22/10-00-00_bench_engine

It also runs by itself at the end of every `python -m run -m ...` (a Hydra callback). What to
show comes from the experiment's `report:` block, all optional:

    report:
      columns: [graph, executor.runner, wall_s, efficiency]   # override keys, then metric keys
      baseline: {executor.runner: sequential}                 # adds speedup = baseline wall / wall
      plots:
        - {x: executor.runner, y: wall_s, hue: graph, where: {graph: demo}, title: ...}

Without it: the swept keys, wall/ttft/decode/ideal/efficiency, and one bar plot of wall_s.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)
DEFAULT_METRICS = ["wall_s", "ttft_s", "decode_s", "ideal_wall_s", "efficiency"]


def _flatten(d: dict, prefix: str = "", depth: int = 2) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth > 0:
            out.update(_flatten(v, key + ".", depth - 1))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def _parse_value(v: str) -> Any:
    try:
        return yaml.safe_load(v)
    except yaml.YAMLError:
        return v


def collect(sweep_dir: Path) -> tuple[list[dict], list[str], dict]:
    """Rows (one per job), the swept keys, and the report spec of the first job."""
    rows, spec = [], {}
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()),
                  key=lambda p: (0, int(p.name), "") if p.name.isdigit() else (1, 0, p.name))
    for job in jobs:
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
        row: dict[str, Any] = {"job": job.name, "_overrides": []}
        for o in overrides:
            key, _, value = o.partition("=")
            row[key.lstrip("+~")] = _parse_value(value)
            row["_overrides"].append(key.lstrip("+~"))
        if not spec:
            cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text()) or {}
            spec = cfg.get("report") or {}
        metrics_file, err = job / "metrics.json", job / "error.txt"
        try:
            row.update(_flatten(json.loads(metrics_file.read_text())))
            row["status"] = "ok"
        except FileNotFoundError:
            first = (err.read_text().splitlines() or ["(empty error.txt)"])[0] if err.is_file() else "no metrics.json"
            row["status"] = "failed: " + first[:120]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            row["status"] = f"failed: unreadable metrics.json ({e})"
        rows.append(row)
    override_keys = list(dict.fromkeys(k for r in rows for k in r.pop("_overrides")))
    swept = [k for k in override_keys if len({json.dumps(r.get(k), default=str) for r in rows}) > 1]
    return rows, swept, spec


def add_speedup(rows: list[dict], swept: list[str], baseline: dict) -> None:
    """speedup = wall of the matching baseline row / wall; rows match on the other swept keys."""
    others = [k for k in swept if k not in baseline]
    base = {tuple(r.get(k) for k in others): r for r in rows
            if all(r.get(k) == v for k, v in baseline.items()) and isinstance(r.get("wall_s"), (int, float))}
    for r in rows:
        b = base.get(tuple(r.get(k) for k in others))
        if b and isinstance(r.get("wall_s"), (int, float)) and r["wall_s"] > 0:
            r["speedup"] = round(b["wall_s"] / r["wall_s"], 3)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if not math.isnan(v) else "nan"
    return "" if v is None else str(v)


def markdown(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)).replace("|", "\\|").replace("\n", " ") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], plots: list[dict], path: Path, swept: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plots), figsize=(6 * len(plots), 4.2), squeeze=False)
    for ax, p in zip(axes[0], plots):
        sel = [r for r in rows if all(r.get(k) == v for k, v in (p.get("where") or {}).items())]
        ys = p["y"] if isinstance(p["y"], list) else [p["y"]]
        x = p.get("x")
        hue = p.get("hue")
        labels = [" ".join(f"{r.get(k)}" for k in ([x] if x else [k for k in swept])) or r["job"] for r in sel]
        groups = sorted({r.get(hue) for r in sel}, key=str) if hue else [None]
        series = [(y, g) for y in ys for g in groups]
        xs = list(dict.fromkeys(labels))
        width = 0.8 / max(1, len(series))
        for i, (y, g) in enumerate(series):
            vals = []
            for lab in xs:
                match = [r for r, l in zip(sel, labels) if l == lab and (hue is None or r.get(hue) == g)]
                v = match[0].get(y) if match else None
                vals.append(v if isinstance(v, (int, float)) else float("nan"))
            label = " ".join(str(s) for s in (y if len(ys) > 1 else None, g) if s is not None) or y
            if p.get("kind") == "line":
                ax.plot(xs, vals, marker="o", label=label)
            else:
                ax.bar([j + i * width for j in range(len(xs))], vals, width, label=label)
        if p.get("kind") != "line":
            ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(xs))], xs, rotation=20, ha="right")
        ax.set_xlabel(x or "job")
        ax.set_ylabel(ys[0] if len(ys) == 1 else "value")
        ax.set_title(p.get("title") or f"{', '.join(ys)} by {x or 'job'}", fontsize=10)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(sweep_dir: str | Path) -> dict[str, Path]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such directory")
    rows, swept, spec = collect(sweep_dir)
    if not rows:
        raise FileNotFoundError(f"{sweep_dir}: no job dirs (with .hydra/) inside; is it a multirun dir?")
    if spec.get("baseline"):
        add_speedup(rows, swept, spec["baseline"])
    columns = spec.get("columns") or ((swept or ["job"]) + [m for m in DEFAULT_METRICS if any(r.get(m) is not None for r in rows)])
    if any("speedup" in r for r in rows) and "speedup" not in columns:
        columns = columns + ["speedup"]
    if any(r["status"] != "ok" for r in rows):
        columns = columns + ["status"]
    out = {"md": sweep_dir / "report.md", "csv": sweep_dir / "report.csv", "png": sweep_dir / "report.png"}
    title = f"# report: {sweep_dir.name}\n\n{len(rows)} jobs; swept: {', '.join(swept) or 'nothing'}\n\n"
    out["md"].write_text(title + markdown(rows, columns))
    all_cols = list(dict.fromkeys(k for r in rows for k in r))
    with out["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=all_cols)
        w.writeheader()
        w.writerows(rows)
    plots = spec.get("plots") or [{"y": "wall_s", "title": "wall time (s) per job"}]
    plot(rows, plots, out["png"], swept)
    return out


try:
    from hydra.experimental.callback import Callback
except ImportError:  # hydra missing: the CLI below still works
    Callback = object  # type: ignore[misc,assignment]


class ReportCallback(Callback):
    """Writes the report into the sweep dir when a multirun ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            out = write_report(sweep_dir)
            log.info("report: %s", out["md"])
            print(Path(out["md"]).read_text())
        except Exception as e:  # a report problem must not fail a finished sweep
            log.error("report for %s failed: %s", sweep_dir, e)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m graph.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", help="a multirun dir (outputs/multirun/...)")
    args = ap.parse_args(argv)
    try:
        out = write_report(args.sweep_dir)
    except (FileNotFoundError, yaml.YAMLError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(out["md"].read_text())
    print(f"wrote {out['md']}, {out['csv']}, {out['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
