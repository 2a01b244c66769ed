"""The small object a stage gets on every call: emit to a port now, end a stream, check for
cancellation, time a part of the call, count what the call did. In a worker process the same
object forwards emit and end over the worker's pipe, and the timed parts and counts go back with
the call's result."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class Cancelled(Exception):
    """The run was cancelled (another node failed, or Ctrl-C); raised inside emit/check."""


@dataclass
class TimedPart:
    """A named part of a call, timed by the engine: `seconds` once its block has ended."""

    name: str
    t0: float = 0.0
    t1: float = 0.0

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


class StageContext:
    def __init__(self, node: str, item: int, device: Any, request: Any,
                 emit: Callable[[str, Any], None], end: Callable[[str], None], cancelled: Callable[[], bool],
                 sync: Callable[[], None] | None = None):
        self.node = node
        self.item = item
        self.device = device
        self.request = request
        self._emit, self._end, self._cancelled = emit, end, cancelled
        self._sync = sync or (lambda: None)
        self.parts: list[TimedPart] = []       # what timer() measured in this call, in order
        self.counts: dict[str, float] = {}     # what count() added up in this call

    def emit(self, port: str, item: Any) -> None:
        """Publish `item` on `port` now (a streamed item or a tap); blocks while the consumer's
        channel is full (backpressure)."""
        self._emit(port, item)

    def end(self, port: str) -> None:
        """No more items on this streamed port in this run (ends a feedback loop)."""
        self._end(port)

    def check(self) -> None:
        """Raise Cancelled if the run was cancelled; long calls that never emit should call it."""
        if self._cancelled():
            raise Cancelled(f"run cancelled while {self.node} was working")

    @contextlib.contextmanager
    def timer(self, name: str) -> Iterator[TimedPart]:
        """Times the block as part `name` of this call: the executor records it in the trace and
        in metrics.json (stages.<node>.timers). The clock reads after the stage's device has
        finished the work queued before and inside the block, so a GPU stage's part is its
        kernels' time, not their launch. The stage may read `part.seconds` after the block
        (a draft choosing its window from measured times), but never times itself.

            with ctx.timer("verify") as part:
                logits = model.score(...)
        """
        part = TimedPart(name)
        self._sync()
        part.t0 = time.perf_counter()
        try:
            yield part
        finally:
            self._sync()
            part.t1 = time.perf_counter()
            self.parts.append(part)

    def count(self, name: str, amount: float) -> None:
        """Adds `amount` to this call's count `name` (the arithmetic it did, bytes it moved); the
        executor sums each name over the node's calls into metrics.json (stages.<node>.counts),
        where a report sets it against the node's time (FLOPs over busy seconds: a rate)."""
        self.counts[name] = self.counts.get(name, 0) + amount

    def __repr__(self) -> str:
        return f"StageContext(node={self.node!r}, item={self.item}, device={self.device})"
