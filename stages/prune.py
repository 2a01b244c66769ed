"""prune: choosing which cached entries (or visual tokens) to keep.

Three kinds live here: QuickPrefill's per-group KV pruning (`GroupKVPrune`, applied by the group
prefill), ParallelVLM's UV-Prune of the draft's visual tokens (`UVPrune`, a stage fed by the
target's prefill taps) and SpecVLM's attention-guided choice of them (`AttentionPrune`). Each
takes `keep`, the share kept in (0, 1]; the scores and counts are models.pruning's pure functions.
QuickPrefill first:

QuickPrefill (QuickVideo §3.2, Eq. 2) prunes each group's KV cache right after the group is
prefilled, before the next group attends to it, keeping the top ⌈ρ·n⌉ of the group's n entries
(ρ = keep) by an importance score:

    key_norm     s = −‖K‖   small keys matter most (the paper's choice; Devoto et al. 2024)
    value_norm   s = +‖V‖
    attention    s = the text query's attention to the entry
    random       s ~ U(0, 1)   (the floor any score must beat)
    value_change s = ‖v_i − v_(i−P)‖  how much a token differs from the same place one temporal
                 step (P tokens) earlier: not one of the paper's; a temporal-redundancy score (as
                 DyCoke-style pruning of tokens that repeat the previous frame), added because the
                 paper's fail on the toy zoo, whose cells hold still for seconds between events.
                 Every `keyframe_every` temporal steps one step is kept whole (an I-frame among
                 P-frame residuals): with changes alone nothing still survives after the first
                 step, and the toy's captions then lose their background and end early

Choices the paper leaves open, and what we do:
- Heads. One kept set per layer, shared by all its heads (a cache row is one token in every
  head): norms are taken over the layer's keys (or values) of all KV heads together, the
  L2 norm of the token's [kv_heads · head_dim] vector, as the paper writes ‖K_g^(l)‖.
- Layers. Each layer scores and keeps its own set, so layers hold different entries and lengths
  (the adapter masks each layer for its own length). `start_layer` leaves the layers below it
  unpruned; `decay` shrinks the share layer by layer above it: ρ_l = ρ · decay^(l − start_layer).
- Rounding. k = ⌈ρ_l · n⌉ (at least one entry), so ρ = 1 keeps everything and a tiny group is
  never emptied.
- Attention. The question comes after the video, so when a group is pruned its text is not in
  the cache yet: the text after the video is run over the cache at the positions it would have
  if the video ended with this group, its attention probabilities (averaged over heads and
  query tokens) score the group's entries, and its own entries are dropped again. Probabilities
  rank the entries of one query row as its logits q·k do (softmax is monotone); averaging
  probabilities rather than logits keeps one row's outliers from dominating.
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.pruning import (
    UV_VARIANTS,
    attention_entry_scores,
    attention_guided_keep,
    keep_count,
    keep_top,
    key_norm_scores,
    layer_ratios,
    top_k_indices,
    uv_scores,
    value_change_scores,
    value_norm_scores,
)
from stages.types import Selection, Taps

IMPORTANCE = ("key_norm", "value_norm", "attention", "random", "value_change")


# ------------------------------------------------------------------------------ the policy

class GroupKVPrune:
    """QuickPrefill's per-group KV pruning, applied by the group prefill after each group.

    importance: key_norm | value_norm | attention | random | value_change; keep: the share each
    group keeps, in (0, 1] (the paper's ρ);
    start_layer, decay: see the module docstring; seed: for `random`; keyframe_every: for
    `value_change`, every this many temporal steps (counted over the whole video) one step is kept
    whole, 0: only the video's first."""

    def __init__(self, importance: str = "key_norm", keep: float = 0.5, start_layer: int = 0,
                 decay: float = 1.0, seed: int = 0, keyframe_every: int = 0):
        if importance not in IMPORTANCE:
            raise ValueError(f"prune.importance must be one of {', '.join(IMPORTANCE)}, got {importance!r}")
        keep_count(1, keep)       # validates keep
        if start_layer < 0:
            raise ValueError(f"prune.start_layer must be ≥ 0, got {start_layer}")
        if not 0 < decay <= 1:
            raise ValueError(f"prune.decay must be in (0, 1], got {decay}")
        if keyframe_every < 0:
            raise ValueError(f"prune.keyframe_every must be ≥ 0 (0: only the video's first step), got {keyframe_every}")
        self.importance, self.keep, self.start_layer, self.decay = importance, keep, start_layer, decay
        self.keyframe_every = keyframe_every
        self.generator = torch.Generator().manual_seed(seed)
        self.previous_step: dict[int, torch.Tensor] = {}     # value_change: each layer's last step, unpruned
        self.steps_done = 0                                  # value_change: temporal steps in earlier groups

    @property
    def needs_attention(self) -> bool:
        return self.importance == "attention"

    def ratios(self, n_layers: int) -> list[float]:
        return layer_ratios(n_layers, self.keep, self.start_layer, self.decay)

    def select(self, layer_kv, lengths: list[int], n_group: int,
               attention: dict[int, torch.Tensor] | None = None, step_tokens: int = 0) -> list[torch.Tensor] | None:
        """Which entries each layer keeps once the last `n_group` entries (the group's visual
        tokens) are scored: a list of sorted int64 index tensors, one per layer (earlier entries
        are all kept), or None when every layer keeps everything.

        layer_kv(l) -> (keys, values) [kv_heads, n_l, head_dim] of layer l; lengths: n_l;
        attention: layer l+1 -> probs [n_query, n_l + n_query] (the adapter's numbering) when
        importance is attention; step_tokens: visual tokens per temporal step (value_change)."""
        if self.importance == "value_change" and step_tokens <= 0:
            raise ValueError("value_change importance needs the number of visual tokens per temporal step")
        keep, pruned = [], False
        keyframes = self._keyframes(n_group, step_tokens)
        for layer, (n_cached, rho) in enumerate(zip(lengths, self.ratios(len(lengths)))):
            start, k = n_cached - n_group, keep_count(n_group, rho)
            previous = self._remember_last_step(layer_kv, layer, start, n_cached, step_tokens)
            if k == n_group:
                keep.append(torch.arange(n_cached))
                continue
            scores = self._scores(layer_kv, layer, start, n_cached, attention, previous, step_tokens, keyframes)
            keep.append(torch.cat([torch.arange(start), start + top_k_indices(scores, k).cpu()]))
            pruned = True
        if step_tokens > 0:
            self.steps_done += n_group // step_tokens
        return keep if pruned else None

    def _keyframes(self, n_group: int, step_tokens: int) -> tuple[int, ...]:
        """value_change: the group's steps (0-based) that are keyframes, from the video's step count."""
        if self.importance != "value_change":
            return ()
        steps = range(self.steps_done, self.steps_done + n_group // step_tokens)
        if self.keyframe_every == 0:
            return (0,) if self.steps_done == 0 else ()
        return tuple(s - self.steps_done for s in steps if s % self.keyframe_every == 0)

    def _remember_last_step(self, layer_kv, layer: int, start: int, stop: int, step_tokens: int):
        """value_change: the layer's step before this group (None for the first group), and this
        group's last whole step, unpruned, kept for the next group to compare with."""
        if self.importance != "value_change":
            return None
        previous = self.previous_step.get(layer)
        whole = (stop - start) - (stop - start) % step_tokens
        if whole >= step_tokens:
            self.previous_step[layer] = layer_kv(layer)[1][:, start + whole - step_tokens:start + whole].clone()
        return previous

    def _scores(self, layer_kv, layer: int, start: int, stop: int, attention, previous=None,
                step_tokens: int = 0, keyframes: tuple[int, ...] = ()) -> torch.Tensor:
        if self.importance == "random":
            return torch.rand(stop - start, generator=self.generator)
        if self.importance == "attention":
            if attention is None or layer + 1 not in attention:
                raise ValueError("attention importance needs the text query's attention for every layer")
            return attention_entry_scores(attention[layer + 1][:, start:stop])
        keys, values = layer_kv(layer)
        if self.importance == "value_change":
            return value_change_scores(values[:, start:stop], previous, step_tokens, keyframes)
        if self.importance == "key_norm":
            return key_norm_scores(keys[:, start:stop])
        return value_norm_scores(values[:, start:stop])

    def describe(self) -> dict:
        return {"importance": self.importance, "keep": self.keep, "start_layer": self.start_layer,
                "decay": self.decay, "keyframe_every": self.keyframe_every}


# ------------------------------------------------------------------------------ UV-Prune

class UVPrune(Stage):
    """ParallelVLM's verifier-guided pruning of the draft's visual tokens: from the target's
    hidden states at `layers` (published as a prefill tap), keep the share of the video tokens
    whose similarity to the text grows most through those layers.

    keep: the share kept, in (0, 1] (the paper's pruning ratio α is the share dropped: keep = 1 − α); layers: the target's layers l_0 < ... < L (0 = embeddings);
    variant: as_written | telescoped | absolute; text: query (the prompt after the video: the
    question) | all (every text token of the prompt, the chat template's too)."""

    placement = "gpu"                    # it computes where the target's hidden states are
    inputs = {"taps": In(Taps)}
    outputs = {"selection": Out(Selection)}

    def __init__(self, keep: float = 0.1, layers: list | None = None, variant: str = "as_written", text: str = "query"):
        keep_count(1, keep)                           # validates keep
        self.layers = sorted(int(x) for x in (layers if layers is not None else [0, 1, 2]))
        if len(self.layers) < 2 or self.layers[0] < 0:
            raise ValueError(f"layers must be two or more layer numbers ≥ 0, got {layers}")
        if variant not in UV_VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(UV_VARIANTS)}, got {variant!r}")
        if text not in ("query", "all"):
            raise ValueError(f"text must be query or all, got {text!r}")
        self.keep, self.variant, self.text = keep, variant, text

    def __call__(self, ctx, taps: Taps):
        missing = [layer for layer in self.layers if layer not in taps.layers]
        if missing:
            raise ValueError(f"UV-Prune needs the target's layers {self.layers}; the prefill taps {sorted(taps.layers)}: "
                             f"set the target prefill's taps to include {missing}")
        layout = taps.layout
        start, end = layout.video_start, layout.video_start + layout.n_video
        text = torch.arange(end, layout.length) if self.text == "query" else torch.cat(
            [torch.arange(start), torch.arange(end, layout.length)])
        scores = uv_scores(taps.layers, slice(start, end), text, self.layers, self.variant)
        return {"selection": Selection(keep_top(scores, self.keep), layout.n_video, scores)}


# ------------------------------------------------------------------------------ SpecVLM

class AttentionPrune(Stage):
    """The draft's video tokens chosen by the target's attention (SpecVLM): the text query's
    attention to each video token at the target's layers `layers` (published by the prefill's
    `attention` tap), averaged over the query tokens and those layers.

    keep: the share of the m video tokens kept, ⌈keep·m⌉ (the paper's ratio α is the share dropped:
    keep = 1 − α); mass: the attention share the top tokens must cover
    before the rest of the budget is spread uniformly over the video."""

    placement = "gpu"                    # it computes where the target's hidden states are
    inputs = {"taps": In(Taps)}          # the prefill's `attention` tap: layer -> [n_query, seq] probabilities
    outputs = {"selection": Out(Selection)}

    def __init__(self, keep: float = 0.1, mass: float = 0.5):
        keep_count(1, keep)                           # validates keep
        if not 0 < mass <= 1:
            raise ValueError(f"mass must be in (0, 1], got {mass}")
        self.keep, self.mass = keep, mass

    def __call__(self, ctx, taps: Taps):
        attention = taps
        layout = attention.layout
        start, end = layout.video_start, layout.video_start + layout.n_video
        received = torch.stack([probs[:, start:end].mean(0) for probs in attention.layers.values()]).mean(0)
        budget = keep_count(layout.n_video, self.keep)
        return {"selection": Selection(attention_guided_keep(received, budget, self.mass), layout.n_video, received)}
