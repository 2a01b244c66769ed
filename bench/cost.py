"""cost: what one model's forwards over a real prompt cache cost, for the benchmarks.

    StepCost    a decode step (k = 1), k-token verifications and a draft tree, each timed by the
                engine (ctx.timer) over `repeats` forwards that are rolled back, beside the bytes the
                step must read (weights and cached entries) and a copy of that many bytes, timed
                the same way: the memory-traffic floor of the step on this machine; and beside each
                forward's arithmetic and a large matrix product, timed the same way: the fewest
                milliseconds that arithmetic takes at the device's matrix rate (bench_step)
    ScoreCost   one k-token forward `repeats` times (bench_verify: the verifier's forward against
                the one-token step, by attention implementation)
"""

from __future__ import annotations

import contextlib
import functools

import torch

from graph.stage import In, Out, Stage
from models.matrix_rate import matmul_probe
from models.registry import get_model
from speculative.tree import bushy_tree, tree_depths, tree_mask
from stages.types import PrefillResult, Tokens


def parse_shape(shape) -> tuple[str, int]:
    """1, 8 or "k8" -> ("chain", k); "tree30" -> ("tree", 30)."""
    text = str(shape)
    if text.startswith("tree"):
        kind, count = "tree", text[4:]
    else:
        kind, count = "chain", text.removeprefix("k")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"shape {shape!r}: a token count (8 or 'k8') or a tree size ('tree30')")
    return kind, int(count)


def step_bytes(lm, cache) -> dict:
    """Bytes a forward of a few tokens must read: every decoder layer's weights, the final norm
    and the LM head (the input embedding is a row lookup: left out), and the cached entries."""
    return {"weight_bytes": lm.step_weight_bytes(), "cache_bytes": int(lm.cache_bytes(cache))}


class StepCost(Stage):
    """model: the entry whose forwards are timed (its cache is `kv`'s: prefill it with the same
    model); shapes: 1, "k8", "tree30" ...; repeats: forwards per shape (the engine records each as
    timer "k<k>" or "tree<n>", and the copy as "copy"), interleaved: each round runs every shape
    and the copy once."""

    placement = "gpu"
    inputs = {"kv": In(PrefillResult)}
    outputs = {"tokens": Out(Tokens)}

    def __init__(self, model: dict, shapes: list | tuple = (1, 2, 4, 8, 16, "tree30"), repeats: int = 30):
        if repeats < 1:
            raise ValueError(f"repeats must be ≥ 1, got {repeats}")
        self.shapes = [parse_shape(s) for s in shapes]
        self.model, self.repeats = dict(model), repeats
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)

    def __call__(self, ctx, kv: PrefillResult):
        lm, layout = self.lm, kv.layout
        token = int(kv.logits.argmax())
        start = kv.logical_length
        sizes = step_bytes(lm, kv.cache)
        total = sizes["weight_bytes"] + sizes["cache_bytes"]
        source = torch.ones(total // 4, device=lm.device)
        target = torch.empty_like(source)
        entries = lm.cached_length(kv.cache)
        forwards, flops = [], {}                       # (timer name, the forward, how many to roll back)
        for kind, n in self.shapes:
            ids = torch.full((n,), token)
            if kind == "chain":
                forwards.append((f"k{n}", functools.partial(lm.score, kv.cache, ids, start, layout), n))
            else:
                parents = bushy_tree(n)
                forwards.append((f"tree{n}", functools.partial(lm.score_tree, kv.cache, ids, tree_mask(parents),
                                                               tree_depths(parents), start, layout), n))
            flops[f"flops_{forwards[-1][0]}"] = lm.forward_flops(n, entries)
        matmul, matmul_flops = matmul_probe(lm.device, lm.dtype)
        forwards.append(("matmul", matmul, 0))
        # the copy last: the next round's first forward reads its weights from memory
        forwards.append(("copy", functools.partial(target.copy_, source), 0))
        # round by round, every shape once a round: the machine's speed drifts over seconds, and
        # shapes timed in blocks one after another would carry the drift into their ratios
        for r in range(self.repeats + 1):              # the first round is a warm-up, untimed
            for name, forward, n in forwards:
                with ctx.timer(name) if r else contextlib.nullcontext():
                    forward()
                if n:
                    lm.drop_last(kv.cache, n)
        meta = {**sizes, "step_bytes": total, "copy_bytes": 2 * source.numel() * 4,    # read + write
                **flops, "matmul_flops": matmul_flops,
                "cache_entries": lm.cached_length(kv.cache), "lean": lm.lean is not None, "model": lm.name}
        return {"tokens": Tokens([], None, meta)}


class ScoreCost(Stage):
    """What verification costs: scores `k` tokens over the prompt's cache `repeats` times (rolling
    back each time), so the executor's busy time of this node / repeats is one k-token forward.
    For bench_verify: the verifier's forward against the one-token step of autoregressive decoding."""

    placement = "gpu"
    inputs = {"kv": In(PrefillResult)}
    outputs = {"tokens": Out(Tokens)}

    def __init__(self, model: dict, k: int = 4, repeats: int = 20):
        if k < 1 or repeats < 1:
            raise ValueError(f"k and repeats must be ≥ 1, got k={k}, repeats={repeats}")
        self.model, self.k, self.repeats = dict(model), k, repeats
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)

    def __call__(self, ctx, kv: PrefillResult):
        ids = torch.full((self.k,), int(kv.logits.argmax()))
        for _ in range(self.repeats):
            self.lm.score(kv.cache, ids, kv.logical_length, kv.layout)
            self.lm.drop_last(kv.cache, self.k)
        return {"tokens": Tokens([], None, {"k": self.k, "repeats": self.repeats,
                                            "cache_entries": self.lm.cached_length(kv.cache),
                                            "lean": self.lm.lean is not None,
                                            "attn_implementation": self.lm.attn_implementation})}
