"""The executor: streaming, backpressure, taps, the feedback loop, failures and clean-up."""

import multiprocessing
import threading
import time

import pytest

from graph.executor import Executor, StageFailed
from stages.types import Request
from tests.helpers import make, node

P = "bench.synthetic"
H = "tests.helpers"


def run_once(nodes, **kw):
    spec, plan = make(nodes, **kw)
    with Executor(spec, plan, progress=False) as ex:
        return ex.run(Request()), plan


def calls_of(result, name):
    return [c for c in result.calls if c.node == name and c.phase == "call"]


def loop_nodes(prime, rounds=12, on_draft="draft", iters=2):
    return {
        "src": node(f"{P}.Producer", items=3, iters=iters, size=64),
        "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=iters, size=64),
        "query": node(f"{P}.LayeredForward", "target", {"state": "sink.summary"}, layers=4, tap_layer=1, iters=iters, size=64),
        "reader": node(f"{P}.TapReader", on_draft, {"hidden": "query.hidden"}, iters=iters, size=64),
        "propose": node(f"{P}.Proposer", on_draft, {
            "selection": "reader.selection", "first": "query.first",
            "verdict": {"from": "check.verdict", "feedback": True, "prime": prime}}, iters=iters, size=128),
        "check": node(f"{P}.Checker", "target", {"proposal": "propose.proposal"}, rounds=rounds, iters=4 * iters, size=128),
    }


def test_streaming_consumer_starts_on_the_first_item(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=8, iters=6, size=128),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=6, size=128)}
    result, _ = run_once(nodes)
    producer = calls_of(result, "src")[0]
    consumer = calls_of(result, "sink")
    assert len(consumer) == 8
    assert consumer[0].t0 < producer.t1, "the consumer waited for the whole stream"
    assert result.outputs["sink.summary"].index == 8


def test_backpressure_bounds_how_far_the_producer_runs_ahead(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=12, iters=0, size=8),
             "sink": node(f"{H}.SlowSink", "target", {"item": "src.item"}, delay=0.01)}
    result, _ = run_once(nodes, capacity=1)
    producer = calls_of(result, "src")[0]
    sink_ends = [c.t1 for c in calls_of(result, "sink")]
    emits = [t for _, t, _ in producer.emits]
    # with capacity 1, item k can only be put once the consumer has taken item k-1 off the
    # channel, which it does only after its call on item k-2 has ended
    for k in range(2, len(emits)):
        assert emits[k] >= sink_ends[k - 2], f"item {k} was put before the consumer finished item {k - 2}"
    assert producer.blocked > 0.05  # it really waited, and waiting is not counted as busy
    assert producer.busy < producer.t1 - producer.t0 - 0.05
    assert result.outputs["sink.count"] == 12


def test_tap_is_consumed_while_its_producer_goes_on(no_leftovers):
    nodes = loop_nodes(prime=1, rounds=2)
    # plenty of work after the tap (7 of 8 layers), so the reader has time to start meanwhile
    nodes["query"]["stage"].update(layers=8, tap_layer=1, iters=20, size=192)
    result, _ = run_once(nodes)
    query = calls_of(result, "query")[0]
    reader = calls_of(result, "reader")[0]
    tap_time = next(t for port, t, _ in query.emits if port == "hidden")
    assert tap_time < query.t1
    assert reader.t0 < query.t1, "the tap's consumer waited for the producer to return"
    assert [d[0] for d in reader.deps] == [query.id]


@pytest.mark.parametrize("prime", [1, 2])
def test_feedback_loop_runs_its_rounds_and_ends(prime, no_leftovers):
    result, _ = run_once(loop_nodes(prime, rounds=12))
    tokens = result.outputs["check.tokens"]
    assert tokens.meta["rounds"] == 12
    assert len(calls_of(result, "propose")) >= 12


def test_draft_one_round_ahead_gives_the_same_tokens_and_overlaps():
    def nodes(prime):
        made = loop_nodes(prime=prime, rounds=20, iters=4)
        made["check"]["stage"]["wait_s"] = 0.01   # verification leaves the core free (a GPU's), as it would on one
        return made

    sequential, _ = run_once(nodes(1))
    ahead, _ = run_once(nodes(2))
    inline, _ = run_once(nodes(2), runner="sequential")
    assert sequential.outputs["check.tokens"].ids == ahead.outputs["check.tokens"].ids == inline.outputs["check.tokens"].ids

    def overlaps(result):
        checks = calls_of(result, "check")
        return sum(1 for p in calls_of(result, "propose") for c in checks if p.t0 < c.t1 and c.t0 < p.t1)

    def verdict_lags(result):
        """How many rounds back each proposal's verdict came from (the schedule, not the timing)."""
        check_round = {c.id: k for k, c in enumerate(calls_of(result, "check"))}
        return {i - check_round[d[0]] for i, p in enumerate(calls_of(result, "propose"))
                for d in p.deps if d[0] in check_round}

    assert verdict_lags(sequential) == {1}  # prime 1: each draft waits for the last verdict
    assert verdict_lags(ahead) == {2}       # prime 2: each draft runs one verdict ahead
    assert overlaps(sequential) == 0
    assert overlaps(ahead) >= 5             # and the draft runs while the verifier waits


def test_a_node_that_waits_for_another_starts_when_it_has_finished(no_leftovers):
    """`after: [src]`: the late consumer's first call starts once the producer has finished, while
    the other consumer streams; its channel is unbounded (a bound of 1 would stop the producer it
    waits for), so with capacity 1 everywhere else nothing deadlocks and no item is lost."""
    nodes = {"src": node(f"{P}.Producer", items=6, iters=2, size=32),
             "sink": node(f"{H}.SlowSink", "target", {"item": "src.item"}, delay=0.005),
             "late": {**node(f"{H}.Collect", "draft", {"item": "src.item"}), "after": ["src"]}}
    result, plan = run_once(nodes, capacity=1)
    producer = calls_of(result, "src")[0]
    late = calls_of(result, "late")
    assert len(late) == 6 and late[0].t0 >= producer.t1
    assert calls_of(result, "sink")[0].t0 < producer.t1          # the other consumer did not wait
    assert [i.index for i in result.outputs["late.items"]] == list(range(6))
    channel = next(c for c in plan.channels if c.dst == "late")
    assert channel.capacity is None and "waits for src" in channel.note
    assert "# after src" in plan.to_text()


def test_a_node_downstream_of_a_waiting_one_does_not_stop_the_producer_it_waits_for(no_leftovers):
    """join pairs src's items with late's, and late waits for src to finish: with src → join
    bounded at 1, src would block on its second item and late would never start."""
    nodes = {"src": node(f"{P}.Producer", items=5, iters=0, size=8),
             "late": {**node(f"{P}.Identity", "draft", {"item": "src.item"}), "after": ["src"]},
             "join": node(f"{H}.Pair", "target", {"a": "late.item", "b": "src.item"})}
    result, plan = run_once(nodes, capacity=1)
    assert [(a.index, b.index) for a, b in result.outputs["join.pairs"]] == [(i, i) for i in range(5)]
    assert next(c for c in plan.channels if c.src == "src" and c.dst == "join").capacity is None


def test_a_primed_input_gives_its_consumer_a_first_call_without_an_item(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=2, iters=0, size=8),
             "take": node(f"{H}.Collect", "target", {"item": {"from": "src.item", "prime": 1}})}
    result, plan = run_once(nodes)
    items = result.outputs["take.items"]
    assert items[0] is None and [i.index for i in items[1:]] == [0, 1]
    assert next(c for c in plan.channels if c.dst == "take").prime == 1


def test_two_resources_really_run_at_once():
    """Two matmul-bound stages on two thread workers overlap in time (torch releases the GIL)."""
    nodes = {"src": node(f"{P}.Producer", items=6, iters=20, size=256),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=20, size=256)}
    result, _ = run_once(nodes)
    producer = calls_of(result, "src")[0]
    busy_in_producer = sum(min(c.t1, producer.t1) - max(c.t0, producer.t0)
                           for c in calls_of(result, "sink") if c.t0 < producer.t1)
    assert busy_in_producer > 0.3 * (producer.t1 - producer.t0)


def test_torch_threads_follow_the_plan():
    nodes = {"a": node(f"{H}.ThreadProbe", "cpu"), "b": node(f"{H}.ThreadProbe", "target"),
             "c": node(f"{H}.ThreadProbe", "decode")}
    result, plan = run_once(nodes)
    for name, res in [("a", "cpu"), ("b", "target"), ("c", "decode")]:
        assert result.outputs[f"{name}.info"]["torch_threads"] == plan.resource(res).torch_threads
    assert result.outputs["c.info"]["pid"] != result.outputs["a.info"]["pid"]  # a real worker process


def test_sequential_runner_gives_the_same_outputs_without_overlap():
    nodes = {"src": node(f"{P}.Producer", items=5, iters=4, size=64),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=4, size=64)}
    result, plan = run_once(nodes, runner="sequential")
    assert result.outputs["sink.summary"].index == 5
    spans = sorted((c.t0, c.t1) for c in result.calls)
    assert all(a[1] <= b[0] + 1e-6 for a, b in zip(spans, spans[1:])), "calls overlapped in the sequential runner"


def test_executor_runs_many_requests_after_one_setup():
    spec, plan = make(loop_nodes(prime=2, rounds=6))
    with Executor(spec, plan, progress=False) as ex:
        first = ex.run(Request(id="a")).outputs["check.tokens"].ids
        second = ex.run(Request(id="b")).outputs["check.tokens"].ids
        assert len(ex.setup_calls) == 6
    assert first == second


def test_process_pool_stage_streams_into_a_thread_stage(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", "decode", items=6, iters=2, size=64),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=2, size=64)}
    result, _ = run_once(nodes)
    assert result.outputs["sink.summary"].index == 6
    assert len(calls_of(result, "sink")) == 6


# ------------------------------------------------------------------ failures and clean-up


@pytest.mark.parametrize("where", ["target", "decode"])
def test_failure_names_node_and_item_and_cleans_up(where, no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=50, iters=1, size=64),
             "sink": node(f"{P}.Consumer", where, {"item": "src.item"}, iters=1, size=64, fail_at=3)}
    spec, plan = make(nodes)
    ex = Executor(spec, plan, progress=False)
    with pytest.raises(StageFailed) as e:
        with ex:
            ex.run(Request())
    assert e.value.node == "sink" and e.value.item == 3
    assert "node 'sink' (Consumer) failed on item 3: RuntimeError" in str(e.value)
    assert "maybe_fail" in e.value.traceback_text  # the stage's own traceback is kept


def test_failure_in_a_streaming_producer_in_a_process(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", "decode", items=50, iters=1, size=64, fail_at=4),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=1, size=64)}
    spec, plan = make(nodes)
    with pytest.raises(StageFailed, match=r"node 'src' \(Producer\) failed on item 0 \(after emitting 4 items\)"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())


def test_a_worker_process_that_dies(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=10, iters=0, size=8),
             "crash": node(f"{H}.Crash", "decode", {"item": "src.item"}, at=2)}
    spec, plan = make(nodes)
    with pytest.raises(StageFailed, match=r"node 'crash' \(Crash\) failed on item 2: WorkerDied: .*exit code 3"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())


def test_failure_cancels_a_producer_blocked_on_backpressure(no_leftovers):
    nodes = {"src": node(f"{H}.Forever", "cpu"),
             "sink": node(f"{H}.SlowSink", "target", {"item": "src.item"}, delay=0.01, fail_at=5)}
    spec, plan = make(nodes, capacity=1)
    t = time.perf_counter()
    with pytest.raises(StageFailed, match="node 'sink'"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())
    assert time.perf_counter() - t < 5


def test_missing_output_is_an_error_not_a_hang(no_leftovers):
    nodes = {"a": node(f"{H}.Silent"), "b": node(f"{H}.NeedsPayload", "target", {"value": "a.value"})}
    spec, plan = make(nodes)
    with pytest.raises(StageFailed, match="input 'value' never arrived: a finished without emitting 'value'"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())


def test_emit_to_an_undeclared_port(no_leftovers):
    spec, plan = make({"a": node(f"{H}.Rogue")})
    with pytest.raises(StageFailed, match="emitted to 'other', which its stage does not declare"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())


def test_setup_failure_is_reported_and_cleaned_up(no_leftovers):
    spec, plan = make({"a": node(f"{P}.Producer", "decode", items=0)})  # __init__ raises in the child
    with pytest.raises(StageFailed, match=r"node 'a' \(Producer\) failed on setup: ValueError: items must be"):
        with Executor(spec, plan, progress=False) as ex:
            ex.run(Request())


def test_keyboard_interrupt_cancels_and_cleans_up(no_leftovers, ctrl_c):
    """Ctrl-C lands in the main thread's wait; the run is cancelled and everything stops."""
    nodes = {"src": node(f"{H}.Forever", "decode"),
             "sink": node(f"{H}.SlowSink", "target", {"item": "src.item"}, delay=0.001)}
    spec, plan = make(nodes)
    ex = Executor(spec, plan, progress=False)
    ex.setup()
    timer = threading.Timer(0.5, lambda: __import__("_thread").interrupt_main())
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        try:
            ex.run(Request())
        finally:
            ex.close()
    assert not multiprocessing.active_children()


def test_elastic_torch_threads_take_the_cores_other_workers_leave_idle():
    """torch_threads: elastic — the target gets its planned share (1 of 2 cores) while the cpu
    worker is busy, and both cores for the calls after it is done."""
    from tests.helpers import CPU

    resources = {**CPU, "pools": {**CPU["pools"], "target": {"kind": "thread", "workers": 1, "torch_threads": "elastic"}}}
    nodes = {"src": node(f"{H}.PacedSource", items=3, tail_s=0.4),
             "sink": node(f"{H}.ThreadsPerItem", "target", {"item": "src.item"}, delay=0.3)}
    spec, plan = make(nodes, resources=resources, capacity=8)
    assert plan.resource("target").torch_threads == 1 and plan.resource("target").elastic
    assert "torch_threads=1+elastic" in plan.to_text()
    with Executor(spec, plan, progress=False) as ex:
        seen = ex.run(Request()).outputs["sink.threads"]
    assert seen[0] == 1 and seen[-2] == 2, seen      # item 0 while src sleeps; item 2 after it returned


def test_an_elastic_workers_finish_takes_the_cores_left_idle_after_its_last_call():
    """A one-shot stage (a whole-prompt prefill) collects its inputs in calls and does its forward
    in `finish`: every call here comes while the cpu worker is busy (1 thread), the finish after
    it returned, so the finish gets both cores."""
    from tests.helpers import CPU

    elastic_target = {"kind": "thread", "workers": 1, "torch_threads": "elastic"}
    resources = {**CPU, "pools": {**CPU["pools"], "target": elastic_target}}
    nodes = {"src": node(f"{H}.PacedSource", items=3, tail_s=0.5),
             "sink": node(f"{H}.ThreadsPerItem", "target", {"item": "src.item"}, delay=0.02)}
    spec, plan = make(nodes, resources=resources, capacity=8)
    with Executor(spec, plan, progress=False) as ex:
        seen = ex.run(Request()).outputs["sink.threads"]
    assert seen[:3] == [1, 1, 1] and seen[3] == 2, seen     # three calls, then finish's own count


def test_pools_run_on_the_cores_they_are_pinned_to(no_leftovers):
    """affinity pins a pool's threads (a thread's affinity is its own) and processes; the main
    thread keeps all of its cores."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    last = cores[-1]
    pools = {"cores": len(cores), "pools": {"cpu": {"kind": "thread", "torch_threads": 1, "affinity": [last]},
                                            "decode": {"kind": "process", "workers": 1, "torch_threads": 1,
                                                       "affinity": [cores[0]]},
                                            "target": {"kind": "thread", "torch_threads": 1}}}
    nodes = {"a": node(f"{H}.ThreadProbe", "cpu"), "b": node(f"{H}.ThreadProbe", "decode"),
             "c": node(f"{H}.ThreadProbe", "target")}
    result, plan = run_once(nodes, resources=pools)
    assert result.outputs["a.info"]["cores"] == [last]
    assert result.outputs["b.info"]["cores"] == [cores[0]]
    assert result.outputs["c.info"]["cores"] == cores
    assert sorted(os.sched_getaffinity(0)) == cores
    assert f"cores {last}" in plan.to_text()


def test_affinity_outside_the_allowed_cores_is_a_config_error():
    from graph.resources import load_resources
    from graph.spec import ConfigError

    with pytest.raises(ConfigError, match=r"affinity=\[4096\].*Fix: resources.pools.draft.affinity=null"):
        load_resources({"cores": 2, "pools": {"draft": {"kind": "thread", "affinity": [4096]}}})


def test_elastic_threads_are_refused_on_a_process_pool():
    from graph.resources import load_resources
    from graph.spec import ConfigError

    with pytest.raises(ConfigError, match="elastic is for thread pools"):
        load_resources({"cores": 2, "pools": {"decode": {"kind": "process", "torch_threads": "elastic"}}})


# ------------------------------------------------------------------ resident values

RESIDENT_POOLS = {"cores": 2, "pools": {"cpu": {"kind": "thread", "workers": 1, "torch_threads": 1},
                                        "proc": {"kind": "process", "workers": 1, "torch_threads": 1},
                                        "target": {"kind": "thread", "workers": 1, "torch_threads": 1}}}


def resident_nodes(scribe_on: str = "proc") -> dict:
    return {"src": node(f"{P}.Producer", items=5, iters=1, size=16),
            "ledger": node(f"{H}.Ledger", "proc"),
            "scribe": node(f"{H}.Scribe", scribe_on, {"ledger": "ledger.ledger", "item": "src.item"})}


def test_a_resident_value_stays_in_its_process_and_is_extended_in_place(no_leftovers):
    """Every call of the consumer gets the very object its producer made in the worker process
    (not a copy per call, as other values are), and the next run starts from a new one."""
    import os

    spec, plan = make(resident_nodes(), RESIDENT_POOLS)
    with Executor(spec, plan, progress=False) as ex:
        for _ in range(2):
            result = ex.run(Request())
            summary = result.outputs["scribe.summary"]
            assert summary["pid"] != os.getpid()
            assert summary["ledger"] == [summary["pid"], 0, 1, 2, 3, 4]     # five in-place appends, this run's only
            assert summary["objects"] == 1


def test_a_resident_output_read_outside_its_process_is_a_config_error():
    from graph.spec import ConfigError

    with pytest.raises(ConfigError, match="resident output.*Fix: graph.nodes.scribe.on=proc"):
        make(resident_nodes(scribe_on="target"), RESIDENT_POOLS)


# ------------------------------------------------------------------ readiness across devices

def test_items_emitted_mid_call_carry_the_producers_ready_mark_to_their_consumer(monkeypatch):
    """The ordering the GPU path relies on, shown with host stand-ins: every item a stage emits
    mid-call gets a mark made on the producer's thread at the moment of the emit (on a CUDA stream:
    an event recorded after the work that made the item), and the consumer's worker waits on
    exactly that mark before the call that reads the item starts; returned outputs need none."""
    from graph.workers import ThreadWorker

    log = []

    class Mark:
        def __init__(self, worker, n):
            self.worker, self.n, self.thread = worker, n, threading.current_thread().name

        def wait_on_host(self):
            pass

    made = {}

    def mark_ready(self):
        made[self.name] = made.get(self.name, 0) + 1
        mark = Mark(self.name, made[self.name])
        log.append(("mark", self.name, mark.n, time.perf_counter()))
        return mark

    def await_ready(self, marks):
        for m in marks:
            log.append(("await", self.name, (m.worker, m.n), time.perf_counter()))

    monkeypatch.setattr(ThreadWorker, "mark_ready", mark_ready)
    monkeypatch.setattr(ThreadWorker, "await_ready", await_ready)
    nodes = {"src": node(f"{P}.Producer", items=4, iters=1, size=16),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, iters=1, size=16)}
    result, _ = run_once(nodes)
    marks = [e for e in log if e[0] == "mark"]
    awaits = [e for e in log if e[0] == "await"]
    assert [(w, n) for _, w, n, _ in marks] == [("cpu", i) for i in range(1, 5)]     # one per emitted item
    assert [m for _, _, m, _ in awaits] == [("cpu", i) for i in range(1, 5)]         # each awaited once, in order
    assert all(w == "target" for _, w, _, _ in awaits)                               # by the consumer's worker
    sink_calls = calls_of(result, "sink")
    for (_, _, _, t_mark), (_, _, _, t_await), call in zip(marks, awaits, sink_calls):
        assert t_mark <= t_await <= call.t0         # made at the emit, awaited before the reading call
    # the consumer's summary is returned at the end of its last call: complete, so it carries no mark
    assert made == {"cpu": 4}
