"""Several decoders on one video, interleaved, for `bench_decode_grid`.

Each repeat runs every decoder once on the request's video, in an order shuffled per repeat (a
fixed rotation would put each decoder after the same neighbour every time, and a decoder whose
threads wind down after it returns slows the next one), with a pause between runs, and times it as
timer `<name>` of this node: metrics.json then holds each decoder's total, count and shortest run
(`stages.race.timers.<name>.min`). The decoders are the decode stages themselves, built from their
presets, and they run as they do in a graph (setup once, then called with the request); only the
frames they emit are collected here instead of being sent on.

Every decoder must return the same frames at the same times: a decoder that returns other times
or another count fails the run (a benchmark of decoders that disagree measures nothing).
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

import torch

from graph.stage import In, Out, Stage
from stages.types import FrameGroup, Request, VideoInfo

__all__ = ["DecoderRace"]


class _Collect:
    """What a decode stage sees of its context when the race calls it: emitted groups are kept."""

    def __init__(self):
        self.groups: list[FrameGroup] = []

    def emit(self, port: str, item: Any) -> None:
        if port == "group":
            self.groups.append(item)

    def check(self) -> None:
        pass


class DecoderRace(Stage):
    """decoders: {name: a decode stage (built from its preset)}; repeats: runs of each, interleaved.
    The first decoder's VideoInfo (with the plan it chose, for QuickCodec) is this node's output."""

    placement = "cpu"
    inputs = {"request": In(Request)}
    outputs = {"video": Out(VideoInfo)}

    def __init__(self, decoders: dict[str, Any], repeats: int = 3, pause_s: float = 0.5, seed: int = 0):
        if not decoders:
            raise ValueError("decoders: give at least one decode stage to time")
        if repeats < 1:
            raise ValueError(f"repeats must be ≥ 1, got {repeats}")
        self.decoders, self.repeats, self.pause_s, self.seed = dict(decoders), repeats, pause_s, seed

    @classmethod
    def declared_processes(cls, kwargs: dict) -> int:
        # the decoders run one at a time: the busiest one's processes
        return max((int(d.get("workers", 0)) for d in kwargs.get("decoders", {}).values()
                    if isinstance(d, dict) and str(d.get("_target_", "")).endswith("QuickCodec")), default=0)

    def setup(self, ctx) -> None:
        for decoder in self.decoders.values():
            decoder.setup(ctx)

    def __call__(self, ctx, request: Request):
        names = list(self.decoders)
        order = random.Random(self.seed)
        first: tuple[torch.Tensor, VideoInfo] | None = None
        info: VideoInfo | None = None
        for r in range(self.repeats):
            for name in order.sample(names, len(names)):
                gc.collect()
                time.sleep(self.pause_s)        # let the previous decoder's threads and processes settle
                sink = _Collect()
                with ctx.timer(name):
                    out = self.decoders[name](sink, request)
                seconds = torch.cat([g.seconds for g in sink.groups])
                if first is None:
                    first = (name, seconds)
                elif not torch.equal(seconds, first[1]):
                    raise RuntimeError(f"decoder {name!r} returned {len(seconds)} frames at other times than "
                                       f"{first[0]!r} ({len(first[1])} frames): the race compares nothing")
                if name == names[0]:
                    info = out["video"]
                ctx.check()
        return {"video": info}

    def close(self) -> None:
        for decoder in self.decoders.values():
            close = getattr(decoder, "close", None)
            if close:
                close()
