"""One request's run: the channels, each node's state, the call records, and the ready-set loop.

Scheduling policy (the whole of it): the main thread loops over the nodes and starts every call
that is ready — the nodes it waits for (`after:`) have finished, its run-constant inputs have
arrived and one item waits on each streamed input (or, with no streamed input, it has not been
called yet in this run) — on a free worker of its resource. Candidates are taken earliest item
first, then downstream first, which drains the pipeline before feeding it. A node's calls never
overlap. When a node's streamed inputs are exhausted its `finish` runs and its output streams
end. Producers block in `emit` while a channel is full (backpressure). A primed edge (feedback
edges, or any streamed input with `prime:`) starts with `prime` empty items (None): the
consumer's first calls need nothing from its producer. When nothing can start and every running
call waits on a full channel (or nothing runs at all), nothing ever will: that is a Deadlock,
named with what each node waits for. The first failure stops dispatching; the executor cancels.

One lock (the executor's condition variable) guards all of it: the loop holds it while it looks
and starts, and workers take it to emit, end a port or report a call done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from graph.context import Cancelled
from graph.jobs import Job
from graph.pools import WorkerPools
from graph.records import CallRecord, Deadlock, StageFailed
from graph.schedule import Plan, PlannedChannel
from graph.spec import GraphSpec
from graph.stage import Stage
from graph.workers import InlineWorker, Worker

log = logging.getLogger(__name__)


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


class RequestRun:
    def __init__(self, spec: GraphSpec, plan: Plan, workers: WorkerPools, cv: threading.Condition, request: Any,
                 record: set[str], on_call_done: Callable[[], None] = lambda: None):
        self.spec, self.plan, self.workers, self.cv, self.request = spec, plan, workers, cv, request
        self.record = record                  # "node.port" kept in the outputs even when consumed
        self.on_call_done = on_call_done
        self.records: list[CallRecord] = []
        self.channels: dict[tuple[str, str], Channel] = {}
        self.consumers: dict[tuple[str, str], list[Channel]] = {}
        for c in plan.channels:
            ch = Channel(c)
            self.channels[(c.dst, c.dst_port)] = ch
            self.consumers.setdefault((c.src, c.src_port), []).append(ch)
        self.outputs: dict[str, Any] = {}
        self.port_times: dict[str, dict] = {}
        self.state = {
            name: _NodeRun(stream_ports=node.stream_inputs,
                           pending_const={p for p, port in node.in_ports.items() if not port.stream})
            for name, node in spec.nodes.items()
        }
        self.order = {n.name: n.rank for n in plan.nodes}
        self.running = 0                      # calls started and not yet done
        self.blocked: dict[int, Channel] = {}  # call id -> channel its emit waits on
        self.failure: StageFailed | None = None
        self.t_start = 0.0

    # ---------------------------------------------------------------- the loop

    def drive(self) -> None:
        """Dispatch until every node is done; raise the run's failure, if any."""
        self.t_start = time.perf_counter()
        with self.cv:
            while True:
                if self.failure is not None:
                    raise self.failure
                if all(s.done for s in self.state.values()):
                    return
                started = self._dispatch()
                if self.failure is not None:
                    raise self.failure
                if not started:
                    self._check_deadlock()
                    self.cv.wait(0.05)

    def fail_with(self, reason: BaseException) -> None:
        """Stop the run from outside (Ctrl-C, a failure in the loop): blocked emits wake and raise."""
        if self.failure is None:
            self.failure = StageFailed("executor", "run", 0, "run", reason)
        self.cv.notify_all()

    def _dispatch(self) -> bool:
        """Start every ready call that has a free worker. Caller holds self.cv."""
        started = False
        candidates = sorted((n for n, s in self.state.items() if not s.running and not s.done),
                            key=lambda n: (self.state[n].calls, -self.order[n]))
        for name in candidates:
            worker = self.workers.free(name)
            if worker is None:
                continue
            job = self._take_inputs(name)
            if job is None:
                continue
            self._start(name, job, worker)
            started = True
            if self.failure is not None:
                break
        return started

    def _take_inputs(self, name: str) -> tuple[str, dict, list, list] | None:
        """Pop the inputs of the node's next call, if it is ready: (phase, kwargs, deps, ready marks)."""
        st = self.state[name]
        if st.calls == 0 and not all(self.state[a].done for a in self.spec.nodes[name].after):
            return None
        for port in sorted(st.pending_const):
            ch = self.channels[(name, port)]
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
        heads = [self.channels[(name, p)] for p in st.stream_ports]
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
        st = self.state[name]
        if phase == "finish" and self.spec.nodes[name].stage_cls.finish is Stage.finish:
            self._finish_node(name)  # nothing to flush: skip the round trip
            return
        item = st.calls
        rec = CallRecord(len(self.records), name, phase, item, worker.name, self.plan.node(name).resource, deps=deps)
        self.records.append(rec)
        st.running = True
        self.running += 1
        job = Job(name, phase, item, kwargs, self.request,
                  on_done=lambda j, r, e, rec=rec: self._on_done(rec, r, e),
                  emit=lambda port, x, rec=rec: self._emit(rec, port, x),
                  end=lambda port, rec=rec: self._end(rec.node, port),
                  cancelled=lambda: self.failure is not None, record=rec, wait_for=ready)
        if isinstance(worker, InlineWorker):
            self.cv.release()  # the inline job emits, which takes the lock
            try:
                worker.busy = True
                worker.submit(job)
            finally:
                self.cv.acquire()
        else:
            worker.submit(job)

    # ---------------------------------------------------------------- what workers report (they take the lock)

    def _on_done(self, rec: CallRecord, result: Any, error: BaseException | None) -> None:
        with self.cv:
            if error is None and self.failure is None:
                try:  # returned outputs are emitted before the worker counts as free
                    for port, value in (result or {}).items():
                        self._emit(rec, port, value, returned=True)
                except BaseException as e:
                    error = e
            self.workers.named(rec.resource, rec.worker).busy = False
            st = self.state[rec.node]
            st.running = False
            self.running -= 1
            if error is not None:
                if not isinstance(error, Cancelled) or self.failure is None:
                    self._fail(rec.node, rec.phase, rec.item, error, emitted=len(rec.emits))
            elif rec.phase == "call":
                st.calls += 1
            else:
                self._finish_node(rec.node)
            self.on_call_done()
            self.cv.notify_all()

    def _finish_node(self, name: str) -> None:
        st = self.state[name]
        st.done = True
        for port in self.spec.nodes[name].out_ports:
            self._close_port(name, port)

    def _close_port(self, name: str, port: str) -> None:
        self.state[name].ended.add(port)
        for ch in self.consumers.get((name, port), []):
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
        ready = self.workers.named(rec.resource, rec.worker).mark_ready()   # on the producer's thread, inside its stream
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
        st = self.state[name]
        if port in st.ended:
            raise RuntimeError(f"{name} emitted to '{port}' after ending it")
        if not outs[port].stream and st.emitted.get(port):
            raise RuntimeError(f"{name} emitted twice to '{port}', which is not a streamed port "
                               "(declare Out(..., stream=True))")
        if self.failure is not None:
            raise Cancelled("run cancelled")
        origin = (rec.id, offset)
        for ch in self.consumers.get((name, port), []):
            if ch.full:
                self._wait_for_room(rec, ch)
            ch.items.append(Envelope(item, origin, ready))
        st.emitted[port] = st.emitted.get(port, 0) + 1
        key = f"{name}.{port}"
        now = time.perf_counter()  # when the item was actually handed over (after any backpressure)
        t = now - self.t_start
        pt = self.port_times.setdefault(key, {"items": 0, "first_s": t, "last_s": t})
        pt["items"] += 1
        pt["last_s"] = t
        rec.emits.append((port, now, offset))
        if not self.consumers.get((name, port)) or key in self.record:
            if outs[port].stream:
                self.outputs.setdefault(key, []).append(item)
            else:
                self.outputs[key] = item
        self.cv.notify_all()

    def _wait_for_room(self, rec: CallRecord, ch: Channel) -> None:
        """Backpressure: the emitting call waits (lock released) until its consumer took an item."""
        t_wait = time.perf_counter()
        worker = self.workers.named(rec.resource, rec.worker)
        self.blocked[rec.id] = ch
        worker.waiting = True
        while ch.full and self.failure is None:
            self.cv.wait(0.05)
        del self.blocked[rec.id]
        worker.waiting = False
        rec.blocked += time.perf_counter() - t_wait
        if self.failure is not None:
            raise Cancelled("run cancelled")

    # ---------------------------------------------------------------- failure

    def _fail(self, node: str, phase: str, item: int, error: BaseException, emitted: int = 0) -> None:
        if self.failure is None:
            self.failure = StageFailed(node, phase, item, self.spec.nodes[node].stage_cls.__name__, error, emitted)
            log.debug("%s\n%s", self.failure, self.failure.traceback_text)
        self.cv.notify_all()

    def _check_deadlock(self) -> None:
        """Nothing can start; if every running call waits on a full channel, nothing ever will."""
        if self.running and len(self.blocked) < self.running:
            return
        if any(not ch.full for ch in self.blocked.values()):
            return
        if not self.running and self.failure is None:
            waiting = []
            for name, st in self.state.items():
                if st.done:
                    continue
                missing = sorted(st.pending_const) or [p for p in st.stream_ports if not self.channels[(name, p)].items]
                missing = [a for a in self.spec.nodes[name].after if not self.state[a].done] or missing
                waiting.append(f"{name} waits for {', '.join(missing) or 'a worker'}")
            self.failure = StageFailed("executor", "run", 0, "scheduler", Deadlock(
                "no call can start and none is running: " + "; ".join(waiting)))
            return
        if self.running:
            blocked = [f"{r.node} blocked on full {ch.spec.edge}" for r in self.records
                       if r.id in self.blocked for ch in [self.blocked[r.id]]]
            self.failure = StageFailed("executor", "run", 0, "scheduler", Deadlock(
                "every running call is blocked on a full channel whose consumer cannot start: "
                + "; ".join(blocked) + ". Fix: put producer and consumer on different resources or raise "
                "the edge's capacity (graph.nodes.<consumer>.inputs.<port>.capacity)."))
            self.cv.notify_all()
