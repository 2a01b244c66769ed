"""Shared test helpers: build a validated graph + plan from a dict, and a few probe stages."""

from __future__ import annotations

import os
import threading
import time

import torch

from graph.resources import load_resources
from graph.schedule import compile_plan
from graph.spec import build_graph
from graph.stage import In, Out, Stage
from stages.types import Payload

CPU = {
    "cores": 2,
    "pools": {
        "cpu": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
        "decode": {"kind": "process", "workers": 2, "torch_threads": 1},
        "target": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
        "draft": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
    },
}


def make(nodes: dict, resources: dict | None = None, runner: str = "threaded", capacity: int = 2, n_cuda: int = 0):
    res, cores, strict = load_resources(resources or CPU, n_cuda=n_cuda)
    spec = build_graph({"nodes": nodes}, res)
    return spec, compile_plan(spec, res, cores, strict=strict, runner=runner, capacity=capacity)


def node(target: str, on: str = "cpu", inputs: dict | None = None, **kwargs) -> dict:
    return {"stage": {"_target_": target, **kwargs}, "on": on, "inputs": inputs or {}}


def target_side(model: dict, *, max_new_tokens: int, group_frames: int = 8, **prefill) -> dict:
    """The target's side every model graph starts from (as conf/graph/target.yaml): a source, QuickCodec
    (one decoder process), the vision encoder and the prefill (`prefill`: its further keys)."""
    return {
        "source": node("stages.source.Source"),
        "decode": node("stages.decode.QuickCodec", inputs={"request": "source.request"}, fps=model["fps"],
                       size=model["size"], group_frames=group_frames, workers=1),
        "encode": node("stages.encode.VisionEncoder", on="target", inputs={"group": "decode.group"},
                       model=model, fps=model["fps"]),
        "prefill": node("stages.prefill.Prefill", on="target", inputs={"tokens": "encode.tokens", "request": "source.request"},
                        model=model, max_new_tokens=max_new_tokens, **prefill),
    }


class SlowSink(Stage):
    """Sleeps `delay` per item (releases the GIL), counting items."""

    inputs = {"item": In(object, stream=True)}
    outputs = {"count": Out(int)}

    def __init__(self, delay: float = 0.01, fail_at: int | None = None):
        self.delay, self.n, self.fail_at = delay, 0, fail_at

    def __call__(self, ctx, item):
        if ctx.item == self.fail_at:
            raise RuntimeError(f"SlowSink told to fail at item {ctx.item}")
        time.sleep(self.delay)
        self.n += 1

    def finish(self, ctx):
        n, self.n = self.n, 0
        return {"count": n}


class Collect(Stage):
    """Keeps every item it is given, None (a primed item) included."""

    inputs = {"item": In(object, stream=True)}
    outputs = {"items": Out(list)}

    def __init__(self):
        self.items = []

    def __call__(self, ctx, item):
        self.items.append(item)

    def finish(self, ctx):
        items, self.items = self.items, []
        return {"items": items}


class Pair(Stage):
    """Pairs the items of two streams, one call per pair."""

    inputs = {"a": In(object, stream=True), "b": In(object, stream=True)}
    outputs = {"pairs": Out(list)}

    def __init__(self):
        self.pairs = []

    def __call__(self, ctx, a, b):
        self.pairs.append((a, b))

    def finish(self, ctx):
        pairs, self.pairs = self.pairs, []
        return {"pairs": pairs}


class ThreadProbe(Stage):
    """Reports the torch thread count, process id and cores it runs with."""

    outputs = {"info": Out(dict)}

    def __call__(self, ctx):
        return {"info": {"torch_threads": torch.get_num_threads(), "pid": os.getpid(), "device": str(ctx.device),
                         "cores": sorted(os.sched_getaffinity(0))}}


class Silent(Stage):
    """Declares an output and never emits it."""

    outputs = {"value": Out(Payload)}

    def __call__(self, ctx):
        return None


class NeedsPayload(Stage):
    inputs = {"value": In(Payload)}

    def __call__(self, ctx, value):
        return None


class Rogue(Stage):
    """Emits to a port it does not declare."""

    outputs = {"value": Out(Payload)}

    def __call__(self, ctx):
        ctx.emit("other", 1)


class Crash(Stage):
    """Kills its own process at item `at` (for process-pool tests)."""

    inputs = {"item": In(object, stream=True)}

    def __init__(self, at: int = 2):
        self.at = at

    def __call__(self, ctx, item):
        if ctx.item == self.at:
            os._exit(3)


class Forever(Stage):
    """Streams items forever until cancelled (for Ctrl-C and cancellation tests)."""

    outputs = {"item": Out(int, stream=True)}

    def __call__(self, ctx):
        i = 0
        while True:
            time.sleep(0.005)
            ctx.emit("item", i)
            i += 1


class PacedSource(Stage):
    """Streams `items` items, then stays busy `tail_s` more seconds (a decoder still working)."""

    outputs = {"item": Out(int, stream=True)}

    def __init__(self, items: int = 3, tail_s: float = 0.3):
        self.items, self.tail_s = items, tail_s

    def __call__(self, ctx):
        for i in range(self.items):
            ctx.emit("item", i)
        time.sleep(self.tail_s)


class ThreadsPerItem(Stage):
    """Records torch's thread count at each streamed item; waits `delay` per item."""

    inputs = {"item": In(object, stream=True)}
    outputs = {"threads": Out(list)}

    def __init__(self, delay: float = 0.05):
        self.delay, self.seen = delay, []

    def __call__(self, ctx, item):
        self.seen.append(torch.get_num_threads())
        time.sleep(self.delay)

    def finish(self, ctx):
        seen, self.seen = self.seen + [torch.get_num_threads()], []    # the last entry: finish's own
        return {"threads": seen}


class RunCounter(Stage):
    """Counts the items of a run in per-run state that only `start_run` resets; fails on item
    `fail_at` of the run numbered `fail_run` (0-based), times each item's work as a part and
    counts it (its item number plus one as "weight", one a call as "items")."""

    inputs = {"item": In(object, stream=True)}
    outputs = {"count": Out(dict)}

    def __init__(self, fail_at: int = -1, fail_run: int = -1, work_s: float = 0.002, fail_start: bool = False):
        self.fail_at, self.fail_run, self.work_s, self.fail_start = fail_at, fail_run, work_s, fail_start
        self.runs, self.n, self.started_on = -1, 0, None

    def start_run(self, ctx):
        if self.fail_start:
            raise RuntimeError("RunCounter told to fail in start_run")
        self.runs += 1
        self.n = 0
        self.started_on = (os.getpid(), threading.get_ident())

    def __call__(self, ctx, item):
        if self.runs == self.fail_run and self.n == self.fail_at:
            raise RuntimeError("RunCounter told to fail")
        with ctx.timer("work"):
            time.sleep(self.work_s)
        ctx.count("items", 1)
        ctx.count("weight", self.n + 1)
        self.n += 1
        assert self.started_on == (os.getpid(), threading.get_ident()), "start_run ran on another worker"

    def finish(self, ctx):
        return {"count": {"items": self.n, "runs": self.runs + 1}}


class Ledger(Stage):
    """Makes a mutable record (a list with this process's id) once per run, kept resident when
    run in a process pool."""

    outputs = {"ledger": Out(list, resident=True)}

    def __call__(self, ctx):
        return {"ledger": [os.getpid()]}


class Scribe(Stage):
    """Appends each streamed item to the resident ledger (in place) and reports the ledger, its
    process and the object's identity at the end: all calls must have written the same object."""

    inputs = {"ledger": In(list), "item": In(object, stream=True)}
    outputs = {"summary": Out(dict)}

    def __init__(self):
        self.seen: list = []

    def __call__(self, ctx, ledger, item):
        ledger.append(int(item.index) if hasattr(item, "index") else item)
        self.seen.append(id(ledger))
        self.ledger = ledger

    def finish(self, ctx):
        seen, self.seen = self.seen, []
        return {"summary": {"ledger": list(self.ledger), "pid": os.getpid(), "objects": len(set(seen))}}
