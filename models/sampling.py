"""Turning logits into the next token: greedy, or sampling with temperature / top-k / top-p.

The same `warp` must be applied to a draft's and a target's logits for speculative sampling to
stay lossless (docs/design.md, pitfall 5), so it is one pure function both use.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """probs [..., V] -> int64 [...]: one draw per row, on the generator's device: a run seeded
    with a CPU generator draws the same tokens whether the model sits on a CPU or a GPU."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and flat.device != generator.device:
        flat = flat.to(generator.device)
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


@dataclass(frozen=True)
class Sampling:
    """The decoding rule a stage applies to logits: temperature 0 is greedy; otherwise warp (the
    same for a draft and its target) and draw."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"top_k must be ≥ 0 and top_p in (0, 1], got top_k={self.top_k}, top_p={self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] -> the warped distribution [..., V] (sampling only)."""
        return warp(logits, self.temperature, self.top_k, self.top_p)

    def pick(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> tuple[int, torch.Tensor | None]:
        """logits [V] -> (the next token, the distribution it was drawn from; None when greedy)."""
        if self.greedy:
            return int(greedy(logits)), None
        q = self.probs(logits)
        return int(sample(q, generator)), q
