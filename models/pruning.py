"""Pruning math: how many entries a share keeps, the importance scores, and which indices win.

Pure functions of tensors, shared by the pruning stages (stages.prune), the zoo's agreement
measurements (zoo.card) and its visual-token dropout in training (zoo.train.dropout). One
convention throughout: `keep` is the share of entries kept, in (0, 1]. The papers' own symbols
map onto it as QuickVideo's ρ = keep, ParallelVLM's α = 1 − keep (the share dropped), FastV's
R = 1 − keep.
"""

from __future__ import annotations

import math

import torch

UV_VARIANTS = ("as_written", "telescoped", "absolute")


# ------------------------------------------------------------------------------ how many

def keep_count(n: int, keep: float) -> int:
    """⌈keep · n⌉ entries of n, at least one when n > 0 (rounded to 9 digits before the ceiling
    so that 0.1 · 30 is 3, not 4, and 1 − 0.9 keeps as many as 0.1)."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep (the share kept) must be in (0, 1], got {keep}")
    return min(n, max(1, math.ceil(round(keep * n, 9))))


def layer_ratios(n_layers: int, keep: float, start_layer: int = 0, decay: float = 1.0) -> list[float]:
    """The share each of layers 0..n_layers−1 keeps: 1 below `start_layer`, keep · decay^(l − start_layer)
    from it."""
    return [1.0 if layer < start_layer else keep * decay ** (layer - start_layer) for layer in range(n_layers)]


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [n] -> the indices of the k highest, in ascending (cache) order, int64 [k]."""
    return torch.topk(scores, k).indices.sort().values


def keep_top(scores: torch.Tensor, keep: float) -> torch.Tensor:
    """scores [m] -> the ⌈keep · m⌉ highest-scoring indices (at least one), ascending, int64."""
    return top_k_indices(scores, keep_count(scores.shape[0], keep))


# ------------------------------------------------------------------------------ KV entry scores

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


# ------------------------------------------------------------------------------ UV-Prune

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
