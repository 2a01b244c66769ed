"""The executor: bounded channels, streaming items, taps, one feedback loop, clean cancellation.

Scheduling policy (the whole of it): the main thread loops over the nodes and starts every call
that is ready — the nodes it waits for (`after:`) have finished, its run-constant inputs have
arrived and one item waits on each streamed input (or, with no streamed input, it has not been
called yet in this run) — on a free worker of its resource. Candidates are taken earliest item
first, then downstream first, which drains the pipeline before feeding it. A node's calls never overlap. When a node's streamed inputs are
exhausted its `finish` runs and its output streams end. Producers block in `emit` while a
channel is full (backpressure). A primed edge (feedback edges, or any streamed input with `prime:`)
starts with `prime` empty items (None): the consumer's first calls need nothing from its producer.

Runners differ in one thing, the worker a job runs on: `threaded` uses the plan's thread,
process and CUDA-stream workers; `sequential` runs every job to completion, one at a time, on
one thread of its own while the dispatcher waits (the no-overlap baseline, and a debugging aid).

A failure anywhere cancels the run: blocked emits raise Cancelled, running calls finish or are
abandoned after `cancel_timeout_s`, worker processes are terminated, stages are closed, and
StageFailed names the node, the phase and the item.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from graph.context import Cancelled
from graph.metrics import cpu_seconds
from graph.schedule import Plan, PlannedChannel
from graph.spec import GraphSpec
from graph.stage import Stage
from graph.jobs import Job, RemoteError, build_stage
from graph.workers import (InlineWorker, ProcessWorker, SequentialThread, StreamWorker, ThreadWorker, Worker,
                           init_torch_runtime)

log = logging.getLogger(__name__)


def _overrides_start_run(stage_cls: type) -> bool:
    return getattr(stage_cls, "start_run", Stage.start_run) is not Stage.start_run


class StageFailed(Exception):
    def __init__(self, node: str, phase: str, item: int, stage: str, error: BaseException, emitted: int = 0):
        self.node, self.phase, self.item, self.error = node, phase, item, error
        where = f"item {item}" if phase == "call" else phase
        if emitted:
            where += f" (after emitting {emitted} item{'s' * (emitted > 1)})"
        detail = f"{getattr(error, 'type_name', type(error).__name__)}: {getattr(error, 'message', error)}"
        super().__init__(f"node '{node}' ({stage}) failed on {where}: {detail}")

    @property
    def traceback_text(self) -> str:
        import traceback

        if isinstance(self.error, RemoteError):
            return self.error.tb
        return "".join(traceback.format_exception(self.error))


class Deadlock(Exception):
    pass


@dataclass
class Envelope:
    item: Any
    origin: tuple[int, float] | None  # (producing call id, busy seconds into that call) for ideal-time
    ready: Any = None                 # the producer's ReadyMark: what a consumer waits on before reading (GPU work in flight)


class Channel:
    def __init__(self, spec: PlannedChannel):
        self.spec = spec
        self.items: deque[Envelope] = deque()
        self.closed = False
        for _ in range(spec.prime):
            self.items.append(Envelope(None, None))

    @property
    def full(self) -> bool:
        return self.spec.capacity is not None and len(self.items) >= self.spec.capacity


@dataclass
class CallRecord:
    id: int
    node: str
    phase: str
    item: int
    worker: str
    resource: str
    t0: float = 0.0
    t1: float = 0.0
    blocked: float = 0.0                  # seconds spent waiting on full channels inside emit
    engine: float = 0.0                   # seconds inside the executor's emit (blocked included)
    deps: list = field(default_factory=list)   # origins of the items it consumed
    emits: list = field(default_factory=list)  # (port, t, busy offset)
    parts: list = field(default_factory=list)  # (name, t0, t1): what the stage timed with ctx.timer

    @property
    def busy(self) -> float:
        """The stage's own time: the call's span minus what the executor spent inside it."""
        return max(0.0, self.t1 - self.t0 - self.engine)


@dataclass
class RunResult:
    request: Any
    outputs: dict[str, Any]               # "node.port" -> item (or list of items for streams)
    calls: list[CallRecord]
    t_start: float
    t_end: float
    port_times: dict[str, dict]           # "node.port" -> {items, first_s, last_s} relative to start
    cpu_s: float | None = None            # CPU seconds of this process and its children during the run

    @property
    def wall_s(self) -> float:
        return self.t_end - self.t_start


@dataclass
class _NodeRun:
    stream_ports: list[str]
    pending_const: set[str]
    consts: dict = field(default_factory=dict)
    const_deps: list = field(default_factory=list)
    const_ready: list = field(default_factory=list)     # ready marks of the constant inputs
    calls: int = 0
    running: bool = False
    done: bool = False
    emitted: dict = field(default_factory=dict)
    ended: set = field(default_factory=set)


class Executor:
    def __init__(self, spec: GraphSpec, plan: Plan, *, cancel_timeout_s: float = 10.0, progress: bool | None = None,
                 record: tuple[str, ...] = ()):
        self.spec, self.plan = spec, plan
        self._processes = {n.name: n.processes for n in plan.nodes}   # processes each node's stage starts
        self.record = set(record)   # "node.port" kept in the run's outputs even when consumed
        self.cancel_timeout_s = cancel_timeout_s
        self.progress = progress
        self.cv = threading.Condition()
        self.workers: dict[str, list[Worker]] = {}
        self.node_worker_pin: dict[str, Worker] = {}
        self.setup_calls: list[CallRecord] = []
        self._records: list[CallRecord] = []
        self._failure: StageFailed | None = None
        self._waiting_workers: set[str] = set()  # workers whose call waits on backpressure (no CPU)
        self._closed = False
        self._started = False
        self._runs = 0                    # runs started: process workers keep resident values for one

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Executor":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_workers(self) -> None:
        sequential = self.plan.runner == "sequential"
        thread = SequentialThread(self.plan.cores) if sequential else None
        for r in self.plan.resources:
            if sequential:
                # one inline worker per resource keeps trace rows and devices, but nothing overlaps:
                # all of them run their jobs on one thread, one job at a time
                self.workers[r.name] = [InlineWorker(f"{r.name}", self.plan.cores, r.device, thread)]
                continue
            made: list[Worker] = []
            for i in range(r.workers):
                name = f"{r.name}[{i}]" if r.workers > 1 else r.name
                if r.kind == "process":
                    made.append(ProcessWorker(name, r.torch_threads, r.device, affinity=r.affinity))
                elif r.kind == "stream":
                    made.append(StreamWorker(name, r.torch_threads, r.device, r.priority))
                else:
                    worker = ThreadWorker(name, r.torch_threads, r.device, affinity=r.affinity)
                    if r.elastic:
                        worker.elastic = lambda me=worker: self._elastic_threads(me)
                    made.append(worker)
            self.workers[r.name] = made
        for n in self.plan.nodes:
            pool = self.workers[n.resource]
            if n.worker is not None and not sequential:
                self.node_worker_pin[n.name] = pool[n.worker]

    def _elastic_threads(self, me: Worker) -> int:
        """An elastic worker's torch threads for its next call: the cores no other CPU worker is
        busy on (each busy one counted at its planned threads; one whose call waits on a full
        channel is not busy), never fewer than its planned share."""
        taken = sum(max(w.torch_threads, self._processes.get(w.running, 0)) for pool in self.workers.values()
                    for w in pool if w is not me and w.busy and w.name not in self._waiting_workers
                    and not str(w.device).startswith("cuda"))
        return max(me.torch_threads, self.plan.cores - taken)

    def setup(self) -> None:
        """Start workers, build every stage on its worker and run `setup` (weights load here)."""
        if self._started:
            return
        self._started = True
        init_torch_runtime()
        self._make_workers()
        for pool in self.workers.values():
            for w in pool:
                w.start()
        pending = []
        for n in self.plan.nodes:
            node = self.spec.nodes[n.name]
            worker = self.node_worker_pin.get(n.name) or self.workers[n.resource][0]
            cfg = dict(node.stage_cfg)
            if not isinstance(worker, ProcessWorker):
                try:
                    worker.stages[n.name] = build_stage(cfg)
                except Exception as e:
                    self.close()
                    raise StageFailed(n.name, "setup", 0, node.stage_cls.__name__, e) from e
                for other in self.workers[n.resource]:  # any worker of a thread pool may run it
                    other.stages[n.name] = worker.stages[n.name]
            pending.append((worker, self._job(n.name, "setup", 0, {}, None, cfg)))
        self._run_jobs_and_wait(pending, self.setup_calls)

    def close(self) -> None:
        """Close every stage, stop every worker (terminating processes that do not stop)."""
        if self._closed or not self._started:
            return
        self._closed = True
        jobs = []
        for n in self.plan.nodes:
            worker = self.node_worker_pin.get(n.name) or self.workers[n.resource][0]
            if not worker.busy and worker.alive or isinstance(worker, InlineWorker):
                jobs.append((worker, self._job(n.name, "close", 0, {}, None)))
        try:
            self._run_jobs_and_wait(jobs, [], raise_first=False)
        finally:
            stuck = []
            for pool in self.workers.values():
                for w in pool:
                    if not w.stop(self.cancel_timeout_s if not w.busy else 1.0):
                        stuck.append(w.name)
            if stuck:
                log.error("workers %s did not stop; their threads are abandoned", ", ".join(stuck))

    def _run_jobs_and_wait(self, pending: list[tuple[Worker, Job]], records: list, raise_first: bool = True) -> None:
        """Setup/close: one job per worker at a time, all workers in parallel."""
        queues: dict[int, deque] = {}
        for w, job in pending:
            queues.setdefault(id(w), deque()).append((w, job))
        errors: list[StageFailed] = []
        outstanding = 0
        with self.cv:
            def start_next(key):
                nonlocal outstanding
                if queues[key]:
                    w, job = queues[key].popleft()
                    rec = CallRecord(len(records), job.node, job.phase, 0, w.name, self._resource_of(job.node))
                    records.append(rec)
                    job.on_done = lambda j, r, e, rec=rec, key=key: done(j, r, e, rec, key)
                    job.record = rec
                    outstanding += 1
                    if isinstance(w, InlineWorker):
                        self.cv.release()  # the job runs on the sequential thread and takes the lock when done
                        try:
                            w.submit(job)
                        finally:
                            self.cv.acquire()
                    else:
                        w.submit(job)

            def done(job, result, error, rec, key):
                nonlocal outstanding
                with self.cv:
                    outstanding -= 1
                    self._worker_of(rec).busy = False
                    if error is not None:
                        errors.append(StageFailed(job.node, job.phase, 0, self._class_name(job.node), error))
                    start_next(key)
                    self.cv.notify_all()

            for key in list(queues):
                start_next(key)
            while outstanding or any(queues.values()):
                self.cv.wait(0.1)
        if errors:
            for e in errors:
                if raise_first:  # the caller reports it (run.py: one line + error.txt)
                    log.debug("%s\n%s", e, e.traceback_text)
                else:  # closing after a failure: worth a line, not a second traceback
                    log.warning("%s", e)
                    log.debug("%s", e.traceback_text)
            if raise_first:
                self.close()
                raise errors[0]

    def _resource_of(self, node: str) -> str:
        return self.plan.node(node).resource

    def _class_name(self, node: str) -> str:
        return self.spec.nodes[node].stage_cls.__name__

    def _worker_of(self, rec: CallRecord) -> Worker:
        return next(w for w in self.workers[rec.resource] if w.name == rec.worker)

    def _job(self, node: str, phase: str, item: int, kwargs: dict, request: Any, cfg: dict | None = None) -> Job:
        return Job(node, phase, item, kwargs, request, on_done=lambda *a: None,
                   emit=lambda p, x: None, end=lambda p: None, cancelled=lambda: self._failure is not None,
                   stage_cfg=cfg)

    # ---------------------------------------------------------------- one run

    def run(self, request: Any = None) -> RunResult:
        if not self._started:
            self.setup()
        if self._closed:
            raise RuntimeError("executor is closed")
        spec = self.spec
        self._records = []
        self._channels: dict[tuple[str, str], Channel] = {}
        self._consumers: dict[tuple[str, str], list[Channel]] = {}
        for c in self.plan.channels:
            ch = Channel(c)
            self._channels[(c.dst, c.dst_port)] = ch
            self._consumers.setdefault((c.src, c.src_port), []).append(ch)
        self._outputs: dict[str, Any] = {}
        self._port_times: dict[str, dict] = {}
        self._state = {
            name: _NodeRun(stream_ports=node.stream_inputs,
                           pending_const={p for p, port in node.in_ports.items() if not port.stream})
            for name, node in spec.nodes.items()
        }
        self._running = 0
        self._blocked: dict[int, Channel] = {}  # call id -> channel its emit waits on
        self._waiting_workers.clear()
        self._request = request
        self._runs += 1
        for pool in self.workers.values():
            for worker in pool:
                if isinstance(worker, ProcessWorker):
                    worker.run = self._runs       # resident values of earlier runs are dropped there
        self._start_run_stages(request)
        order = {n.name: n.rank for n in self.plan.nodes}
        bar = tqdm(desc=f"run {getattr(request, 'id', '')}".strip(), unit="call", leave=False,
                   disable=None if self.progress is None else not self.progress)
        self._bar = bar
        cpu_start = cpu_seconds()
        self.t_start = time.perf_counter()
        try:
            with self.cv:
                while True:
                    if self._failure is not None:
                        raise self._failure
                    if all(s.done for s in self._state.values()):
                        break
                    started = self._dispatch(order)
                    if self._failure is not None:
                        raise self._failure
                    if not started:
                        self._check_deadlock()
                        self.cv.wait(0.05)
        except BaseException as e:
            self._cancel(e)
            raise
        finally:
            bar.close()
        t_end = time.perf_counter()
        cpu_end = cpu_seconds()
        cpu = round(cpu_end - cpu_start, 6) if cpu_start is not None and cpu_end is not None else None
        return RunResult(request, self._outputs, self._records, self.t_start, t_end, self._port_times, cpu)

    def _start_run_stages(self, request: Any) -> None:
        """Every stage that keeps per-run state starts the run clean: its `start_run`, on its own
        worker, before any call of the run (so after a cancelled run too)."""
        jobs = [(self.node_worker_pin.get(n.name) or self.workers[n.resource][0],
                 self._job(n.name, "start_run", 0, {}, request))
                for n in self.plan.nodes if _overrides_start_run(self.spec.nodes[n.name].stage_cls)]
        if jobs:
            self._run_jobs_and_wait(jobs, [])

    def _dispatch(self, order: dict[str, int]) -> bool:
        """Start every ready call that has a free worker. Caller holds self.cv."""
        started = False
        candidates = sorted((n for n, s in self._state.items() if not s.running and not s.done),
                            key=lambda n: (self._state[n].calls, -order[n]))
        for name in candidates:
            worker = self._free_worker(name)
            if worker is None:
                continue
            job = self._take_job(name)
            if job is None:
                continue
            self._start(name, job, worker)
            started = True
            if self._failure is not None:
                break
        return started

    def _free_worker(self, name: str) -> Worker | None:
        pinned = self.node_worker_pin.get(name)
        if pinned is not None:
            return None if pinned.busy else pinned
        return next((w for w in self.workers[self._resource_of(name)] if not w.busy), None)

    def _take_job(self, name: str) -> tuple[str, dict, list] | None:
        """Pop the inputs of the node's next call, if it is ready: (phase, kwargs, deps)."""
        st = self._state[name]
        if st.calls == 0 and not all(self._state[a].done for a in self.spec.nodes[name].after):
            return None
        for port in sorted(st.pending_const):
            ch = self._channels[(name, port)]
            if ch.items:
                env = ch.items.popleft()
                st.consts[port] = env.item
                if env.origin:
                    st.const_deps.append(env.origin)
                if env.ready is not None:
                    st.const_ready.append(env.ready)
                st.pending_const.discard(port)
                self.cv.notify_all()
            elif ch.closed:
                src = ch.spec
                self._fail(name, "call", st.calls, RuntimeError(
                    f"input '{port}' never arrived: {src.src} finished without emitting '{src.src_port}'"))
                return None
        if st.pending_const:
            return None
        if not st.stream_ports:
            return (("call", dict(st.consts), list(st.const_deps), list(st.const_ready)) if st.calls == 0
                    else ("finish", {}, [], []))
        heads = [self._channels[(name, p)] for p in st.stream_ports]
        if all(ch.items for ch in heads):
            first = st.calls == 0
            kwargs, deps, ready = dict(st.consts), list(st.const_deps) if first else [], list(st.const_ready) if first else []
            for port, ch in zip(st.stream_ports, heads):
                env = ch.items.popleft()
                kwargs[port] = env.item
                if env.origin:
                    deps.append(env.origin)
                if env.ready is not None:
                    ready.append(env.ready)
            self.cv.notify_all()  # room in the channels: wake blocked producers
            return "call", kwargs, deps, ready
        if any(ch.closed and not ch.items for ch in heads):
            return "finish", {}, [], []
        return None

    def _start(self, name: str, job_spec: tuple[str, dict, list, list], worker: Worker) -> None:
        phase, kwargs, deps, ready = job_spec
        st = self._state[name]
        if phase == "finish" and self.spec.nodes[name].stage_cls.finish is Stage.finish:
            self._finish_node(name)  # nothing to flush: skip the round trip
            return
        item = st.calls
        rec = CallRecord(len(self._records), name, phase, item, worker.name, self._resource_of(name), deps=deps)
        self._records.append(rec)
        st.running = True
        self._running += 1
        job = Job(name, phase, item, kwargs, self._request,
                  on_done=lambda j, r, e, rec=rec: self._on_done(rec, r, e),
                  emit=lambda port, x, rec=rec: self._emit(rec, port, x),
                  end=lambda port, rec=rec: self._end(rec.node, port),
                  cancelled=lambda: self._failure is not None, record=rec, wait_for=ready)
        if isinstance(worker, InlineWorker):
            self.cv.release()  # the inline job emits, which takes the lock
            try:
                worker.busy = True
                worker.submit(job)
            finally:
                self.cv.acquire()
        else:
            worker.submit(job)

    def _on_done(self, rec: CallRecord, result: Any, error: BaseException | None) -> None:
        with self.cv:
            if error is None and self._failure is None:
                try:  # returned outputs are emitted before the worker counts as free
                    for port, value in (result or {}).items():
                        self._emit(rec, port, value, returned=True)
                except BaseException as e:
                    error = e
            self._worker_of(rec).busy = False
            st = self._state[rec.node]
            st.running = False
            self._running -= 1
            if error is not None:
                if not isinstance(error, Cancelled) or self._failure is None:
                    self._fail(rec.node, rec.phase, rec.item, error, emitted=len(rec.emits))
            elif rec.phase == "call":
                st.calls += 1
            else:
                self._finish_node(rec.node)
            self._bar.update(1)
            self.cv.notify_all()

    def _finish_node(self, name: str) -> None:
        st = self._state[name]
        st.done = True
        for port in self.spec.nodes[name].out_ports:
            self._close_port(name, port)

    def _close_port(self, name: str, port: str) -> None:
        self._state[name].ended.add(port)
        for ch in self._consumers.get((name, port), []):
            ch.closed = True

    def _end(self, name: str, port: str) -> None:
        with self.cv:
            if not self.spec.nodes[name].out_ports[port].stream:
                raise ValueError(f"{name}.end('{port}'): only streamed ports can be ended")
            self._close_port(name, port)
            self.cv.notify_all()

    def _emit(self, rec: CallRecord, port: str, item: Any, returned: bool = False) -> None:
        """Hand `item` to every consumer of `port`. From inside a call (ctx.emit) the time spent
        here is the executor's, not the stage's; a call's returned outputs (`returned`, lock held)
        are published after the call's span ended. An item emitted in the middle of a call (a tap)
        may still be being computed on the producer's device: it travels with the producer
        worker's ready mark (Worker.mark_ready), which the consumer's worker waits on before the
        call that reads it (Worker.await_ready); returned outputs are complete (the worker
        finished the job)."""
        if returned:
            return self._emit_locked(rec, port, item, offset=rec.busy)
        t_enter = time.perf_counter()
        ready = self._worker_of(rec).mark_ready()     # on the producer's thread, inside its stream
        try:
            with self.cv:
                self._emit_locked(rec, port, item, offset=t_enter - rec.t0 - rec.engine, ready=ready)
        finally:
            rec.engine += time.perf_counter() - t_enter

    def _emit_locked(self, rec: CallRecord, port: str, item: Any, offset: float, ready: Any = None) -> None:
        name = rec.node
        outs = self.spec.nodes[name].out_ports
        if port not in outs:
            raise KeyError(f"{name} emitted to '{port}', which its stage does not declare "
                           f"(outputs: {', '.join(outs) or 'none'})")
        st = self._state[name]
        if port in st.ended:
            raise RuntimeError(f"{name} emitted to '{port}' after ending it")
        if not outs[port].stream and st.emitted.get(port):
            raise RuntimeError(f"{name} emitted twice to '{port}', which is not a streamed port "
                               "(declare Out(..., stream=True))")
        if self._failure is not None:
            raise Cancelled("run cancelled")
        origin = (rec.id, offset)
        for ch in self._consumers.get((name, port), []):
            if ch.full:
                t_wait = time.perf_counter()
                self._blocked[rec.id] = ch
                self._waiting_workers.add(rec.worker)
                while ch.full and self._failure is None:
                    self.cv.wait(0.05)
                del self._blocked[rec.id]
                self._waiting_workers.discard(rec.worker)
                rec.blocked += time.perf_counter() - t_wait
                if self._failure is not None:
                    raise Cancelled("run cancelled")
            ch.items.append(Envelope(item, origin, ready))
        st.emitted[port] = st.emitted.get(port, 0) + 1
        key = f"{name}.{port}"
        now = time.perf_counter()  # when the item was actually handed over (after any backpressure)
        t = now - self.t_start
        pt = self._port_times.setdefault(key, {"items": 0, "first_s": t, "last_s": t})
        pt["items"] += 1
        pt["last_s"] = t
        rec.emits.append((port, now, offset))
        if not self._consumers.get((name, port)) or key in self.record:
            if outs[port].stream:
                self._outputs.setdefault(key, []).append(item)
            else:
                self._outputs[key] = item
        self.cv.notify_all()

    def _fail(self, node: str, phase: str, item: int, error: BaseException, emitted: int = 0) -> None:
        if self._failure is None:
            self._failure = StageFailed(node, phase, item, self._class_name(node), error, emitted)
            log.debug("%s\n%s", self._failure, self._failure.traceback_text)
        self.cv.notify_all()

    def _check_deadlock(self) -> None:
        """Nothing can start; if every running call waits on a full channel, nothing ever will."""
        if self._running and len(self._blocked) < self._running:
            return
        if any(not ch.full for ch in self._blocked.values()):
            return
        if not self._running and self._failure is None:
            waiting = []
            for name, st in self._state.items():
                if st.done:
                    continue
                missing = sorted(st.pending_const) or [p for p in st.stream_ports if not self._channels[(name, p)].items]
                missing = [a for a in self.spec.nodes[name].after if not self._state[a].done] or missing
                waiting.append(f"{name} waits for {', '.join(missing) or 'a worker'}")
            self._failure = StageFailed("executor", "run", 0, "scheduler", Deadlock(
                "no call can start and none is running: " + "; ".join(waiting)))
            return
        if self._running:
            blocked = [f"{r.node} blocked on full {ch.spec.edge}" for r in self._records
                       if r.id in self._blocked for ch in [self._blocked[r.id]]]
            self._failure = StageFailed("executor", "run", 0, "scheduler", Deadlock(
                "every running call is blocked on a full channel whose consumer cannot start: "
                + "; ".join(blocked) + ". Fix: put producer and consumer on different resources or raise "
                "the edge's capacity (graph.nodes.<consumer>.inputs.<port>.capacity)."))
            self.cv.notify_all()

    def _cancel(self, reason: BaseException) -> None:
        """Stop the run: wake blocked emits, wait a little for running calls, then close all."""
        with self.cv:
            if self._failure is None:
                self._failure = StageFailed("executor", "run", 0, "run", reason)
            self.cv.notify_all()
            deadline = time.perf_counter() + self.cancel_timeout_s
            while self._running and time.perf_counter() < deadline:
                for pool in self.workers.values():  # processes can be stopped at once
                    for w in pool:
                        if isinstance(w, ProcessWorker) and w.busy and w.process.is_alive():
                            w.process.terminate()
                self.cv.wait(0.05)
        self.close()
