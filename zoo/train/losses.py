"""The toy recipe's loss terms as pure functions of tensors: no model, no batch dict. Which of
them a step adds up, and with what weights, is the recipe's business (zoo.train.toy)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def probe_loss(logits: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Mean over the probe's fields of each field's cross-entropy.
    logits: [n_tokens, sum(sizes)], the fields' logits side by side; labels: int64 [n_tokens, len(sizes)]."""
    parts = logits.split(sizes, dim=-1)
    return sum(F.cross_entropy(lg, labels[:, i]) for i, lg in enumerate(parts)) / len(sizes)


def rare_class_loss(logits: torch.Tensor, labels: torch.Tensor, none_weight: float = 0.1) -> torch.Tensor:
    """Cross-entropy with class 0 ("nothing happened", what most tokens see) weighed down, so that
    the rare classes carry the loss. logits: [n_tokens, classes]; labels: int64 [n_tokens]."""
    weight = torch.ones(logits.shape[-1], device=logits.device)
    weight[0] = none_weight
    return F.cross_entropy(logits, labels, weight=weight)


def grounding_loss(attention: torch.Tensor, mask: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """-log of the attention mass the first head puts where `mask` says, averaged over the positions
    that have a target (attention: [batch, heads, queries, keys]; mask: bool [batch, queries, keys]).
    With `margin` m > 1 the mass is that of the head's attention logits divided by m (the weights
    raised to 1/m, renormalised): it takes logit gaps m times those that suffice here, so that the
    head still finds its event among the more events of a longer video."""
    has_target = mask.any(-1)                                  # [batch, queries]
    if not has_target.any():
        return attention.sum() * 0.0
    weights = attention[:, 0].float()                          # [batch, queries, keys]
    if margin != 1.0:
        weights = torch.where(weights > 0, weights.clamp_min(1e-30) ** (1.0 / margin), 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
    mass = (weights * mask).sum(-1)[has_target]                # [n_targets]
    return -torch.log(mass.clamp_min(1e-6)).mean()


def distill_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) per answer token, averaged: the draft learns the target's whole next-
    token distribution where it is trained, not only the reference token (DistillSpec, Zhou et al.
    2024: a draft distilled from its target agrees with it more, which is what speculative
    decoding's acceptance counts). logits, teacher_logits: [batch, seq, vocab] (vocabularies may
    differ in padding: the shared part is compared); labels: int64 [batch, seq], -100 where unscored."""
    target = teacher_logits[:, :-1]
    where = labels[:, 1:] != -100                              # logits at t predict the label at t + 1
    vocab = min(logits.shape[-1], target.shape[-1])
    student = torch.log_softmax(logits[:, :-1][where][:, :vocab].float(), -1)     # [n_answer, vocab]
    teacher_logp = torch.log_softmax(target[where][:, :vocab].float(), -1)
    return F.kl_div(student, teacher_logp, log_target=True, reduction="batchmean")
