"""The engine's side of the stage contract: per-run state starts clean through `start_run` (after a
failed run too, and on the stage's own worker), and parts a stage times with `ctx.timer` and what
it counts with `ctx.count` reach the call records, the trace and the metrics, from thread and
process workers alike."""

from __future__ import annotations

import pytest

from graph.executor import Executor, StageFailed
from graph.metrics import stage_stats
from graph.trace import chrome_trace
from stages.types import Request
from tests.helpers import make, node

H = "tests.helpers"


def counter_graph(on: str = "target", **kwargs) -> dict:
    return {"src": node("bench.synthetic.Producer", "cpu", items=4, size=8, iters=1),
            "count": node(f"{H}.RunCounter", on, {"item": "src.item"}, **kwargs)}


@pytest.mark.parametrize("on", ["target", "decode"])      # a thread worker, a process worker
def test_every_run_starts_clean(on, no_leftovers):
    spec, plan = make(counter_graph(on))
    with Executor(spec, plan, progress=False) as ex:
        runs = [ex.run(Request()).outputs["count.count"] for _ in range(3)]
    # the stage's finish leaves its count as it is: only start_run sets it back to 0
    assert runs == [{"items": 4, "runs": 1}, {"items": 4, "runs": 2}, {"items": 4, "runs": 3}]


def test_a_failing_start_run_names_the_node_and_the_phase(no_leftovers):
    spec, plan = make(counter_graph("target", fail_start=True))
    with Executor(spec, plan, progress=False) as ex, \
            pytest.raises(StageFailed, match="node 'count' .* failed on start_run: RuntimeError: RunCounter told to fail"):
        ex.run(Request())


@pytest.mark.parametrize("on", ["target", "decode"])
def test_timed_parts_reach_records_trace_and_metrics(on, no_leftovers):
    spec, plan = make(counter_graph(on, work_s=0.01))
    with Executor(spec, plan, progress=False) as ex:
        result = ex.run(Request())
    calls = [c for c in result.calls if c.node == "count" and c.phase == "call"]
    assert len(calls) == 4 and all(len(c.parts) == 1 and c.parts[0][0] == "work" for c in calls)
    for c in calls:             # each part lies inside its call and took at least the sleep
        _, t0, t1 = c.parts[0]
        assert c.t0 <= t0 <= t1 <= c.t1 and t1 - t0 >= 0.01
    timers = stage_stats(result.calls, {"src": "cpu", "count": on})["count"]["timers"]
    assert timers["work"]["n"] == 4 and timers["work"]["s"] >= 0.04
    assert 0.01 <= timers["work"]["min"] <= timers["work"]["s"] / 4          # the shortest of the four
    parts = [e for e in chrome_trace(result.calls, result.t_start, [r.name for r in plan.resources], set())["traceEvents"]
             if e.get("cat") == "part"]
    assert [e["name"] for e in parts] == ["count.work"] * 4


@pytest.mark.parametrize("on", ["target", "decode"])
def test_counts_are_summed_per_node_from_thread_and_process_workers(on, no_leftovers):
    spec, plan = make(counter_graph(on))
    with Executor(spec, plan, progress=False) as ex:
        result = ex.run(Request())
    calls = [c for c in result.calls if c.node == "count" and c.phase == "call"]
    assert [c.counts for c in calls] == [{"items": 1, "weight": k} for k in (1, 2, 3, 4)]
    stats = stage_stats(result.calls, {"src": "cpu", "count": on})
    assert stats["count"]["counts"] == {"items": 4, "weight": 10} and "counts" not in stats["src"]


def test_a_stage_without_per_run_state_costs_no_start_run_job():
    from graph.executor import _overrides_start_run
    from bench.synthetic import Producer
    from tests.helpers import RunCounter

    assert _overrides_start_run(RunCounter) and not _overrides_start_run(Producer)
