"""What every compiled function of reelflow shares: the thread counts it is compiled for, and the
record of what was compiled and how long it took.

torch.compile guards on `torch.get_num_threads()`: a call at a thread count the function has not
seen compiles it again, for seconds, in the middle of a request. An elastic pool (graph.pools)
moves a worker's thread count between its own share and every core, so a compiled function is
warmed at both (thread_counts) and called at the largest warmed count not above the current one
(call_at_warmed_threads). What was compiled, and its seconds, go to the run's plan.txt and
metrics.json (compile_records).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
import time
import types

import torch

log = logging.getLogger("reelflow.models")
_RECORDS: list[dict] = []          # what this process compiled: {what, mode, seconds, at}
_RECORDS_LOCK = threading.Lock()


def record_compile(what: str, mode: str, seconds: float, done: str = "compiled") -> None:
    """Note a compile (its warm-up calls), or other work a model does for its steps at load (done:
    what the log says of it), for the run's metrics and plan.txt (compile_records)."""
    with _RECORDS_LOCK:
        _RECORDS.append({"what": what, "mode": mode, "seconds": round(seconds, 3), "at": time.time()})
    log.info("%s %s (%s) in %.1f s", done, what, mode, seconds)


def compile_records(since: float = 0.0) -> list[dict]:
    """The compiles this process made since the time.time() `since`: {what, mode, seconds}. A model
    in a pool of its own process (`kind: process`) or on a Ray worker compiles there, not here."""
    with _RECORDS_LOCK:
        return [{k: r[k] for k in ("what", "mode", "seconds")} for r in _RECORDS if r["at"] >= since]


def private_copy(fn):
    """fn with a code object of its own. torch.compile keeps its compiled graphs, and counts them
    against its recompile limit (8), per code object: every model whose step compiles the same
    function shares one list. A target and its draft in one process, each at a one-token and a
    several-token shape and at two thread counts, fill it, and the next shape (a model of a third
    shape, another thread count) silently runs the step eagerly. A copy per model gives each its
    own list and its own limit."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = fn.__kwdefaults__, fn.__qualname__, fn.__doc__
    copy.__module__ = fn.__module__      # no __wrapped__: what unwraps it would find the shared code again
    return copy


def compiled(fn, mode: str):
    """fn compiled (a private copy) by torch.compile in `mode` ("default" or another of
    torch.compile's modes), with only the dimensions its caller marks `varying` symbolic.

    Why not dynamic=True: it makes every dimension of every argument symbolic, and every int
    attribute of an argument object too (a model's head count, head size, hidden size). Inductor's
    kernels then index with divisions by symbols and run scalar: on the toy target, gathering the
    attention's output of an 11-token step took 82 µs a layer against 11.5 with constant sizes.
    With the model's sizes as constants the kernels vectorise; the cache length and the token count
    stay symbolic, so one compile still serves every length (and, as before, a dimension of size 1
    is its own compile)."""
    return torch.compile(private_copy(fn), dynamic=None, mode=None if mode == "default" else mode)


_WARMING: contextvars.ContextVar[bool] = contextvars.ContextVar("reelflow_warming", default=False)


@contextlib.contextmanager
def warming():
    """Inside the block, `varying` marks tensors: the calls that compile on purpose (warm-up;
    warm_at_thread_counts opens it)."""
    token = _WARMING.set(True)
    try:
        yield
    finally:
        _WARMING.reset(token)


def varying(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    """Mark `tensor`'s `dims` as changing from call to call, for a call of a `compiled` function
    that compiles (a dimension of size 1 stays specialised). Only while `warming`: a mark matters
    when a call compiles, and the graphs compiled then serve every later size unmarked, while a mark
    costs about 10 µs a tensor (an attribute set on it), 0.15 ms on every toy step otherwise.
    Returns the tensor."""
    if _WARMING.get():
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
    return tensor


# torch's thread settings, one thread at a time (the engine's workers take their own lock for theirs)
_THREADS_LOCK = threading.Lock()


def set_threads(n: int) -> None:
    with _THREADS_LOCK:
        torch.set_num_threads(n)


def thread_counts(device) -> tuple[int, ...]:
    """The torch thread counts a compiled function is warmed for: the one set now and, on the CPU,
    every core of the process: the two counts an elastic pool gives a worker when the other
    workers are busy and when they are idle (in between, with three or more workers, the call
    runs at the lower one)."""
    now = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return (now,)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return tuple(sorted({now, cores}))


def warm_at_thread_counts(counts: tuple[int, ...], warm_once, what: str, mode: str) -> float:
    """Call warm_once() at each of `counts` torch threads (compiling what it calls for each count),
    put the thread count back, and record the compile as `what` (plan.txt, metrics.json). Returns
    the seconds it took."""
    t0, now = time.perf_counter(), torch.get_num_threads()
    try:
        for threads in counts:
            set_threads(threads)
            with warming():
                warm_once()
    finally:
        set_threads(now)
    seconds = time.perf_counter() - t0
    record_compile(f"{what}, {'/'.join(map(str, counts))} threads", mode, seconds)
    return seconds


def call_at_warmed_threads(fn, counts: tuple[int, ...], *args, **kwargs):
    """fn(*args, **kwargs) at the largest warmed thread count not above the current one (the
    smallest when all are above), so that a compiled function is never compiled again mid-run."""
    now = torch.get_num_threads()
    use = max((c for c in counts if c <= now), default=counts[0])
    if use == now:
        return fn(*args, **kwargs)
    set_threads(use)
    try:
        return fn(*args, **kwargs)
    finally:
        set_threads(now)
