"""graph.report: report.md / report.csv / report.png from a hand-built multirun dir, and its CLI."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from graph.report import ReportError, write_report

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_job(sweep: Path, name: str, overrides: list[str], metrics: dict | None = None,
             report: dict | None = None, error: str | None = None) -> Path:
    job = sweep / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    cfg = {"experiment": "bench", "executor": {"runner": "threaded", "capacity": 2}}
    if report is not None:
        cfg["report"] = report
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    if metrics is not None:
        (job / "metrics.json").write_text(json.dumps(metrics))
    if error is not None:
        (job / "error.txt").write_text(error)
    return job


def metrics(wall: float, ttft: float | None = 0.1) -> dict:
    return {"wall_s": wall, "ttft_s": ttft, "decode_s": None if ttft is None else wall - ttft,
            "ideal_wall_s": wall / 2, "efficiency": 0.5, "n_calls": 12,
            "output_ids": [1, 2, 3],                                   # lists are not scalars: left out
            "stages": {"decode": {"busy_s": 0.25, "calls": 4, "resource": "decode"}}}


JOBS = [  # (overrides, wall_s or None for a failed job)
    (["graph=demo", "executor.runner=sequential", "executor.capacity=2"], 2.0),
    (["graph=demo", "executor.runner=threaded", "executor.capacity=2"], 1.0),
    (["graph=big", "executor.runner=sequential", "executor.capacity=2"], 6.0),
    (["graph=big", "executor.runner=threaded", "executor.capacity=2"], None),
    (["graph=big", "executor.runner=process", "executor.capacity=2"], 4.0),
]


@pytest.fixture
def sweep(tmp_path):
    """Five jobs, one failed; the report block asks for a baseline (speedup) and a hued plot."""
    d = tmp_path / "10-00-00_bench_engine"
    d.mkdir()
    (d / "multirun.yaml").write_text("hydra: {}\n")  # Hydra leaves this beside the job dirs
    report = {"baseline": {"executor.runner": "sequential"},
              "plots": [{"x": "executor.runner", "y": "wall_s", "hue": "graph", "title": "wall"},
                        {"x": "executor.runner", "y": ["wall_s", "ideal_wall_s"], "where": {"graph": "big"},
                         "kind": "line"}]}
    for i, (ov, wall) in enumerate(JOBS):
        if wall is None:
            make_job(d, str(i), ov, report=report,
                     error="RuntimeError: stage llm failed on item 3\nTraceback (most recent call last):\n  ...\n")
        else:
            make_job(d, str(i), ov, metrics(wall), report=report)
    return d


def md_table(md: str) -> tuple[list[str], list[list[str]]]:
    lines = [l for l in md.splitlines() if l.startswith("|")]
    assert len(lines) >= 2, md
    cells = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]
    header = cells(lines[0])
    assert set(lines[1].replace("|", "").replace(":", "")) <= {"-"}, "second line must be the separator"
    assert lines[1].count("|") == len(header) + 1
    rows = [cells(l) for l in lines[2:]]
    assert all(len(r) == len(header) for r in rows), md
    return header, rows


def test_writes_three_files(sweep):
    out = write_report(sweep)
    assert {k: Path(v) for k, v in out.items()} == {"md": sweep / "report.md", "csv": sweep / "report.csv",
                                                    "png": sweep / "report.png"}
    for p in out.values():
        assert Path(p).is_file() and Path(p).stat().st_size > 0
    assert (sweep / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_markdown_table_has_swept_keys_and_one_row_per_job(sweep):
    write_report(sweep)
    md = (sweep / "report.md").read_text()
    assert "5 jobs" in md
    header, rows = md_table(md)
    assert header[:2] == ["graph", "executor.runner"]                  # the swept keys, in override order
    assert "executor.capacity" not in header                           # the same in every job: not swept
    assert "job" not in header[:2]
    for m in ("wall_s", "ttft_s", "decode_s", "ideal_wall_s", "efficiency"):
        assert m in header
    assert header[-2:] == ["speedup", "status"]
    assert len(rows) == len(JOBS)
    col = {h: i for i, h in enumerate(header)}
    for (ov, wall), row in zip(JOBS, rows):                            # job order: 0, 1, 2, ...
        values = dict(o.split("=") for o in ov)
        assert row[col["graph"]] == values["graph"]
        assert row[col["executor.runner"]] == values["executor.runner"]
        if wall is None:
            assert row[col["status"]].startswith("failed")
            assert "RuntimeError: stage llm failed on item 3" in row[col["status"]]
            assert row[col["wall_s"]] == "" and row[col["speedup"]] == ""
        else:
            assert row[col["status"]] == "ok"
            assert float(row[col["wall_s"]]) == pytest.approx(wall)


def test_speedup_is_baseline_wall_over_wall_matched_on_other_swept_keys(sweep):
    write_report(sweep)
    header, rows = md_table((sweep / "report.md").read_text())
    col = {h: i for i, h in enumerate(header)}
    speedup = [r[col["speedup"]] for r in rows]
    # demo: 2.0/2.0, 2.0/1.0; big: 6.0/6.0, failed, 6.0/4.0
    assert [float(s) if s else None for s in speedup] == [1.0, 2.0, 1.0, None, 1.5]


def test_csv_has_every_scalar_and_one_row_per_job(sweep):
    write_report(sweep)
    with (sweep / "report.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r["executor.runner"] for r in rows] == ["sequential", "threaded", "sequential", "threaded", "process"]
    assert [r["graph"] for r in rows] == ["demo", "demo", "big", "big", "big"]
    assert all(r["executor.capacity"] == "2" for r in rows)           # constant overrides still in the csv
    assert [float(r["wall_s"]) if r["wall_s"] else None for r in rows] == [2.0, 1.0, 6.0, None, 4.0]
    assert [float(r["speedup"]) if r["speedup"] else None for r in rows] == [1.0, 2.0, 1.0, None, 1.5]
    assert rows[0]["stages.decode.busy_s"] == "0.25"                   # nested metrics are flattened
    assert rows[0]["stages.decode.resource"] == "decode"
    assert "output_ids" not in rows[0]
    assert rows[0]["status"] == "ok"
    assert rows[3]["status"].startswith("failed: RuntimeError")


def test_default_report_without_a_report_block(tmp_path):
    d = tmp_path / "sweep"
    make_job(d, "0", ["executor.runner=sequential", "seed=1"], metrics(2.0, ttft=None))
    make_job(d, "1", ["executor.runner=threaded", "seed=1"], metrics(0.5, ttft=None))
    write_report(d)
    header, rows = md_table((d / "report.md").read_text())
    # swept keys, then the default metrics that some job has; no speedup and no status when all ok
    assert header == ["executor.runner", "wall_s", "ideal_wall_s", "efficiency"]
    assert rows == [["sequential", "2", "1", "0.5"], ["threaded", "0.5", "0.25", "0.5"]]
    assert (d / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_columns_from_the_report_block(tmp_path):
    d = tmp_path / "sweep"
    report = {"columns": ["executor.runner", "wall_s", "n_calls"], "baseline": {"executor.runner": "sequential"}}
    make_job(d, "0", ["executor.runner=sequential"], metrics(3.0), report=report)
    make_job(d, "1", ["executor.runner=threaded"], metrics(1.5), report=report)
    write_report(d)
    header, rows = md_table((d / "report.md").read_text())
    assert header == ["executor.runner", "wall_s", "n_calls", "speedup"]
    assert rows == [["sequential", "3", "12", "1"], ["threaded", "1.5", "12", "2"]]


def test_jobs_sort_numerically(tmp_path):
    d = tmp_path / "sweep"
    for i in range(12):
        make_job(d, str(i), [f"seed={i}"], metrics(1.0 + i))
    write_report(d)
    header, rows = md_table((d / "report.md").read_text())
    assert header[0] == "seed"
    assert [r[0] for r in rows] == [str(i) for i in range(12)]


def test_failed_job_without_error_txt(tmp_path):
    d = tmp_path / "sweep"
    make_job(d, "0", ["graph=demo"], metrics(1.0))
    make_job(d, "1", ["graph=big"])
    write_report(d)
    header, rows = md_table((d / "report.md").read_text())
    assert header[-1] == "status"
    assert rows[0][-1] == "ok"
    assert rows[1][-1] == "failed: no metrics.json"


def test_a_job_whose_requests_partly_failed_says_how_many(tmp_path):
    """A job of several requests goes on past a failed one; its means are over fewer requests, and
    the table says so beside them."""
    d = tmp_path / "sweep"
    make_job(d, "0", ["graph=demo"], metrics(1.0))
    make_job(d, "1", ["graph=big"], {**metrics(2.0), "failed": [{"request": "v3", "error": "bad file", "attempts": 1}]})
    write_report(d)
    header, rows = md_table((d / "report.md").read_text())
    assert header[-1] == "failed_requests" and "status" not in header
    assert [r[-1] for r in rows] == ["0", "1"]


def test_every_job_failed_still_writes_a_report(tmp_path):
    d = tmp_path / "sweep"
    make_job(d, "0", ["graph=demo"], error="ValueError: bad config\n")
    make_job(d, "1", ["graph=big"], error="ValueError: bad config\n")
    out = write_report(d)
    header, rows = md_table(Path(out["md"]).read_text())
    assert header == ["graph", "status"]
    assert [r[1] for r in rows] == ["failed: ValueError: bad config"] * 2
    assert Path(out["png"]).read_bytes()[:8] == PNG_MAGIC


def test_not_a_multirun_dir(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "empty")


# ---------------------------------------------------------------- CLI

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graph.report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_cli_writes_the_report(sweep):
    res = _cli(str(sweep))
    assert res.returncode == 0, res.stderr
    assert "| graph | executor.runner |" in res.stdout
    assert "report.md" in res.stdout
    assert (sweep / "report.md").is_file() and (sweep / "report.csv").is_file()
    assert (sweep / "report.png").read_bytes()[:8] == PNG_MAGIC


def test_cli_missing_dir_exits_2_with_one_line(tmp_path):
    res = _cli(str(tmp_path / "nope"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "nope" in lines[0] and "Traceback" not in res.stderr
    assert not (tmp_path / "nope").exists()


def test_cli_dir_without_jobs_exits_2(tmp_path):
    res = _cli(str(tmp_path))
    assert res.returncode == 2
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr


# ------------------------------------------------ relative, derived (with other rows), stacked plots

def test_evaluate_reads_columns_numbers_and_other_rows():
    from graph.report import evaluate

    row = {"wall_s": 3.0, "ttft_s": 1.0, "stages.decode.end_s": 0.5, "name": "x"}
    assert evaluate("wall_s - ttft_s", row) == 2.0
    assert evaluate("max(0, min(stages.decode.end_s, ttft_s) - 2) + 1", row) == 1.0
    assert evaluate("seq.wall_s / wall_s", row, {"seq": {"wall_s": 6.0}}) == 2.0
    assert evaluate("missing + 1", row) is None and evaluate("name + 1", row) is None
    assert evaluate("wall_s / 0", row) is None
    with pytest.raises(ValueError, match="only column names"):
        evaluate("__import__('os')", row)


def test_relative_and_derived_columns_match_rows_on_the_other_swept_keys(tmp_path):
    d = tmp_path / "sweep"
    report = {"relative": [{"name": "f1_retention", "of": "summary.score.f1", "baseline": {"case": "ar"}}],
              "derived": {"cpu_per_core": "cpu_s / cores",
                          "bound": {"expr": "max(seq.wall_s, cpu_per_core) + 0.5", "where": {"case": "fast"},
                                    "with": {"seq": {"case": "slow"}}}},
              "columns": ["data", "case", "f1_retention", "cpu_per_core", "bound"],
              "plots": [{"x": "case", "y": ["wall_s", "cpu_s"], "kind": "stacked", "where": {"case": ["ar", "fast"]}}]}
    cases = [("a", "ar", 0.8, 4.0), ("a", "slow", 0.4, 3.0), ("a", "fast", 0.6, 1.0),
             ("b", "ar", 0.5, 8.0), ("b", "slow", 0.5, 7.0), ("b", "fast", 0.25, 2.0)]
    for i, (data, case, f1, wall) in enumerate(cases):
        make_job(d, str(i), [f"data={data}", f"+case={case}"],
                 {"wall_s": wall, "cpu_s": 2 * wall, "cores": 2, "summary": {"score": {"f1": f1}}}, report)
    out = write_report(d)
    rows = {(r["data"], r["case"]): r for r in csv.DictReader(out["csv"].open())}
    assert float(rows["a", "fast"]["f1_retention"]) == pytest.approx(0.75)
    assert float(rows["b", "fast"]["f1_retention"]) == pytest.approx(0.5)         # b's own baseline
    assert float(rows["a", "fast"]["bound"]) == pytest.approx(3.5)                 # a's slow run: 3 s
    assert float(rows["b", "fast"]["bound"]) == pytest.approx(7.5)
    assert rows["a", "slow"]["bound"] == ""                                        # only where asked
    assert out["png"].read_bytes()[:8] == PNG_MAGIC


def test_config_keys_fill_columns_the_overrides_do_not_set(tmp_path):
    d = tmp_path / "sweep"
    job = make_job(d, "0", ["+case=x"], {"wall_s": 1.0}, {"columns": ["case", "graph.prune.ratio"]})
    cfg = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
    cfg["graph"] = {"prune": {"ratio": 0.25}}
    (job / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert "| x | 0.25 |" in write_report(d)["md"].read_text()


def test_profile_plot_draws_a_list_column_per_row_and_the_csv_keeps_it(tmp_path):
    """`kind: profile`: a list-valued metric (per tenth of the video, per position) as one line per
    row against its index; the CSV holds the list as JSON."""
    d = tmp_path / "sweep"
    report = {"plots": [{"y": "summary.kept", "kind": "profile", "hue": "case", "xlabel": "tenth"}]}
    make_job(d, "0", ["+case=uv"], {"wall_s": 1.0, "summary": {"kept": [0.1] * 10}}, report)
    make_job(d, "1", ["+case=attention"], {"wall_s": 1.0, "summary": {"kept": [0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.7]}}, report)
    out = write_report(d)
    assert out["png"].read_bytes()[:8] == PNG_MAGIC
    with out["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert json.loads(rows[1]["summary.kept"])[-1] == 0.7


def test_mean_tree_averages_equal_length_number_lists_element_wise():
    from graph.metrics import mean_tree

    runs = [{"a": 1.0, "p": [1.0, 0.5], "s": "x", "q": [1, 2]}, {"a": 3.0, "p": [0.0, 0.5], "s": "x", "q": [1]}]
    assert mean_tree(runs) == {"a": 2.0, "p": [0.5, 0.5]}       # lists of unequal length are left out


def test_a_column_naming_a_missing_metric_is_an_error_with_the_closest_names(tmp_path):
    from graph.report import ReportError

    report = {"columns": ["case", "wall_s", "ttft_z"], "derived": {"gen_s": "wall_s - decode_z"}}
    make_job(tmp_path, "0", ["case=a"], metrics(1.0), report)
    with pytest.raises(ReportError) as e:
        write_report(tmp_path)
    assert "columns: no job has 'ttft_z' (closest: ttft_s" in str(e.value)
    assert "derived gen_s: no job has 'decode_z' (closest: decode_s" in str(e.value)
    run = _cli(str(tmp_path))
    assert run.returncode == 2 and "no job has 'ttft_z'" in run.stderr


def test_an_optional_derived_column_is_blank_when_no_job_has_what_it_reads(tmp_path):
    report = {"columns": ["case", "wall_s", "nodes"],
              "derived": {"nodes": {"expr": "summary.tree_nodes", "optional": True}}}
    make_job(tmp_path, "0", ["case=a"], metrics(1.0), report)
    out = write_report(tmp_path)
    with out["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["nodes"] == "" and rows[0]["wall_s"] != ""


def test_derived_columns_call_the_named_formulas_module(tmp_path):
    report = {"columns": ["case", "bound", "eq7"], "formulas": "job.bounds",
              "derived": {"bound": "sd_ms_per_token_bound(window, tq_ms, tp_ms, acceptance)",
                          "eq7": "sd_speedup_eq7(acceptance, tp_ms / tq_ms)"}}
    row = {**metrics(1.0), "window": 2, "tq_ms": 1.0, "tp_ms": 3.0, "acceptance": 0.5}
    make_job(tmp_path, "0", ["case=a"], row, report)
    write_report(tmp_path)
    with (tmp_path / "report.csv").open() as f:
        got = next(csv.DictReader(f))
    # the expression the bench config used to spell out, evaluated by hand: 6 / 0.9375
    assert float(got["bound"]) == pytest.approx(6.4) and float(got["eq7"]) == pytest.approx(1.5)


def test_a_line_plot_over_a_numeric_column_places_points_at_their_values(tmp_path, monkeypatch):
    """x values that are numbers are an axis, not labels: the points of each hue at their values, in
    order, on a log axis when asked, with a dashed reference level."""
    import matplotlib.axes

    d = tmp_path / "sweep"
    report = {"columns": ["case", "x", "ratio"],
              "plots": [{"x": "x", "y": "ratio", "hue": "case", "kind": "line", "logx": True, "hline": 1}]}
    for i, (case, x, ratio) in enumerate([("a", 4, 1.5), ("a", 0.5, 0.8), ("b", 2, 1.1), ("a", 1, 1.0)]):
        make_job(d, str(i), [f"+case={case}", f"+x={x}"], {"wall_s": 1.0, "ratio": ratio}, report)
    drawn, levels = [], []
    plot, axhline = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.axhline
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, xs, ys, **kw: drawn.append((list(xs), list(ys)))
                        or plot(ax, xs, ys, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", lambda ax, y, **kw: levels.append(y) or axhline(ax, y, **kw))
    out = write_report(d)
    assert out["png"].read_bytes()[:8] == PNG_MAGIC
    assert ([0.5, 1.0, 4.0], [0.8, 1.0, 1.5]) in drawn and ([2.0], [1.1]) in drawn and levels == [1.0]


def test_repeats_pair_each_job_with_its_own_repeats_baseline_and_summarise_by_the_median(tmp_path):
    """`repeat:`: a ratio to the baseline reads the baseline of the same repeat (the drift of a
    machine between repeats cancels), and report.md adds one row per setting with the median over
    the repeats and their range; a failed repeat is left out of the median and of the count."""
    d = tmp_path / "sweep"
    report = {"repeat": "bench.repeat",
              "derived": {"decode_speedup": {"expr": "ar.ms / ms", "with": {"ar": {"method": "ar"}}}},
              "columns": ["method", "ms", "decode_speedup"],
              "plots": [{"x": "method", "y": "decode_speedup"},
                        {"y": "summary.profile", "kind": "profile", "hue": "method"}]}
    # the machine runs at half speed in repeat 1: every time doubles, the ratios stay
    walls = {("ar", 0): 2.0, ("sd", 0): 1.0, ("ar", 1): 4.0, ("sd", 1): 2.0, ("ar", 2): 2.2, ("sd", 2): None}
    for i, ((method, repeat), ms) in enumerate(walls.items()):
        make_job(d, str(i), [f"bench.repeat={repeat}", f"+method={method}"],
                 None if ms is None else {"ms": ms, "summary": {"profile": [ms, 2 * ms]}}, report,
                 error=None if ms is not None else "RuntimeError: boom")
    out = write_report(d)
    rows = {(r["method"], r["bench.repeat"]): r for r in csv.DictReader(out["csv"].open())}
    assert float(rows["sd", "0"]["decode_speedup"]) == float(rows["sd", "1"]["decode_speedup"]) == 2.0
    text = out["md"].read_text()
    summary = text.split("## Every job")[0]
    assert "Over 3 repeats (bench.repeat)" in summary
    assert "| ar | 2.2 (2–4) | 1 | 3 |" in summary           # the median and the range of ms
    assert "| sd | 1.5 (1–2) | 2 | 2 |" in summary            # two ok repeats, both 2×: no range
    jobs = text.split("## Every job")[1]
    assert jobs.count("\n| ar |") == jobs.count("\n| sd |") == 3 and "failed: RuntimeError: boom" in jobs
    assert "| method | bench.repeat | ms |" in jobs and "| sd | 1 | 2 | 2 |" in jobs     # each job's repeat
    assert out["png"].read_bytes()[:8] == PNG_MAGIC


def test_a_swept_key_the_columns_leave_out_is_shown_and_the_legend_says_what_columns_mean(tmp_path):
    sweep = tmp_path / "sw"
    report = {"columns": ["wall_s"], "legend": {"wall_s": "seconds a request took", "ttft_s": "not shown"}}
    for fps, wall in ((2, 1.0), (8, 3.0)):
        make_job(sweep, str(fps), ["graph=demo", f"bench.fps={fps}"], metrics(wall), report)
    text = write_report(sweep)["md"].read_text()
    assert "| bench.fps | wall_s |" in text and "| 2 | 1 |" in text and "| 8 | 3 |" in text
    assert text.endswith("Columns:\n\n- `wall_s`: seconds a request took\n")       # shown columns only
    report["legend"] = {"wal_s": "a typo"}
    for fps in (2, 8):
        (sweep / str(fps) / ".hydra" / "config.yaml").write_text(yaml.safe_dump(
            {"experiment": "bench", "report": report}))
    with pytest.raises(ReportError, match="legend: no job has 'wal_s' \\(closest: wall_s"):
        write_report(sweep)
