"""The child side of a process worker: the loop a spawned worker process runs, holding its stages
and its resident values, and the pickled messages it exchanges with the parent-side thread
(graph.workers.ProcessWorker).

Parent -> child: ("job", phase, node, item, kwargs, request, stage_cfg, run) | ("exit",).
Child -> parent: ("emit", port, item) and ("end", port), each answered ("ok",) or ("cancel",);
then ("done", result, timed parts, counts) or ("error", type name, message, traceback text).
"""

from __future__ import annotations

import signal
import traceback
from dataclasses import dataclass
from typing import Any

from graph import wire
from graph.context import Cancelled, StageContext
from graph.jobs import Job, build_stage, run_phase
from graph.resources import pin_to
from graph.spawn import die_with_parent


@dataclass(frozen=True)
class Resident:
    """A handle to a value that stayed in the worker process that made it (Out(resident=True)):
    jobs on that worker get the value itself; the value never crosses a process boundary, and
    the process drops it when the next run starts."""

    worker: str
    run: int
    key: int


class ResidentTable:
    """A process worker's resident values of the current run (child side)."""

    def __init__(self, worker: str):
        self.worker, self.run, self._values, self._next = worker, -1, {}, 0

    def start(self, run: int) -> None:
        if run != self.run:
            self.run, self._values = run, {}

    def keep(self, value: Any) -> Resident:
        self._next += 1
        self._values[self._next] = value
        return Resident(self.worker, self.run, self._next)

    def resolve(self, value: Any) -> Any:
        if not isinstance(value, Resident):
            return value
        if value.worker != self.worker or value.run != self.run or value.key not in self._values:
            where = f"worker {value.worker}, run {value.run}"
            raise RuntimeError(f"a resident value made in {where} reached worker {self.worker}, run {self.run}: "
                               "resident outputs are only for consumers on the worker that made them")
        return self._values[value.key]


def resident_ports_of(stage: Any) -> set[str]:
    outputs = getattr(type(stage), "outputs", {}) or {}
    return {port for port, out in outputs.items() if getattr(out, "resident", False)}


def send(conn, msg) -> None:
    conn.send_bytes(wire.dumps(msg))      # by value: nothing goes through /dev/shm behind our back


def recv(conn):
    return wire.loads(conn.recv_bytes())


def child_main(conn, torch_threads: int, device: str, name: str = "", affinity: tuple[int, ...] | None = None) -> None:
    """A worker process's whole life: run the jobs the parent sends until it says exit or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C and shuts us down
    die_with_parent()
    pin_to(affinity)
    import torch

    torch.set_num_threads(torch_threads)
    on_cuda = device.startswith("cuda")
    if on_cuda:           # this process's own CUDA context: its kernels never wait for the parent's interpreter
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if on_cuda else None
    stages: dict[str, Any] = {}
    cancelled = False
    residents = ResidentTable(name)
    resident_ports: set[str] = set()       # of the stage whose job runs now

    def emit(port, item):
        nonlocal cancelled
        if port in resident_ports:
            item = residents.keep(item)
        send(conn, ("emit", port, item))
        if recv(conn)[0] == "cancel":
            cancelled = True
            raise Cancelled("run cancelled")

    def end(port):
        send(conn, ("end", port))
        recv(conn)

    while True:
        try:
            msg = recv(conn)
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "exit":
            return
        _, phase, node, item, kwargs, request, stage_cfg, run = msg
        cancelled = False
        try:
            residents.start(run)
            if phase == "setup":
                stages[node] = None
                stages[node] = build_stage(stage_cfg)
            resident_ports = resident_ports_of(stages.get(node))
            kwargs = {k: residents.resolve(v) for k, v in kwargs.items()}
            job = Job(node, phase, item, kwargs, request, on_done=None)  # type: ignore[arg-type]
            ctx = StageContext(node, item, torch.device(device), request, emit, end, lambda: cancelled, sync=sync)
            result = run_phase(stages.get(node), job, ctx)
            if on_cuda:       # as a stream worker: the job's span is its kernels' time, its outputs complete
                torch.cuda.synchronize()
            if isinstance(result, dict) and resident_ports:
                result = {k: residents.keep(v) if k in resident_ports else v for k, v in result.items()}
            # perf_counter is CLOCK_MONOTONIC, one clock for every process: the parent can place these
            send(conn, ("done", result, [(p.name, p.t0, p.t1) for p in ctx.parts], ctx.counts))
        except BaseException as e:
            send(conn, ("error", type(e).__name__, str(e), traceback.format_exc()))
        if phase == "close":
            stages.pop(node, None)

