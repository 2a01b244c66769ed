"""A job: one phase of one node's stage (setup, start_run, call, finish, close), as the executor
hands it to a worker, and what running it means on either side of a process boundary: building a
stage from its config, calling the phase, carrying a child's exception back as text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from graph.context import StageContext


@dataclass
class Job:
    node: str
    phase: str                   # setup | start_run | call | finish | close
    item: int
    kwargs: dict
    request: Any
    on_done: Callable[["Job", Any, BaseException | None], None]
    emit: Callable[[str, Any], None] | None = None
    end: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] = lambda: False
    stage_cfg: dict | None = None  # setup of a process-pool stage: how to build it
    record: Any = None             # gets t0/t1: the worker times the job, not the dispatcher
    wait_for: list = field(default_factory=list)   # ReadyMarks of the inputs: awaited before the job runs


class RemoteError(Exception):
    """An exception raised inside a worker process, carried back as text."""

    def __init__(self, type_name: str, message: str, tb: str):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.tb = type_name, message, tb


def build_stage(cfg: dict) -> Any:
    """Instantiate a stage from its `_target_` block, raising the constructor's own error."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(cfg, _convert_="all")
    except InstantiationException as e:
        raise (e.__cause__ or e) from None


def run_phase(stage: Any, job: Job, ctx: StageContext) -> Any:
    if stage is None:  # never built (its construction failed): nothing to set up or close
        return None
    if job.phase == "setup":
        return stage.setup(ctx)
    if job.phase == "start_run":
        return stage.start_run(ctx)
    if job.phase == "call":
        return stage(ctx, **job.kwargs)
    if job.phase == "finish":
        return stage.finish(ctx)
    if job.phase == "close":
        return stage.close()
    raise ValueError(f"unknown phase {job.phase}")
