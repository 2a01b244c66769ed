"""The executor: builds the plan's workers and the stages on them, runs requests, cancels cleanly.

An Executor owns what outlives a request: the workers (graph/pools.py) and the lifecycle of the
stages on them — build and `setup` (weights load here) once, `start_run` before each request,
`close` at the end. Each request is a RequestRun (graph/dispatch.py), whose module docstring
states the whole scheduling policy; the executor only starts it, shows its progress and cancels
it when it fails.

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
from typing import Any

from tqdm.auto import tqdm

from graph.dispatch import RequestRun
from graph.jobs import Job, build_stage
from graph.metrics import cpu_seconds
from graph.pools import WorkerPools
from graph.records import CallRecord, RunResult, StageFailed
from graph.schedule import Plan
from graph.spec import GraphSpec
from graph.stage import Stage
from graph.workers import InlineWorker, ProcessWorker, Worker, init_torch_runtime

__all__ = ["CallRecord", "Executor", "RunResult", "StageFailed"]

log = logging.getLogger(__name__)


def _overrides_start_run(stage_cls: type) -> bool:
    return getattr(stage_cls, "start_run", Stage.start_run) is not Stage.start_run


class Executor:
    def __init__(self, spec: GraphSpec, plan: Plan, *, cancel_timeout_s: float = 10.0, progress: bool | None = None,
                 record: tuple[str, ...] = ()):
        self.spec, self.plan = spec, plan
        self.record = set(record)   # "node.port" kept in the run's outputs even when consumed
        self.cancel_timeout_s = cancel_timeout_s
        self.progress = progress
        self.cv = threading.Condition()
        self.workers: WorkerPools | None = None
        self.setup_calls: list[CallRecord] = []
        self._closed = False
        self._started = False
        self._runs = 0                    # runs started: process workers keep resident values for one

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Executor":
        self.setup()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def setup(self) -> None:
        """Start workers, build every stage on its worker and run `setup` (weights load here)."""
        if self._started:
            return
        self._started = True
        init_torch_runtime()
        self.workers = WorkerPools(self.plan)
        for w in self.workers:
            w.start()
        pending = []
        for n in self.plan.nodes:
            node = self.spec.nodes[n.name]
            worker = self.workers.home(n.name)
            cfg = dict(node.stage_cfg)
            if not isinstance(worker, ProcessWorker):
                try:
                    worker.stages[n.name] = build_stage(cfg)
                except Exception as e:
                    self.close()
                    raise StageFailed(n.name, "setup", 0, node.stage_cls.__name__, e) from e
                for other in self.workers.pools[n.resource]:  # any worker of a thread pool may run it
                    other.stages[n.name] = worker.stages[n.name]
            pending.append((worker, self._job(n.name, "setup", None, cfg)))
        self._run_jobs_and_wait(pending, self.setup_calls)

    def close(self) -> None:
        """Close every stage, stop every worker (terminating processes that do not stop)."""
        if self._closed or not self._started or self.workers is None:
            return
        self._closed = True
        jobs = []
        for n in self.plan.nodes:
            worker = self.workers.home(n.name)
            if not worker.busy and worker.alive or isinstance(worker, InlineWorker):
                jobs.append((worker, self._job(n.name, "close", None)))
        try:
            self._run_jobs_and_wait(jobs, [], raise_first=False)
        finally:
            stuck = [w.name for w in self.workers if not w.stop(self.cancel_timeout_s if not w.busy else 1.0)]
            if stuck:
                log.error("workers %s did not stop; their threads are abandoned", ", ".join(stuck))

    def _start_run_stages(self, request: Any) -> None:
        """Every stage that keeps per-run state starts the run clean: its `start_run`, on its own
        worker, before any call of the run (so after a cancelled run too)."""
        jobs = [(self.workers.home(n.name), self._job(n.name, "start_run", request))
                for n in self.plan.nodes if _overrides_start_run(self.spec.nodes[n.name].stage_cls)]
        if jobs:
            self._run_jobs_and_wait(jobs, [])

    def _job(self, node: str, phase: str, request: Any, cfg: dict | None = None) -> Job:
        return Job(node, phase, 0, {}, request, on_done=lambda *a: None,
                   emit=lambda p, x: None, end=lambda p: None, stage_cfg=cfg)

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
                    rec = CallRecord(len(records), job.node, job.phase, 0, w.name, self.plan.node(job.node).resource)
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
                    self.workers.named(rec.resource, rec.worker).busy = False
                    if error is not None:
                        errors.append(StageFailed(job.node, job.phase, 0, self.spec.nodes[job.node].stage_cls.__name__, error))
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


    # ---------------------------------------------------------------- one run

    def run(self, request: Any = None) -> RunResult:
        if not self._started:
            self.setup()
        if self._closed:
            raise RuntimeError("executor is closed")
        self._runs += 1
        for worker in self.workers:
            worker.waiting = False
            if isinstance(worker, ProcessWorker):
                worker.run = self._runs       # resident values of earlier runs are dropped there
        self._start_run_stages(request)
        bar = tqdm(desc=f"run {getattr(request, 'id', '')}".strip(), unit="call", leave=False,
                   disable=None if self.progress is None else not self.progress)
        run = RequestRun(self.spec, self.plan, self.workers, self.cv, request, self.record,
                         on_call_done=lambda: bar.update(1))
        cpu_start = cpu_seconds()
        try:
            run.drive()
        except BaseException as e:
            self._cancel(run, e)
            raise
        finally:
            bar.close()
        t_end = time.perf_counter()
        cpu_end = cpu_seconds()
        cpu = round(cpu_end - cpu_start, 6) if cpu_start is not None and cpu_end is not None else None
        return RunResult(request, run.outputs, run.records, run.t_start, t_end, run.port_times, cpu)

    def _cancel(self, run: RequestRun, reason: BaseException) -> None:
        """Stop the run: wake blocked emits, wait a little for running calls, then close all."""
        with self.cv:
            run.fail_with(reason)
            deadline = time.perf_counter() + self.cancel_timeout_s
            while run.running and time.perf_counter() < deadline:
                for w in self.workers:  # processes can be stopped at once
                    if isinstance(w, ProcessWorker) and w.busy and w.process.is_alive():
                        w.process.terminate()
                self.cv.wait(0.05)
        self.close()
