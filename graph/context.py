"""The small object a stage gets on every call: emit to a port now, end a stream, check for
cancellation. In-process stages talk to the executor directly; process-pool stages get a
ChildContext that forwards the same calls over their worker's pipe."""

from __future__ import annotations

from typing import Any, Callable


class Cancelled(Exception):
    """The run was cancelled (another node failed, or Ctrl-C); raised inside emit/check."""


class StageContext:
    def __init__(self, node: str, item: int, device: Any, request: Any,
                 emit: Callable[[str, Any], None], end: Callable[[str], None], cancelled: Callable[[], bool]):
        self.node = node
        self.item = item
        self.device = device
        self.request = request
        self._emit, self._end, self._cancelled = emit, end, cancelled

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

    def __repr__(self) -> str:
        return f"StageContext(node={self.node!r}, item={self.item}, device={self.device})"
