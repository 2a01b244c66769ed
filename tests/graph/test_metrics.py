"""graph.metrics: the ideal-overlap replay and the busy/blocked accounting, on hand-built call records."""

from __future__ import annotations

import random

import pytest

from graph.executor import CallRecord
from graph.metrics import ideal_schedule, ideal_wall_s, resource_busy, stage_stats


class Recorder:
    """Builds CallRecords with consecutive ids, as the executor does."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def add(self, node: str, resource: str, t0: float, busy: float, *, deps=(), blocked: float = 0.0,
            phase: str = "call", item: int = 0, worker: str | None = None, emits=()) -> CallRecord:
        rec = CallRecord(len(self.calls), node, phase, item, worker or resource, resource, t0=t0,
                         t1=t0 + busy + blocked, blocked=blocked, engine=blocked, deps=list(deps), emits=list(emits))
        self.calls.append(rec)
        return rec


def streaming_pair(p: list[float], c: list[float], sequential_actual: bool = True) -> list[CallRecord]:
    """Producer `decode` (cpu) emits one item per call at the end of the call; consumer `prefill` (gpu)
    takes one item per call. The actual timeline is a sequential run (all decode, then all prefill)
    unless `sequential_actual` is false (then interleaved p0 c0 p1 c1 ...)."""
    r = Recorder()
    t = 0.0
    if sequential_actual:
        prods = []
        for i, b in enumerate(p):
            prods.append(r.add("decode", "cpu", t, b, item=i))
            t += b
        for i, b in enumerate(c):
            r.add("prefill", "gpu", t, b, item=i, deps=[(prods[i].id, p[i])])
            t += b
    else:
        for i, (bp, bc) in enumerate(zip(p, c)):
            prod = r.add("decode", "cpu", t, bp, item=i)
            t += bp
            r.add("prefill", "gpu", t, bc, item=i, deps=[(prod.id, bp)])
            t += bc
    return r.calls


def quickvideo(p: list[float], c: list[float]) -> float:
    """QuickVideo's overlap bound: max(all decode + the last prefill, the first decode + all prefill)."""
    return max(sum(p) + c[-1], p[0] + sum(c))


WORKERS = {"cpu": 1, "gpu": 1}
NO_PINS: dict = {}


# ---------------------------------------------------------------- streaming overlap (QuickVideo)

@pytest.mark.parametrize("p, c", [
    ([0.3] * 5, [0.1] * 5),                   # producer-bound: sum_p + last c
    ([0.1] * 5, [0.3] * 5),                   # consumer-bound: first p + sum_c
    ([0.2] * 4, [0.2] * 4),                   # balanced
    ([0.4, 0.3, 0.5, 0.35], [0.1, 0.2, 0.05, 0.15]),   # producer slower on every item
    ([0.05, 0.1, 0.08], [0.5, 0.4, 0.6]),     # consumer slower on every item
])
@pytest.mark.parametrize("sequential_actual", [True, False])
def test_streaming_overlap_matches_quickvideo_formula(p, c, sequential_actual):
    calls = streaming_pair(p, c, sequential_actual)
    ideal = ideal_wall_s(calls, WORKERS, NO_PINS)
    assert ideal == pytest.approx(quickvideo(p, c))
    # overlap is real: better than running one after the other, never better than the busier side
    assert ideal < sum(p) + sum(c)
    assert ideal >= max(sum(p), sum(c)) - 1e-12


def test_streaming_overlap_schedule_per_item():
    p, c = [0.3, 0.3, 0.3], [0.1, 0.1, 0.1]
    sched = ideal_schedule(streaming_pair(p, c), WORKERS, NO_PINS)
    # producer calls back to back from 0; each consumer starts right when its item is emitted
    assert [sched[i] for i in range(3)] == [pytest.approx(x) for x in [(0.0, 0.3), (0.3, 0.6), (0.6, 0.9)]]
    assert [sched[3 + i] for i in range(3)] == [pytest.approx(x) for x in [(0.3, 0.4), (0.6, 0.7), (0.9, 1.0)]]


def test_streaming_overlap_general_recurrence():
    """For uneven items the exact two-stage pipeline bound is max_k (P_k + sum_{j>=k} c_j)."""
    rng = random.Random(7)
    for _ in range(20):
        n = rng.randint(1, 8)
        p = [rng.uniform(0.01, 0.5) for _ in range(n)]
        c = [rng.uniform(0.01, 0.5) for _ in range(n)]
        prefix = [sum(p[:k + 1]) for k in range(n)]
        expected = max(prefix[k] + sum(c[k:]) for k in range(n))
        assert ideal_wall_s(streaming_pair(p, c), WORKERS, NO_PINS) == pytest.approx(expected)
        # QuickVideo's formula is a lower bound of it (its two extreme terms)
        assert expected >= quickvideo(p, c) - 1e-12


def test_a_node_that_waits_starts_no_earlier_than_the_end_of_the_node_it_waits_for():
    p, c = [0.3, 0.3, 0.3], [0.1, 0.1, 0.1]
    calls = streaming_pair(p, c)
    consumer = calls[3].node
    producer = calls[0].node
    assert ideal_wall_s(calls, WORKERS, NO_PINS) == pytest.approx(1.0)
    sched = ideal_schedule(calls, WORKERS, NO_PINS, {consumer: (producer,)})
    assert sched[3][0] == pytest.approx(0.9)          # its first call: after the producer's last
    assert ideal_wall_s(calls, WORKERS, NO_PINS, {consumer: (producer,)}) == pytest.approx(1.2)


def test_record_order_does_not_matter():
    """The replay goes by start time, not by list order: a shuffled record list gives the same schedule."""
    p, c = [0.3, 0.1, 0.2, 0.4], [0.2, 0.3, 0.1, 0.1]
    calls = streaming_pair(p, c)
    expected = ideal_schedule(calls, WORKERS, NO_PINS)
    shuffled = calls[:]
    random.Random(3).shuffle(shuffled)
    shuffled.reverse()  # consumers before their producers
    assert ideal_schedule(shuffled, WORKERS, NO_PINS) == expected


def test_same_one_worker_resource_cannot_overlap_a_stream():
    """Producer and consumer on the same one-worker resource: the ideal is the plain sum."""
    p, c = [0.3, 0.2, 0.1], [0.1, 0.2, 0.3]
    calls = streaming_pair(p, c)
    for rec in calls:
        rec.resource = "cpu"
    assert ideal_wall_s(calls, {"cpu": 1}, NO_PINS) == pytest.approx(sum(p) + sum(c))


# ---------------------------------------------------------------- resources, nodes, pins

def test_independent_nodes_on_one_worker_serialize():
    r = Recorder()
    r.add("a", "cpu", 0.0, 1.0)
    r.add("b", "cpu", 0.0, 0.5)
    assert ideal_wall_s(r.calls, {"cpu": 1}, NO_PINS) == pytest.approx(1.5)
    sched = ideal_schedule(r.calls, {"cpu": 1}, NO_PINS)
    (a0, a1), (b0, b1) = sched[0], sched[1]
    assert a1 <= b0 + 1e-12 or b1 <= a0 + 1e-12  # no overlap


def test_independent_nodes_on_two_workers_or_two_resources_overlap():
    r = Recorder()
    r.add("a", "cpu", 0.0, 1.0)
    r.add("b", "cpu", 0.0, 0.5)
    assert ideal_wall_s(r.calls, {"cpu": 2}, NO_PINS) == pytest.approx(1.0)
    r.calls[1].resource = "gpu"
    assert ideal_wall_s(r.calls, {"cpu": 1, "gpu": 1}, NO_PINS) == pytest.approx(1.0)


def test_calls_of_one_node_never_overlap_even_with_free_workers():
    r = Recorder()
    for i in range(3):
        r.add("a", "cpu", 0.2 * i, 0.2, item=i)
    sched = ideal_schedule(r.calls, {"cpu": 4}, NO_PINS)
    assert ideal_wall_s(r.calls, {"cpu": 4}, NO_PINS) == pytest.approx(0.6)
    ends = [sched[i][1] for i in range(3)]
    starts = [sched[i][0] for i in range(3)]
    assert all(starts[i + 1] >= ends[i] - 1e-12 for i in range(2))


def test_finish_phase_follows_the_nodes_calls():
    r = Recorder()
    r.add("sink", "cpu", 0.0, 0.2, item=0)
    r.add("sink", "cpu", 0.2, 0.2, item=1)
    r.add("sink", "cpu", 0.4, 0.1, item=2, phase="finish")
    sched = ideal_schedule(r.calls, {"cpu": 3}, NO_PINS)
    assert sched[2] == (pytest.approx(0.4), pytest.approx(0.5))


def test_pinned_to_same_worker_serialize():
    r = Recorder()
    r.add("a", "decode", 0.0, 1.0, worker="decode[0]")
    r.add("b", "decode", 0.0, 0.5, worker="decode[0]")
    workers = {"decode": 2}
    assert ideal_wall_s(r.calls, workers, {"a": 0, "b": 0}) == pytest.approx(1.5)
    # different pins, or no pins, on a two-worker resource: they overlap
    assert ideal_wall_s(r.calls, workers, {"a": 0, "b": 1}) == pytest.approx(1.0)
    assert ideal_wall_s(r.calls, workers, {"a": None, "b": None}) == pytest.approx(1.0)
    assert ideal_wall_s(r.calls, workers, NO_PINS) == pytest.approx(1.0)


def test_pins_are_per_resource():
    """Worker 0 of one resource is not worker 0 of another."""
    r = Recorder()
    r.add("a", "decode", 0.0, 1.0)
    r.add("b", "encode", 0.0, 0.5)
    assert ideal_wall_s(r.calls, {"decode": 2, "encode": 2}, {"a": 0, "b": 0}) == pytest.approx(1.0)


def test_pinned_stream_into_pinned_consumer_on_same_worker_is_a_sum():
    p, c = [0.2, 0.2], [0.1, 0.1]
    calls = streaming_pair(p, c)
    for rec in calls:
        rec.resource = "decode"
    pins = {"decode": 1, "prefill": 1}
    assert ideal_wall_s(calls, {"decode": 2}, pins) == pytest.approx(0.6)
    assert ideal_wall_s(calls, {"decode": 2}, {"decode": 0, "prefill": 1}) == pytest.approx(quickvideo(p, c))


# ---------------------------------------------------------------- dependencies and taps

def test_tap_lets_the_consumer_start_inside_the_producer_call():
    r = Recorder()
    llm = r.add("llm", "target", 0.0, 1.0, emits=[("draft", 0.2, 0.2)])
    r.add("verify", "draft", 0.2, 0.3, deps=[(llm.id, 0.2)])
    sched = ideal_schedule(r.calls, {"target": 1, "draft": 1}, NO_PINS)
    assert sched[1] == (pytest.approx(0.2), pytest.approx(0.5))
    assert sched[1][0] < sched[0][1]  # started before the producer returned
    assert ideal_wall_s(r.calls, {"target": 1, "draft": 1}, NO_PINS) == pytest.approx(1.0)


def test_returned_output_waits_for_the_producer_end():
    r = Recorder()
    llm = r.add("llm", "target", 0.0, 1.0)
    r.add("verify", "draft", 1.0, 0.3, deps=[(llm.id, 1.0)])
    assert ideal_wall_s(r.calls, {"target": 1, "draft": 1}, NO_PINS) == pytest.approx(1.3)


def test_dep_offset_counts_from_the_producers_ideal_start():
    """A tap at 0.2 s into a producer that ideally starts at 0.5 s is ready at 0.7 s."""
    r = Recorder()
    src = r.add("src", "cpu", 0.0, 0.5)
    llm = r.add("llm", "target", 0.9, 1.0, deps=[(src.id, 0.5)])       # actually started late
    r.add("verify", "draft", 1.1, 0.3, deps=[(llm.id, 0.2)])
    sched = ideal_schedule(r.calls, {"cpu": 1, "target": 1, "draft": 1}, NO_PINS)
    assert sched[1] == (pytest.approx(0.5), pytest.approx(1.5))
    assert sched[2] == (pytest.approx(0.7), pytest.approx(1.0))


def test_join_waits_for_the_latest_input():
    r = Recorder()
    a = r.add("a", "cpu", 0.0, 0.4)
    b = r.add("b", "gpu", 0.0, 0.9)
    r.add("join", "mix", 0.9, 0.1, deps=[(a.id, 0.4), (b.id, 0.9)])
    sched = ideal_schedule(r.calls, {"cpu": 1, "gpu": 1, "mix": 1}, NO_PINS)
    assert sched[2] == (pytest.approx(0.9), pytest.approx(1.0))


def test_ideal_ignores_actual_gaps():
    """Scheduling gaps in the actual run (late t0) are not part of the ideal."""
    r = Recorder()
    a = r.add("a", "cpu", 5.0, 0.5)
    r.add("b", "cpu", 9.0, 0.5, deps=[(a.id, 0.5)])
    assert ideal_wall_s(r.calls, {"cpu": 1}, NO_PINS) == pytest.approx(1.0)


def test_blocked_time_is_not_ideal_time():
    r = Recorder()
    r.add("a", "cpu", 0.0, 0.6, blocked=0.4)      # t1 - t0 = 1.0, of which 0.4 waiting on a full channel
    assert r.calls[0].busy == pytest.approx(0.6)
    assert ideal_wall_s(r.calls, {"cpu": 1}, NO_PINS) == pytest.approx(0.6)


def test_empty_run():
    assert ideal_schedule([], {"cpu": 1}, NO_PINS) == {}
    assert ideal_wall_s([], {"cpu": 1}, NO_PINS) == 0.0
    assert stage_stats([], {}) == {}
    assert resource_busy([]) == {}


# ---------------------------------------------------------------- stage_stats, resource_busy

def test_stage_stats_excludes_blocked_and_counts_only_calls():
    r = Recorder()
    r.add("decode", "cpu", 0.0, 0.25, item=0, blocked=0.5)
    r.add("decode", "cpu", 1.0, 0.25, item=1)
    r.add("decode", "cpu", 2.0, 0.125, phase="finish")
    r.add("prefill", "gpu", 0.5, 1.0, item=0, blocked=0.125)
    r.add("prefill", "gpu", 0.0, 0.0625, phase="setup")
    stats = stage_stats(r.calls, {"decode": "cpu", "prefill": "gpu"})
    assert set(stats) == {"decode", "prefill"}
    calls = {n: [c for c in r.calls if c.node == n and c.phase != "setup"] for n in ("decode", "prefill")}
    spans = {n: {"start_s": pytest.approx(min(c.t0 for c in cs)), "end_s": pytest.approx(max(c.t1 for c in cs))}
             for n, cs in calls.items()}
    assert stats["decode"] == {"busy_s": pytest.approx(0.625), "calls": 2, "blocked_s": pytest.approx(0.5),
                               "engine_s": pytest.approx(0.5), "resource": "cpu", **spans["decode"]}
    assert stats["prefill"] == {"busy_s": pytest.approx(1.0625), "calls": 1, "blocked_s": pytest.approx(0.125),
                                "engine_s": pytest.approx(0.125), "resource": "gpu", **spans["prefill"]}
    assert stats["prefill"]["start_s"] == pytest.approx(0.5)      # its setup (at 0) is not part of the run
    assert isinstance(stats["decode"]["calls"], int)


def test_stage_stats_resource_comes_from_the_plan_mapping():
    r = Recorder()
    r.add("a", "decode", 0.0, 0.1, worker="decode[1]")
    assert stage_stats(r.calls, {"a": "decode", "b": "cpu"})["a"]["resource"] == "decode"


def test_stage_stats_rounds_to_microseconds():
    r = Recorder()
    r.add("a", "cpu", 0.0, 0.1234567891)
    assert stage_stats(r.calls, {"a": "cpu"})["a"]["busy_s"] == 0.123457


def test_resource_busy_sums_busy_per_resource():
    r = Recorder()
    r.add("a", "cpu", 0.0, 0.5, blocked=2.0)
    r.add("b", "cpu", 0.0, 0.25, worker="cpu[1]")
    r.add("c", "gpu", 0.0, 1.0, blocked=0.5)
    assert resource_busy(r.calls) == {"cpu": pytest.approx(0.75), "gpu": pytest.approx(1.0)}
    # the busy of all resources is the busy of all stages
    stats = stage_stats(r.calls, {"a": "cpu", "b": "cpu", "c": "gpu"})
    assert sum(resource_busy(r.calls).values()) == pytest.approx(sum(s["busy_s"] for s in stats.values()))


def test_busy_is_never_negative():
    rec = CallRecord(0, "a", "call", 0, "cpu", "cpu", t0=1.0, t1=1.5, blocked=0.7, engine=0.7)
    assert rec.busy == 0.0
    assert resource_busy([rec]) == {"cpu": 0.0}
    assert ideal_wall_s([rec], {"cpu": 1}, NO_PINS) == 0.0
