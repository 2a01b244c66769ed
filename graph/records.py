"""What a run leaves behind: a record per call (the trace, metrics and reports are made from them),
the run's result, and the failure that ends a run (StageFailed names the node, phase and item)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any

from graph.jobs import RemoteError


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
        if isinstance(self.error, RemoteError):
            return self.error.tb
        return "".join(traceback.format_exception(self.error))


class Deadlock(Exception):
    """No call can start and none ever will: the scheduler's own failure, named in a StageFailed."""


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
    counts: dict = field(default_factory=dict)  # name -> amount: what the stage counted with ctx.count

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

