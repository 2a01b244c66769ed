"""graph.trace: the Chrome trace-event dict and the timeline PNG, from hand-built call records."""

from __future__ import annotations

import json

import pytest

from graph.executor import CallRecord
from graph.trace import chrome_trace, plot_timeline, write_trace

T0 = 1000.0  # perf_counter-like absolute start
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESOURCES = ["gpu", "decode", "cpu"]  # plan order, deliberately not alphabetical
TAPS = {("llm", "draft")}


def _calls() -> list[CallRecord]:
    def rec(i, node, resource, worker, t0, t1, phase="call", item=0, blocked=0.0, emits=(), deps=()):
        return CallRecord(i, node, phase, item, worker, resource, t0=T0 + t0, t1=T0 + t1, blocked=blocked, engine=blocked,
                          deps=list(deps), emits=[(p, T0 + t, off) for p, t, off in emits])

    return [
        rec(0, "llm", "gpu", "gpu", 0.0, 0.001, phase="setup"),
        rec(1, "decode", "decode", "decode[0]", 0.001, 0.101, item=0, emits=[("frames", 0.101, 0.1)]),
        rec(2, "decode", "decode", "decode[1]", 0.002, 0.152, item=1, emits=[("frames", 0.152, 0.15)]),
        rec(3, "llm", "gpu", "gpu", 0.2, 0.7, deps=[(1, 0.1), (2, 0.15)],
            emits=[("draft", 0.3, 0.1), ("draft", 0.45, 0.25), ("tokens", 0.7, 0.5)]),
        rec(4, "verify", "cpu", "cpu", 0.31, 0.5, blocked=0.09, deps=[(3, 0.1)], emits=[("ok", 0.5, 0.1)]),
        rec(5, "verify", "cpu", "cpu", 0.5, 0.6, item=1, deps=[(3, 0.25)]),
        rec(6, "verify", "cpu", "cpu", 0.6, 0.61, phase="finish"),
    ]


@pytest.fixture
def trace():
    return chrome_trace(_calls(), T0, RESOURCES, TAPS, {"experiment": "demo", "runner": "threaded"})


def _events(trace, ph, name=None):
    return [e for e in trace["traceEvents"] if e["ph"] == ph and (name is None or e["name"] == name)]


def test_top_level_shape(trace):
    assert set(trace) >= {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] in ("ms", "ns")
    assert trace["otherData"] == {"experiment": "demo", "runner": "threaded"}
    assert chrome_trace(_calls(), T0, RESOURCES, TAPS)["otherData"] == {}
    assert {e["ph"] for e in trace["traceEvents"]} == {"M", "X", "i"}


def test_every_complete_event_has_the_required_fields(trace):
    xs = _events(trace, "X")
    assert len(xs) == len(_calls())
    for e in xs:
        for key in ("ph", "name", "pid", "tid", "ts", "dur"):
            assert key in e, f"{key} missing from {e}"
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
        assert e["dur"] >= 0 and e["ts"] >= 0


def test_one_process_per_resource_in_plan_order(trace):
    procs = {e["pid"]: e["args"]["name"] for e in _events(trace, "M", "process_name")}
    assert sorted(procs.values()) == sorted(RESOURCES)
    assert len(procs) == len(RESOURCES)  # pids are distinct
    order = [procs[pid] for pid in sorted(procs)]
    assert order == RESOURCES
    sort_index = {e["pid"]: e["args"]["sort_index"] for e in _events(trace, "M", "process_sort_index")}
    assert sorted(sort_index, key=sort_index.get) == sorted(procs)  # sorted as in the plan


def test_one_thread_per_worker(trace):
    procs = {e["pid"]: e["args"]["name"] for e in _events(trace, "M", "process_name")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in _events(trace, "M", "thread_name")}
    assert len(threads) == len(_events(trace, "M", "thread_name"))  # no (pid, tid) named twice
    expected = {(c.resource, c.worker) for c in _calls()}
    assert {(procs[pid], name) for (pid, _), name in threads.items()} == expected
    # the two decode workers are two rows of the decode process
    decode_pid = next(pid for pid, name in procs.items() if name == "decode")
    assert sorted(name for (pid, _), name in threads.items() if pid == decode_pid) == ["decode[0]", "decode[1]"]


def test_complete_events_sit_on_their_workers_row(trace):
    procs = {e["pid"]: e["args"]["name"] for e in _events(trace, "M", "process_name")}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in _events(trace, "M", "thread_name")}
    xs = _events(trace, "X")
    for c, e in zip(_calls(), xs):
        assert procs[e["pid"]] == c.resource
        assert threads[(e["pid"], e["tid"])] == c.worker


def test_timestamps_are_microseconds_since_start(trace):
    xs = _events(trace, "X")
    for c, e in zip(_calls(), xs):
        assert e["ts"] == pytest.approx((c.t0 - T0) * 1e6, abs=0.1)
        assert e["dur"] == pytest.approx((c.t1 - c.t0) * 1e6, abs=0.1)
    llm = next(e for e in xs if e["name"] == "llm")
    assert llm["ts"] == pytest.approx(200_000.0, abs=0.1)
    assert llm["dur"] == pytest.approx(500_000.0, abs=0.1)


def test_names_categories_and_args(trace):
    xs = _events(trace, "X")
    assert [e["name"] for e in xs] == ["llm:setup", "decode", "decode", "llm", "verify", "verify", "verify:finish"]
    assert [e.get("cat") for e in xs] == ["setup", "call", "call", "call", "call", "call", "finish"]
    blocked = xs[4]
    assert blocked["args"]["item"] == 0
    assert blocked["args"]["busy_ms"] == pytest.approx(100.0, abs=1e-3)
    assert blocked["args"]["blocked_ms"] == pytest.approx(90.0, abs=1e-3)
    assert xs[5]["args"]["item"] == 1


def test_tap_emits_are_instant_events(trace):
    inst = _events(trace, "i")
    # only the two llm.draft emits: llm.tokens, decode.frames and verify.ok are not taps
    assert len(inst) == 2
    llm_x = next(e for e in _events(trace, "X") if e["name"] == "llm")
    for e, t in zip(inst, [0.3, 0.45]):
        assert e["name"] == "tap llm.draft"
        assert e["ts"] == pytest.approx(t * 1e6, abs=0.1)
        assert (e["pid"], e["tid"]) == (llm_x["pid"], llm_x["tid"])
        assert e.get("s") in ("t", "p", "g")
        assert llm_x["ts"] <= e["ts"] <= llm_x["ts"] + llm_x["dur"]


def test_no_taps_no_instant_events():
    trace = chrome_trace(_calls(), T0, RESOURCES, set())
    assert _events(trace, "i") == []


def test_resource_missing_from_the_plan_still_gets_a_process():
    calls = _calls() + [CallRecord(7, "extra", "call", 0, "side", "side", t0=T0, t1=T0 + 0.01)]
    trace = chrome_trace(calls, T0, RESOURCES, TAPS)
    procs = {e["pid"]: e["args"]["name"] for e in _events(trace, "M", "process_name")}
    assert "side" in procs.values()
    assert max(procs, key=lambda pid: pid) == next(pid for pid, n in procs.items() if n == "side")  # sorts last


def test_only_used_resources_get_a_process():
    calls = [c for c in _calls() if c.resource != "decode"]
    trace = chrome_trace(calls, T0, RESOURCES, TAPS)
    assert sorted(e["args"]["name"] for e in _events(trace, "M", "process_name")) == ["cpu", "gpu"]


def test_empty_run_is_a_valid_trace():
    trace = chrome_trace([], T0, RESOURCES, TAPS)
    assert trace["traceEvents"] == []
    assert json.loads(json.dumps(trace)) == trace


def test_json_round_trip(trace, tmp_path):
    assert json.loads(json.dumps(trace)) == trace
    path = tmp_path / "trace.json"
    write_trace(path, trace)
    assert json.loads(path.read_text()) == trace


def test_plot_timeline_writes_a_png(tmp_path):
    path = tmp_path / "timeline.png"
    plot_timeline(path, _calls(), T0, RESOURCES, TAPS, title="demo (threaded): wall 0.610 s")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 1000


def test_plot_timeline_without_taps_and_one_row(tmp_path):
    path = tmp_path / "timeline.png"
    calls = [CallRecord(0, "a", "call", 0, "cpu", "cpu", t0=T0, t1=T0 + 0.5, blocked=0.4, engine=0.4)]
    plot_timeline(path, calls, T0, ["cpu"], set())
    assert path.read_bytes()[:8] == PNG_MAGIC
