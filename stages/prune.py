"""prune: choosing which cached entries (or visual tokens) to keep.

Two kinds live here: QuickPrefill's per-group KV pruning (`GroupKVPrune`, applied by the group
prefill) and ParallelVLM's UV-Prune of the draft's visual tokens (`UVPrune`, a stage fed by the
target's prefill taps). QuickPrefill first:

QuickPrefill (QuickVideo §3.2, Eq. 2) prunes each group's KV cache right after the group is
prefilled, before the next group attends to it, keeping the top ⌈ρ·n⌉ of the group's n entries
by an importance score:

    key_norm     s = −‖K‖   small keys matter most (the seed's default; Devoto et al. 2024)
    value_norm   s = +‖V‖
    attention    s = the text query's attention to the entry
    random       s ~ U(0, 1)   (the floor any score must beat)
    value_change s = ‖v_i − v_(i−P)‖  how much a token differs from the same place one temporal
                 step (P tokens) earlier: not one of the seed's; a temporal-redundancy score (as
                 DyCoke-style pruning of tokens that repeat the previous frame), added because the
                 seed's fail on the toy zoo, whose cells hold still for seconds between events.
                 Every `keyframe_every` temporal steps one step is kept whole (an I-frame among
                 P-frame residuals): with changes alone nothing still survives after the first
                 step, and the toy's captions then lose their background and end early

Choices the seed leaves open, and what we do:
- Heads. One kept set per layer, shared by all its heads (a cache row is one token in every
  head): norms are taken over the layer's keys (or values) of all KV heads together, the
  L2 norm of the token's [kv_heads · head_dim] vector, as the seed writes ‖K_g^(l)‖.
- Layers. Each layer scores and keeps its own set, so layers hold different entries and lengths
  (the adapter masks each layer for its own length). `start_layer` leaves the layers below it
  unpruned; `decay` shrinks the ratio layer by layer above it: ρ_l = ρ · decay^(l − start_layer).
- Rounding. k = ⌈ρ_l · n⌉ (at least one entry for ρ > 0), so ρ = 1 keeps everything and a tiny
  group is never emptied.
- Attention. The question comes after the video, so when a group is pruned its text is not in
  the cache yet: the text after the video is run over the cache at the positions it would have
  if the video ended with this group, its attention probabilities (averaged over heads and
  query tokens) score the group's entries, and its own entries are dropped again. Probabilities
  rank the entries of one query row as its logits q·k do (softmax is monotone); averaging
  probabilities rather than logits keeps one row's outliers from dominating.
"""

from __future__ import annotations

import math

import torch

from graph.stage import In, Out, Stage
from stages.types import Selection, Taps

IMPORTANCE = ("key_norm", "value_norm", "attention", "random", "value_change")


# ------------------------------------------------------------------------------ pure math

def keep_count(n: int, ratio: float) -> int:
    """⌈ratio · n⌉ entries of n (rounded before the ceiling so 0.1 · 30 is 3, not 4)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"retention ratio must be in (0, 1], got {ratio}")
    return min(n, math.ceil(round(ratio * n, 9)))


def layer_ratios(n_layers: int, ratio: float, start_layer: int = 0, decay: float = 1.0) -> list[float]:
    """ρ_l for layers 0..n_layers−1: 1 below `start_layer`, ρ · decay^(l − start_layer) from it."""
    return [1.0 if layer < start_layer else ratio * decay ** (layer - start_layer) for layer in range(n_layers)]


def key_norm_scores(keys: torch.Tensor) -> torch.Tensor:
    """keys [kv_heads, n, head_dim] -> [n]: −‖k‖ over all heads (small keys score high)."""
    return -keys.float().square().sum(dim=(0, 2)).sqrt()


def value_norm_scores(values: torch.Tensor) -> torch.Tensor:
    """values [kv_heads, n, head_dim] -> [n]: +‖v‖ over all heads."""
    return values.float().square().sum(dim=(0, 2)).sqrt()


def value_change_scores(values: torch.Tensor, previous_step: torch.Tensor | None, step_tokens: int,
                        keyframes: tuple[int, ...] | None = None) -> torch.Tensor:
    """values [kv_heads, n, head_dim] of a group of whole temporal steps of `step_tokens` tokens;
    previous_step [kv_heads, step_tokens, head_dim]: the step before the group, unpruned (None for
    the video's first group); keyframes: the group's steps (0-based) kept whole (None: the video's
    first step only, i.e. step 0 when there is no previous step) -> [n].

    A token scores ‖v_i − v_(i−P)‖ over all heads: values carry no rotary position, so a cell that
    holds still scores near 0. Keyframe tokens score above every such change (an I-frame among
    P-frame residuals), ranked among themselves by how much they differ from their frame's
    median (`spatial_change_scores`), so a budget smaller than a step keeps the frame's
    distinctive cells. Tokens past the last whole step (LLaVA's closing newline) score +inf."""
    n = values.shape[1]
    whole = n - n % step_tokens
    scores = torch.full((n,), float("inf"))
    if whole == 0:
        return scores
    if keyframes is None:
        keyframes = (0,) if previous_step is None else ()
    if previous_step is None and 0 not in keyframes:
        raise ValueError("the video's first step has nothing before it: it must be a keyframe")
    v = values[:, :whole].float()
    before = v[:, : whole - step_tokens]
    if previous_step is not None:
        before = torch.cat([previous_step.float(), before], dim=1)
    first = whole - before.shape[1]                    # step_tokens when there is no previous step
    scores[first:whole] = (v[:, first:] - before).square().sum(dim=(0, 2)).sqrt()
    frames = [s for s in sorted(set(keyframes)) if 0 <= s < whole // step_tokens]
    if frames:
        changes = scores[first:whole]
        changes = changes[torch.isfinite(changes)]
        above = 1.0 + (float(changes.max()) if changes.numel() else 0.0)
        for s in frames:
            at = slice(s * step_tokens, (s + 1) * step_tokens)
            scores[at] = above + spatial_change_scores(v[:, at])
    return scores


def spatial_change_scores(values: torch.Tensor) -> torch.Tensor:
    """values [kv_heads, m, head_dim] of one temporal step -> [m]: ‖v_i − median_j v_j‖ over all
    heads, how much a token differs from what its frame mostly shows (the background)."""
    typical = values.float().median(dim=1, keepdim=True).values
    return (values.float() - typical).square().sum(dim=(0, 2)).sqrt()


def attention_entry_scores(probs: torch.Tensor) -> torch.Tensor:
    """probs [n_query, n] (already averaged over heads) -> [n]: mean attention each entry gets."""
    return probs.float().mean(0)


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores, in ascending order (cache order), int64 [k]."""
    return torch.topk(scores, k).indices.sort().values


# ------------------------------------------------------------------------------ the policy

class GroupKVPrune:
    """QuickPrefill's per-group KV pruning, applied by the group prefill after each group.

    importance: key_norm | value_norm | attention | random | value_change; ratio: ρ in (0, 1];
    start_layer, decay: see the module docstring; seed: for `random`; keyframe_every: for
    `value_change`, every this many temporal steps (counted over the whole video) one step is kept
    whole, 0: only the video's first."""

    def __init__(self, importance: str = "key_norm", ratio: float = 0.5, start_layer: int = 0,
                 decay: float = 1.0, seed: int = 0, keyframe_every: int = 0):
        if importance not in IMPORTANCE:
            raise ValueError(f"prune.importance must be one of {', '.join(IMPORTANCE)}, got {importance!r}")
        keep_count(1, ratio)      # validates ratio
        if start_layer < 0:
            raise ValueError(f"prune.start_layer must be ≥ 0, got {start_layer}")
        if not 0 < decay <= 1:
            raise ValueError(f"prune.decay must be in (0, 1], got {decay}")
        if keyframe_every < 0:
            raise ValueError(f"prune.keyframe_every must be ≥ 0 (0: only the video's first step), got {keyframe_every}")
        self.importance, self.ratio, self.start_layer, self.decay = importance, ratio, start_layer, decay
        self.keyframe_every = keyframe_every
        self.generator = torch.Generator().manual_seed(seed)
        self.previous_step: dict[int, torch.Tensor] = {}     # value_change: each layer's last step, unpruned
        self.steps_done = 0                                  # value_change: temporal steps in earlier groups

    @property
    def needs_attention(self) -> bool:
        return self.importance == "attention"

    def ratios(self, n_layers: int) -> list[float]:
        return layer_ratios(n_layers, self.ratio, self.start_layer, self.decay)

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
        return {"importance": self.importance, "ratio": self.ratio, "start_layer": self.start_layer,
                "decay": self.decay, "keyframe_every": self.keyframe_every}


# ------------------------------------------------------------------------------ UV-Prune

UV_VARIANTS = ("as_written", "telescoped", "absolute")


def similarity(video: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
    """Cosine similarity, video [m, d] x text [n, d] -> [m, n] (ParallelVLM Eq. 2), in float32."""
    v = torch.nn.functional.normalize(video.float(), dim=-1)
    t = torch.nn.functional.normalize(text.float(), dim=-1)
    return v @ t.T


def uv_scores(hidden: dict[int, torch.Tensor], video: slice, text: torch.Tensor, layers: list[int],
              variant: str = "as_written") -> torch.Tensor:
    """ΔS_i for each video token (ParallelVLM Eq. 3) from the target's hidden states at `layers`
    (sorted; hidden[l] is [seq, d], l = 0 the embeddings): the layer-to-layer change of its
    similarity to each text token, summed over text tokens and layers.

    as_written  Σ_j Σ_l (S^l_ij − S^{l−1}_ij), one difference per consecutive pair of `layers`
    telescoped  Σ_j (S^L_ij − S^{l_0}_ij): the same sum, collapsed (it must agree up to rounding)
    absolute    Σ_j Σ_l |S^l_ij − S^{l−1}_ij|: how much the alignment moves, either way
    Returns float32 [m]."""
    if variant not in UV_VARIANTS:
        raise ValueError(f"UV-Prune variant must be one of {', '.join(UV_VARIANTS)}, got {variant!r}")
    if len(layers) < 2:
        raise ValueError(f"UV-Prune needs at least two layers to measure a variation, got {layers}")
    sims = [similarity(hidden[layer][video], hidden[layer][text]) for layer in layers]    # each [m, n]
    if variant == "telescoped":
        return (sims[-1] - sims[0]).sum(-1)
    steps = [b - a for a, b in zip(sims, sims[1:])]
    if variant == "absolute":
        steps = [d.abs() for d in steps]
    return torch.stack(steps).sum(0).sum(-1)


def keep_fraction(scores: torch.Tensor, alpha: float) -> torch.Tensor:
    """Top-K (Eq. 4): the ⌈(1 − α)·m⌉ highest-scoring indices (at least one), ascending."""
    if not 0 <= alpha < 1:
        raise ValueError(f"pruning ratio alpha must be in [0, 1), got {alpha}")
    m = scores.shape[0]
    return top_k_indices(scores, max(1, math.ceil(round((1 - alpha) * m, 9))))


class UVPrune(Stage):
    """ParallelVLM's verifier-guided pruning of the draft's visual tokens: from the target's
    hidden states at `layers` (published as a prefill tap), keep the 1 − α of the video tokens
    whose similarity to the text grows most through those layers.

    alpha: the pruning ratio α; layers: the target's layers l_0 < ... < L (0 = embeddings);
    variant: as_written | telescoped | absolute; text: query (the prompt after the video: the
    question) | all (every text token of the prompt, the chat template's too)."""

    placement = "gpu"                    # it computes where the target's hidden states are
    inputs = {"taps": In(Taps)}
    outputs = {"selection": Out(Selection)}

    def __init__(self, alpha: float = 0.9, layers: list | None = None, variant: str = "as_written", text: str = "query"):
        keep_fraction(torch.zeros(1), alpha)          # validates alpha
        self.layers = sorted(int(x) for x in (layers if layers is not None else [0, 1, 2]))
        if len(self.layers) < 2 or self.layers[0] < 0:
            raise ValueError(f"layers must be two or more layer numbers ≥ 0, got {layers}")
        if variant not in UV_VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(UV_VARIANTS)}, got {variant!r}")
        if text not in ("query", "all"):
            raise ValueError(f"text must be query or all, got {text!r}")
        self.alpha, self.variant, self.text = alpha, variant, text

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
        return {"selection": Selection(keep_fraction(scores, self.alpha), layout.n_video, scores)}


# ------------------------------------------------------------------------------ SpecVLM

def attention_guided_keep(attention: torch.Tensor, budget: int, mass: float) -> torch.Tensor:
    """SpecVLM-style selection of `budget` of m video tokens from the attention each receives
    (float [m]): the most attended tokens until they hold `mass` of the attention (or the budget
    is spent), then the rest of the budget spread evenly over the remaining tokens. Sorted int64."""
    m = attention.shape[0]
    order = attention.argsort(descending=True)
    covered = attention[order].cumsum(0) / attention.sum().clamp_min(1e-12)
    top = min(budget, int((covered < mass).sum()) + 1)
    chosen = order[:top]
    rest = torch.ones(m, dtype=torch.bool)
    rest[chosen] = False
    others = rest.nonzero().flatten()
    fill = budget - top
    if fill > 0 and len(others):
        spots = torch.linspace(0, len(others) - 1, fill).round().long().unique()
        chosen = torch.cat([chosen, others[spots]])
    return chosen.sort().values


class AttentionPrune(Stage):
    """The draft's video tokens chosen by the target's attention (SpecVLM): the text query's
    attention to each video token at the target's layers `layers` (published by the prefill's
    `attention` tap), averaged over the query tokens and those layers.

    alpha: pruning ratio (keeps ⌈(1 − α)·m⌉); mass: the attention share the top tokens must cover
    before the rest of the budget is spread uniformly over the video."""

    placement = "gpu"                    # it computes where the target's hidden states are
    inputs = {"taps": In(Taps)}          # the prefill's `attention` tap: layer -> [n_query, seq] probabilities
    outputs = {"selection": Out(Selection)}

    def __init__(self, alpha: float = 0.9, mass: float = 0.5):
        keep_fraction(torch.zeros(1), alpha)
        if not 0 < mass <= 1:
            raise ValueError(f"mass must be in (0, 1], got {mass}")
        self.alpha, self.mass = alpha, mass

    def __call__(self, ctx, taps: Taps):
        attention = taps
        layout = attention.layout
        start, end = layout.video_start, layout.video_start + layout.n_video
        received = torch.stack([probs[:, start:end].mean(0) for probs in attention.layers.values()]).mean(0)
        budget = max(1, math.ceil(round((1 - self.alpha) * layout.n_video, 9)))
        return {"selection": Selection(attention_guided_keep(received, budget, self.mass), layout.n_video, received)}
