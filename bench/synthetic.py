"""Synthetic stages with real, measurable busy work (matrix products on the stage's device).

They stand in for decode / prefill / prune / draft / verify in the `demo` graph and the engine
benchmarks, so the engine's streaming, taps, feedback loop and overlap can be seen without a
model. The work releases the GIL (torch kernels), so two of them on two resources really run at
once. `fail_at` makes a stage raise on a chosen item, for failure-handling tests and demos.
"""

from __future__ import annotations

import random
import time

import torch

from graph.stage import In, Out, Stage
from stages.types import Payload, Proposal, Tokens, Verdict


def busy_work(mat: torch.Tensor, iters: int) -> torch.Tensor:
    """`iters` chained products of a [size, size] matrix: ~2·size³·iters flops."""
    x = mat
    for _ in range(iters):
        x = torch.tanh(x @ mat)
    return x


class _Busy(Stage):
    """Holds the work matrix; `iters` products of `size`² per unit of work, on the stage's device
    (placement gpu: it may sit on a CUDA stream, and runs on CPU anywhere else)."""

    placement = "gpu"

    def __init__(self, size: int = 192, iters: int = 8, fail_at: int | None = None, seed: int = 0):
        if size < 1 or iters < 0:
            raise ValueError(f"size must be ≥ 1 and iters ≥ 0, got size={size}, iters={iters}")
        self.size, self.iters, self.fail_at, self.seed = size, iters, fail_at, seed
        self.mat: torch.Tensor | None = None

    def setup(self, ctx) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.mat = (torch.randn(self.size, self.size, generator=g) / self.size**0.5).to(ctx.device)

    def work(self, units: float = 1.0) -> torch.Tensor:
        return busy_work(self.mat, max(0, round(self.iters * units)))

    def maybe_fail(self, item: int) -> None:
        if self.fail_at is not None and item == self.fail_at:
            raise RuntimeError(f"{type(self).__name__} told to fail at item {item} (fail_at={self.fail_at})")

    def close(self) -> None:
        self.mat = None


class Producer(_Busy):
    """A source streaming `items` payloads, each after one unit of work (decode's stand-in)."""

    outputs = {"item": Out(Payload, stream=True)}

    def __init__(self, items: int = 32, size: int = 192, iters: int = 8, fail_at: int | None = None, seed: int = 0):
        super().__init__(size, iters, fail_at, seed)
        if items < 1:
            raise ValueError(f"items must be ≥ 1, got {items}")
        self.items = items

    def __call__(self, ctx):
        for i in range(self.items):
            self.maybe_fail(i)
            ctx.emit("item", Payload(i, self.work()[:1, :4].cpu()))


class Consumer(_Busy):
    """One unit of work per streamed payload; a summary when the stream ends (prefill's stand-in)."""

    inputs = {"item": In(Payload, stream=True)}
    outputs = {"summary": Out(Payload)}

    def __init__(self, size: int = 192, iters: int = 8, fail_at: int | None = None, seed: int = 1):
        super().__init__(size, iters, fail_at, seed)
        self.seen = 0

    def __call__(self, ctx, item: Payload):
        self.maybe_fail(ctx.item)
        self.work()
        self.seen += 1

    def finish(self, ctx):
        seen, self.seen = self.seen, 0
        return {"summary": Payload(seen, torch.tensor([seen]))}


class LayeredForward(_Busy):
    """`layers` units of work; publishes a tap after layer `tap_layer`, then goes on (a target
    forward publishing its early hidden states)."""

    inputs = {"state": In(Payload)}
    outputs = {"hidden": Out(Payload, tap=True), "first": Out(Payload)}

    def __init__(self, layers: int = 8, tap_layer: int = 2, size: int = 192, iters: int = 8, seed: int = 2):
        super().__init__(size, iters, None, seed)
        if not 0 < tap_layer <= layers:
            raise ValueError(f"tap_layer must be in 1..layers={layers}, got {tap_layer}")
        self.layers, self.tap_layer = layers, tap_layer

    def __call__(self, ctx, state: Payload):
        x = None
        for layer in range(1, self.layers + 1):
            x = self.work()
            if layer == self.tap_layer:
                ctx.emit("hidden", Payload(layer, x[:1, :4].cpu()))
        return {"first": Payload(state.index, x[:1, :4].cpu())}


class TapReader(_Busy):
    """Consumes a tap while its producer is still running (pruning's stand-in)."""

    inputs = {"hidden": In(Payload)}
    outputs = {"selection": Out(Payload)}

    def __call__(self, ctx, hidden: Payload):
        self.work()
        return {"selection": Payload(hidden.index, hidden.data)}


class Proposer(_Busy):
    """Drafts `window` tokens per round, one unit of work each; restarts after a rejection.

    With the feedback edge primed once it alternates with the Checker (draft, then verify);
    primed twice it drafts the next round while the previous one is being checked."""

    inputs = {"selection": In(Payload), "first": In(Payload), "verdict": In(Verdict, stream=True)}
    outputs = {"proposal": Out(Proposal, stream=True)}

    def __init__(self, window: int = 4, size: int = 192, iters: int = 2, seed: int = 3):
        super().__init__(size, iters, None, seed)
        if window < 1:
            raise ValueError(f"window must be ≥ 1, got {window}")
        self.window = window
        self.length = 0   # where the next proposal starts (committed + in flight)
        self.round = 0

    def __call__(self, ctx, selection: Payload, first: Payload, verdict: Verdict | None):
        if verdict is not None and not verdict.stale and verdict.accepted < self.window:
            self.length = verdict.length  # rejected: everything in flight is void
        base = self.length
        for _ in range(self.window):
            self.work()
        self.length += self.window
        self.round += 1
        tokens = torch.arange(base, base + self.window)
        ctx.emit("proposal", Proposal(self.round, base, tokens))

    def finish(self, ctx):
        self.length, self.round = 0, 0


class Checker(_Busy):
    """Verifies a proposal with one unit of work, accepting each token with probability `accept`
    (seeded); ends the loop after `rounds` verifications. wait_s: each verification also waits
    this long without using a core (a GPU's verify, seen from the CPU)."""

    inputs = {"proposal": In(Proposal, stream=True)}
    outputs = {"verdict": Out(Verdict, stream=True), "tokens": Out(Tokens)}

    def __init__(self, rounds: int = 50, accept: float = 0.8, size: int = 192, iters: int = 8,
                 fail_at: int | None = None, seed: int = 4, wait_s: float = 0.0):
        super().__init__(size, iters, fail_at, seed)
        if rounds < 1 or not 0.0 <= accept <= 1.0 or wait_s < 0:
            raise ValueError(f"rounds must be ≥ 1, accept in [0, 1] and wait_s ≥ 0, got rounds={rounds}, "
                             f"accept={accept}, wait_s={wait_s}")
        self.rounds, self.accept, self.wait_s = rounds, accept, wait_s
        self._reset()

    def _reset(self):
        self.rng = random.Random(self.seed)
        self.committed, self.verified, self.ids, self.stale = 0, 0, [], 0

    def __call__(self, ctx, proposal: Proposal):
        if self.verified >= self.rounds:
            return  # a proposal drafted ahead of the last verdict: nothing left to check
        if proposal.base != self.committed:
            self.stale += 1
            ctx.emit("verdict", Verdict(proposal.round, 0, -1, self.committed, stale=True))
            return
        self.maybe_fail(self.verified)
        self.work()
        if self.wait_s:
            time.sleep(self.wait_s)
        accepted = 0
        while accepted < len(proposal.tokens) and self.rng.random() < self.accept:
            accepted += 1
        self.ids += proposal.tokens[:accepted].tolist()
        self.committed += accepted
        correction = -1
        if accepted < len(proposal.tokens):  # the target's own token replaces the first rejected one
            correction = self.committed
            self.ids.append(correction)
            self.committed += 1
        self.verified += 1
        if self.verified >= self.rounds:
            ctx.end("verdict")  # the loop is over; tokens go out in finish()
            return
        ctx.emit("verdict", Verdict(proposal.round, accepted, correction, self.committed))

    def finish(self, ctx):
        out = Tokens(list(self.ids), meta={"rounds": self.verified, "stale": self.stale})
        self._reset()
        return {"tokens": out}


class Counter(Stage):
    """Streams the integers 0..items-1 with no work: the executor-overhead benchmark's source."""

    outputs = {"item": Out(int, stream=True)}

    def __init__(self, items: int = 1000):
        self.items = items

    def __call__(self, ctx):
        for i in range(self.items):
            ctx.emit("item", i)


class Identity(Stage):
    """Passes each item on unchanged: one stage call with no work."""

    inputs = {"item": In(object, stream=True)}
    outputs = {"item": Out(object, stream=True)}

    def __call__(self, ctx, item):
        return {"item": item}
