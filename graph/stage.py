"""The stage contract: what the engine needs to know about a stage, and nothing about models.

A stage is a class with typed ports declared as class data and a placement kind::

    class Prefill(Stage):
        placement = "gpu"
        inputs = {"group": In(VisualTokens, stream=True)}   # called once per group
        outputs = {"kv": Out(PrefillResult), "hidden": Out(Taps, tap=True)}

        def setup(self, ctx): ...                      # load weights, allocate
        def start_run(self, ctx): ...                  # reset what belongs to one run (request)
        def __call__(self, ctx, group): ...            # compute; return {"port": item} or emit
        def finish(self, ctx): ...                     # after the last streamed item of a run
        def close(self): ...                           # free

Lifecycle: ``__init__`` takes config scalars only (so Hydra can validate them against the
signature before anything loads); ``setup`` runs once on the stage's own worker; ``start_run``
runs on that worker at the start of every run, before its first call, whatever happened to the
run before (finished, failed or cancelled); ``__call__`` runs once per item of its streamed inputs
(or once per run if it has none); ``finish`` runs when a run's streamed inputs are exhausted;
``close`` runs once at the end.

Stages never start threads, time themselves or synchronise devices: the executor does that for
all of them. A stage that wants a part of its call timed says ``with ctx.timer("name") as part:``
and the executor measures it (synchronised for the stage's device) and records it. A stage whose
work is a pool of processes (QuickCodec's decoders) declares how many it starts
(``declared_processes``), so the schedule leaves them their cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


@dataclass(frozen=True)
class In:
    """An input port. ``stream=True``: the stage is called once per arriving item; otherwise the
    value arrives once per run and is passed to every call."""

    type: type
    stream: bool = False
    doc: str = ""


@dataclass(frozen=True)
class Out:
    """An output port. ``stream=True``: many items per run. ``tap=True``: a single item published
    in the middle of a call (``ctx.emit``) while the call goes on. ``resident=True``: when the
    stage runs in a process pool, the value stays in that process and its consumers, which must
    run on the same process worker, get the object itself (a model's cache that later calls
    extend in place); the parent only passes a handle (graph.process_child.Resident)."""

    type: type
    stream: bool = False
    tap: bool = False
    doc: str = ""
    resident: bool = False


class Context(Protocol):
    """What the executor hands a stage on every call (see graph/context.py)."""

    node: str
    device: Any          # torch.device the stage should compute on
    item: int            # index of this call within the run
    request: Any         # the run's input (stages.types.Request), same for every node

    def emit(self, port: str, item: Any) -> None: ...
    def end(self, port: str) -> None: ...
    def check(self) -> None: ...
    def timer(self, name: str) -> Any: ...      # a context manager yielding a TimedPart


class Stage:
    """Base class; subclasses set ``inputs``, ``outputs`` and ``placement``."""

    inputs: ClassVar[dict[str, In]] = {}
    outputs: ClassVar[dict[str, Out]] = {}
    placement: ClassVar[str] = "cpu"  # "cpu" or "gpu": where the stage can compute

    @classmethod
    def declared_processes(cls, kwargs: dict[str, Any]) -> int:
        """How many processes a stage built with these constructor arguments starts (each busy on
        a core of its own while the stage works); the schedule counts them when it splits cores."""
        return 0

    def setup(self, ctx: Context) -> None:
        pass

    def start_run(self, ctx: Context) -> None:
        """Reset what belongs to one run. Called on the stage's worker before every run."""

    def __call__(self, ctx: Context, **inputs: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def finish(self, ctx: Context) -> dict[str, Any] | None:
        return None

    def close(self) -> None:
        pass


def is_stage_class(obj: Any) -> bool:
    return isinstance(obj, type) and all(
        hasattr(obj, attr) for attr in ("inputs", "outputs", "placement", "__call__")
    )
