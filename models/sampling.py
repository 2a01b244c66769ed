"""Turning logits into the next token: greedy, or sampling with temperature / top-k / top-p.

The same `warp` must be applied to a draft's and a target's logits for speculative sampling to
stay lossless (DESIGN.md pitfall 5), so it is one pure function both use.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, then top-k, then
    top-p (the smallest set of most likely tokens whose mass reaches top_p; the most likely token
    always stays), renormalised. Order and tie handling as transformers' logits warpers."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for sampling; use greedy() for temperature 0")
    x = logits.float() / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> int64 [...]: the most likely token (the first on ties, as argmax)."""
    return logits.argmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """probs [..., V] -> int64 [...]: one draw per row."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
