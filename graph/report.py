"""Turn a multirun dir into report.md (a table), report.csv (every scalar) and report.png.

    python -m graph.report outputs/multirun/2026-11-22/10-00-00_bench_engine

It also runs by itself at the end of every `python -m run -m ...` (a Hydra callback). What to
show comes from the experiment's `report:` block, all optional:

    report:
      columns: [graph, executor.runner, wall_s, efficiency]   # override keys, metric keys, config keys
      baseline: {executor.runner: sequential}                 # adds speedup = baseline wall / wall
      relative:                                               # a column over the baseline row's
        - {name: f1_retention, of: summary.score.f1, baseline: {case: ar}}
      formulas: job.bounds                                    # a module whose __all__ functions derived may call
      derived:                                                # arithmetic over a row's columns
        generation_s: wall_s - ttft_s                         # (+ - * /, min, max, numbers, formulas)
        gain_s: {expr: seq.ttft_s - ttft_s, where: {case: overlapped}, with: {seq: {case: sequential}}}
      plots:
        - {x: executor.runner, y: wall_s, hue: graph, where: {graph: demo}, title: ...}
        - {x: case, y: [a_s, b_s], kind: stacked, where: {case: [ar, sequential]}}
        - {y: per_position_acceptance, kind: profile, hue: case, xlabel: position}   # a list-valued column
        - {x: samples_per_gop, y: ratio, hue: case, kind: line, logx: true, hline: 1}   # numeric x, a level
      repeat: bench.repeat                                    # a swept key whose values are repeats
      legend: {wall_s: "seconds a request took"}              # what a column means, under the table

A row holds the job's overrides, its metrics.json (nested keys joined by dots) and, for keys
neither sets, its composed config (e.g. graph.prune.ratio). `where` values may be lists (any
of). Rows match their baseline on the other swept keys. Every swept key is a column, listed in
`columns:` or not. Without a `report:` block: the swept keys, wall/ttft/decode/ideal/efficiency,
and one bar plot of wall_s.

A column, a `relative:` source or a name in a `derived:` expression that no job has and the block
does not define is an error naming it and the closest metrics there are, not an empty column. A
derived column only some methods have is marked `optional: true` (`{expr: ..., optional: true}`):
blank when the sweep runs none of them.

`repeat:` names a swept key that only numbers repeats of the same jobs (`bench.repeat=0,1,2`, put
before the compared key on the command line so that Hydra alternates them: ar, sparrow, ar,
sparrow, ...). Derived and relative columns then pair each job with the baseline of its own repeat,
and report.md adds a table with one row per setting: each number the median over the repeats, with
the range beside it; the plots show the medians. On a machine whose speed drifts from one minute to
the next, a ratio of two jobs run minutes apart measures the drift as much as the methods.
"""

from __future__ import annotations

import argparse
import ast
import csv
import difflib
import importlib
import json
import logging
import math
import operator
import statistics
import sys
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)
DEFAULT_METRICS = ["wall_s", "ttft_s", "decode_s", "ideal_wall_s", "efficiency"]


def _flatten(d: dict, prefix: str = "", depth: int = 4) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and depth > 0:
            out.update(_flatten(v, key + ".", depth - 1))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
        elif (isinstance(v, list) and v and not key.endswith("_ids")
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)):
            out[key] = v        # a profile (per position, per tenth of the video; not token ids): `kind: profile`
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
            metrics = json.loads(metrics_file.read_text())
            row.update(_flatten(metrics))
            row["status"] = "ok"
            # a job of several requests goes on past a failed one: its means are over fewer requests
            row["failed_requests"] = len(metrics.get("failed") or [])
        except FileNotFoundError:
            first = (err.read_text().splitlines() or ["(empty error.txt)"])[0] if err.is_file() else "no metrics.json"
            row["status"] = "failed: " + first[:120]
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            row["status"] = f"failed: unreadable metrics.json ({e})"
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text()) or {}
        for key, value in _flatten({k: v for k, v in config.items() if k not in ("hydra", "report")}, depth=8).items():
            row.setdefault(key, value)
        rows.append(row)
    override_keys = list(dict.fromkeys(k for r in rows for k in r.pop("_overrides")))
    swept = [k for k in override_keys if len({json.dumps(r.get(k), default=str) for r in rows}) > 1]
    return rows, swept, spec


def _matches(row: dict, where: dict) -> bool:
    return all(row.get(k) in v if isinstance(v, list) else row.get(k) == v for k, v in (where or {}).items())


def add_relative(rows: list[dict], swept: list[str], baseline: dict, of: str, name: str, invert: bool = False) -> None:
    """row[name] = row[of] / (the matching baseline row's [of]), or its inverse; rows match on
    the swept keys the baseline does not fix."""
    others = [k for k in swept if k not in baseline]
    base = {tuple(r.get(k) for k in others): r for r in rows
            if _matches(r, baseline) and isinstance(r.get(of), (int, float))}
    for r in rows:
        b = base.get(tuple(r.get(k) for k in others))
        mine, theirs = r.get(of), (b or {}).get(of)
        if not (isinstance(mine, (int, float)) and isinstance(theirs, (int, float))):
            continue
        num, den = (theirs, mine) if invert else (mine, theirs)
        if den:
            r[name] = round(num / den, 4)


def add_speedup(rows: list[dict], swept: list[str], baseline: dict) -> None:
    """speedup = wall of the matching baseline row / wall; rows match on the other swept keys."""
    add_relative(rows, swept, baseline, "wall_s", "speedup", invert=True)


class ReportError(ValueError):
    """The report block asks for something no job has."""


def load_formulas(module: str | None) -> dict[str, Any]:
    """The functions a `formulas:` module exports (its __all__), by name; imported by its dotted
    name, so the engine's report depends on no module of the product."""
    if not module:
        return {}
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ReportError(f"formulas: {module}: {e}") from None
    return {name: getattr(mod, name) for name in getattr(mod, "__all__", [])}


def expression_columns(expression: str) -> set[str]:
    """The (dotted) column names an expression reads; `alias.column` included as written."""
    names = set()
    for node in ast.walk(ast.parse(expression, mode="eval")):
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Del):
            names.add(ast.unparse(node))
        elif isinstance(node, ast.Name):
            names.add(node.id)
    # a.b.c is walked as a.b.c, a.b and a: keep the longest dotted names only
    return {n for n in names if not any(o != n and o.startswith(n + ".") for o in names)}


def legend(meanings: dict | None, columns: list[str]) -> str:
    """Markdown under the table: what each shown column means, from the block's `legend:`
    (column -> a sentence), in the table's order."""
    lines = [f"- `{c}`: {meanings[c]}" for c in columns if c in (meanings or {})]
    return "\nColumns:\n\n" + "\n".join(lines) + "\n" if lines else ""


def check_names(rows: list[dict], spec: dict, columns: list[str], functions: dict[str, Any]) -> None:
    """Every column and every name the block's expressions read exists in some job's row or is
    defined by the block; otherwise one ReportError naming each, with the closest metrics."""
    if not any(r.get("status") == "ok" for r in rows):
        return                         # no job finished: nothing to name, the status column says why
    derived = spec.get("derived") or {}
    defined = set(derived) | {r["name"] for r in spec.get("relative") or []} | {"speedup", "status", "job"}
    present = {k for r in rows for k in r} | defined
    problems = []

    def missing(name: str, where: str) -> None:
        if name not in present:
            close = difflib.get_close_matches(name, sorted(present), n=3, cutoff=0.6)
            problems.append(f"{where}: no job has '{name}'" + (f" (closest: {', '.join(close)})" if close else ""))

    for c in columns:
        missing(c, "columns")
    for c in spec.get("legend") or {}:
        missing(c, "legend")
    for rel in spec.get("relative") or []:
        missing(rel["of"], f"relative {rel['name']}")
    for name, expression in derived.items():
        expression = expression if isinstance(expression, dict) else {"expr": expression}
        if expression.get("optional"):
            continue                   # blank where no job has what it reads (a method-specific metric)
        aliases = set(expression.get("with") or {})
        for ref in expression_columns(str(expression["expr"])):
            alias, _, rest = ref.partition(".")
            if ref in functions or ref in ("min", "max"):
                continue
            missing(rest if alias in aliases and rest else ref, f"derived {name}")
    if problems:
        raise ReportError("report: " + "; ".join(problems))


def add_derived(rows: list[dict], swept: list[str], name: str, expression: str | dict,
                functions: dict[str, Any] | None = None) -> None:
    """row[name] = the expression's value. A dict {expr, where, with: {alias: where}} computes it
    only for rows matching `where`, and lets it read `alias.column` from the row that matches the
    alias's filter and agrees on the other swept keys (e.g. the sequential run of the same data)."""
    if isinstance(expression, str):
        expression = {"expr": expression}
    refs = expression.get("with") or {}
    for r in rows:
        if not _matches(r, expression.get("where")):
            continue
        others = {}
        for alias, where in refs.items():
            keys = [k for k in swept if k not in where]
            found = [o for o in rows if _matches(o, where) and all(o.get(k) == r.get(k) for k in keys)]
            if found:
                others[alias] = found[0]
        r[name] = evaluate(str(expression["expr"]), r, others, functions) if len(others) == len(refs) else None


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow}


def evaluate(expression: str, row: dict, others: dict[str, dict] | None = None,
             functions: dict[str, Any] | None = None) -> float | None:
    """A `derived:` expression over a row: column names (dotted), numbers, + - * / **, min(), max(),
    and the `formulas:` module's functions; `alias.column` reads another row (`others`: alias ->
    row). None when a column is missing or not a number, or a formula has no value there."""
    others, functions = others or {}, functions or {}

    def column(name: str):
        alias, _, rest = name.partition(".")
        return others[alias].get(rest) if alias in others and rest else row.get(name)

    def value(node):
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            return (min if node.func.id == "min" else max)(value(a) for a in node.args)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions:
            result = functions[node.func.id](*(value(a) for a in node.args))
            if result is None:
                raise LookupError(node.func.id)
            return result
        if isinstance(node, (ast.Name, ast.Attribute)):
            v = column(ast.unparse(node))
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise LookupError(ast.unparse(node))
            return v
        raise ValueError(f"derived: {expression!r}: only column names, numbers, + - * / ** min max "
                         f"and the formulas ({', '.join(functions) or 'none named'})")

    try:
        return value(ast.parse(expression, mode="eval"))
    except (LookupError, ZeroDivisionError):
        return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and math.isnan(v))


def over_repeats(rows: list[dict], swept: list[str], key: str) -> list[dict]:
    """One row per setting of the swept keys other than `key` (the repeat number): each number the
    median of the ok rows' values, its range under "<column>~" as (min, max), list columns (profiles)
    the element-wise median, anything else the first row's; "repeats" counts the ok rows."""
    others = [k for k in swept if k != key]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(json.dumps(r.get(k), default=str) for k in others), []).append(r)
    out = []
    for members in groups.values():
        ok = [r for r in members if r["status"] == "ok"] or members
        row = dict(members[0])
        row.update({key: None, "repeats": sum(r["status"] == "ok" for r in members),
                    "status": "ok" if any(r["status"] == "ok" for r in members) else members[0]["status"]})
        for col in dict.fromkeys(c for r in ok for c in r):
            if col == key or col in others:
                continue
            values = [r.get(col) for r in ok]
            numbers = [v for v in values if _number(v)]
            if numbers and len(numbers) == len([v for v in values if v is not None]):
                row[col] = statistics.median(numbers)
                row[col + "~"] = (min(numbers), max(numbers))
            elif values and all(isinstance(v, list) and v and len(v) == len(values[0]) and all(map(_number, v))
                                for v in values):
                row[col] = [statistics.median(x) for x in zip(*values)]
        out.append(row)
    return out


def _fmt_spread(row: dict, column: str) -> str:
    """A median with its range, "1.23 (1.1–1.35)"; just the value where the repeats agree."""
    text = _fmt(row.get(column))
    spread = row.get(column + "~")
    if spread and spread[0] != spread[1]:
        text += f" ({_fmt(spread[0])}–{_fmt(spread[1])})"
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if not math.isnan(v) else "nan"
    return "" if v is None else str(v)


def markdown(rows: list[dict], columns: list[str], cell=None) -> str:
    cell = cell or (lambda r, c: _fmt(r.get(c)))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r, c).replace("|", "\\|").replace("\n", " ") for c in columns) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], plots: list[dict], path: Path, swept: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(3, len(plots))
    nrows = math.ceil(len(plots) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.2 * nrows), squeeze=False)
    for ax in axes.flat[len(plots):]:
        ax.set_visible(False)
    for ax, p in zip(axes.flat, plots):
        sel = [r for r in rows if _matches(r, p.get("where"))]
        ys = p["y"] if isinstance(p["y"], list) else [p["y"]]
        x = p.get("x")
        hue = p.get("hue")
        labels = [" ".join(f"{r.get(k)}" for k in ([x] if x else [k for k in swept])) or r["job"] for r in sel]
        groups = sorted({r.get(hue) for r in sel}, key=str) if hue else [None]
        series = [(y, g) for y in ys for g in groups]
        xs = list(dict.fromkeys(labels))
        numeric = bool(x) and all(isinstance(r.get(x), (int, float)) and not isinstance(r.get(x), bool) for r in sel)
        if p.get("kind") == "profile":
            _profile(ax, p, sel, ys, hue, swept)
            continue
        stacked = p.get("kind") == "stacked"
        width = 0.8 if stacked else 0.8 / max(1, len(series))
        bottom = [0.0] * len(xs)
        for i, (y, g) in enumerate(series):
            vals = []
            for lab in xs:
                match = [r for r, l in zip(sel, labels) if l == lab and (hue is None or r.get(hue) == g)]
                v = match[0].get(y) if match else None
                vals.append(v if isinstance(v, (int, float)) else float("nan"))
            label = " ".join(str(s) for s in (y if len(ys) > 1 else None, g) if s is not None) or y
            if p.get("kind") == "line" and numeric:    # a numeric axis: points at their values, in order
                pts = sorted((float(lab), v) for lab, v in zip(xs, vals) if not math.isnan(v))
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=label)
            elif p.get("kind") == "line":
                ax.plot(xs, vals, marker="o", label=label)
            elif stacked:
                vals = [0.0 if math.isnan(v) else v for v in vals]
                ax.bar(range(len(xs)), vals, width, bottom=bottom, label=label)
                bottom = [b + v for b, v in zip(bottom, vals)]
            else:
                ax.bar([j + i * width for j in range(len(xs))], vals, width, label=label)
        if stacked:
            ax.set_xticks(range(len(xs)), xs, rotation=20, ha="right")
        elif p.get("kind") != "line":
            ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(xs))], xs, rotation=20, ha="right")
        if p.get("logx"):
            ax.set_xscale("log", base=2)
        if p.get("hline") is not None:      # a reference level: parity, a target
            ax.axhline(float(p["hline"]), color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(p.get("xlabel") or x or "job")
        ax.set_ylabel(p.get("ylabel") or (ys[0] if len(ys) == 1 else "value"))
        ax.set_title(p.get("title") or f"{', '.join(ys)} by {x or 'job'}", fontsize=10)
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _profile(ax, p: dict, rows: list[dict], ys: list[str], hue: str | None, swept: list[str]) -> None:
    """One line per row (labelled by `hue`, else by the swept keys) of a list-valued column against
    its index: per-position acceptance, the kept tokens' share in each tenth of the video, ..."""
    for r in rows:
        for y in ys:
            values = r.get(y)
            if not isinstance(values, list):
                continue
            name = str(r.get(hue)) if hue else " ".join(str(r.get(k)) for k in swept) or r["job"]
            ax.plot(range(len(values)), values, marker="o", ms=3, label=name if len(ys) == 1 else f"{y} {name}")
    ax.set_xlabel(p.get("xlabel") or "index")
    ax.set_ylabel(p.get("ylabel") or (ys[0] if len(ys) == 1 else "value"))
    ax.set_title(p.get("title") or f"{', '.join(ys)}", fontsize=10)
    if ax.lines:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def write_report(sweep_dir: str | Path) -> dict[str, Path]:
    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise FileNotFoundError(f"{sweep_dir}: no such directory")
    rows, swept, spec = collect(sweep_dir)
    if not rows:
        raise FileNotFoundError(f"{sweep_dir}: no job dirs (with .hydra/) inside; is it a multirun dir?")
    if spec.get("baseline"):
        add_speedup(rows, swept, spec["baseline"])
    derived = spec.get("derived") or {}
    functions = load_formulas(spec.get("formulas"))
    for _ in range(len(derived)):      # as many passes as entries: one may use another, in any order
        for name, expression in derived.items():
            add_derived(rows, swept, name, expression, functions)
    for rel in spec.get("relative") or []:
        add_relative(rows, swept, rel["baseline"], rel["of"], rel["name"], bool(rel.get("invert")))
    repeat = spec.get("repeat")
    columns = spec.get("columns") or ((swept or ["job"]) + [m for m in DEFAULT_METRICS if any(r.get(m) is not None for r in rows)])
    # every key the sweep varies is a column, the block's list or not: rows that differ only in a
    # key the table leaves out could not be told apart
    columns = [k for k in swept if k not in columns and k != repeat] + list(columns)
    if any("speedup" in r for r in rows) and "speedup" not in columns:
        columns = columns + ["speedup"]
    check_names(rows, spec, columns, functions)
    if any(r["status"] != "ok" for r in rows):
        columns = columns + ["status"]
    if any(r.get("failed_requests") for r in rows):
        columns = columns + ["failed_requests"]
    out = {"md": sweep_dir / "report.md", "csv": sweep_dir / "report.csv", "png": sweep_dir / "report.png"}
    title = f"# report: {sweep_dir.name}\n\n{len(rows)} jobs; swept: {', '.join(swept) or 'nothing'}\n\n"
    shown = rows
    if repeat and repeat in swept:
        shown = over_repeats(rows, swept, repeat)
        summary_columns = [c for c in columns if c not in (repeat, "status", "job")] + ["repeats"]
        n = len({json.dumps(r.get(repeat), default=str) for r in rows})
        title += (f"## Over {n} repeats ({repeat}): the median, and the range in brackets\n\n"
                  + markdown(shown, summary_columns, _fmt_spread) + "\n## Every job\n\n")
        if repeat not in columns:
            columns = columns[:1] + [repeat] + columns[1:]
    out["md"].write_text(title + markdown(rows, columns) + legend(spec.get("legend"), columns))
    all_cols = list(dict.fromkeys(k for r in rows for k in r))
    with out["csv"].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=all_cols)
        w.writeheader()
        w.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()} for r in rows)
    plots = spec.get("plots") or [{"y": "wall_s", "title": "wall time (s) per job"}]
    plot(shown, plots, out["png"], [k for k in swept if k != repeat])
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
    except (FileNotFoundError, yaml.YAMLError, ReportError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    print(out["md"].read_text())
    print(f"wrote {out['md']}, {out['csv']}, {out['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
