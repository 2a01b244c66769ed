"""Visual-token dropout: which of a training example's visual tokens its model sees.

At inference a ParallelVLM draft prefills only the visual tokens UV-Prune keeps, each at its
position in the unpruned prompt (stages.prefill.SelectedPrefill). A draft trained on whole videos
alone has never seen such a prompt and loses much of its agreement with its target there. Trained
on some examples with a subset kept, it learns to answer from what is left, as big models do
because video tokens are redundant.

The training step does not cut the tokens out: their columns leave the attention mask while every
token keeps the position it has in the whole prompt. Each kept token, and the text, then attends
to exactly what SelectedPrefill's shorter prompt would show it, at the same rotary positions; the
dropped tokens' own outputs are computed and never read (no label sits on a visual token).

    keep = keep_mask(is_video, scores, fractions)              # bool [batch, seq]
    mask = attention_mask * keep                                # what the model is run with
"""

from __future__ import annotations

import torch

from models.pruning import keep_top, uv_scores


def keep_mask(is_video: torch.Tensor, scores: torch.Tensor, fractions: torch.Tensor) -> torch.Tensor:
    """True where a token is seen: every token that is not visual, and in row b the ⌈fractions[b]·m⌉
    visual tokens (of its m) with the highest `scores`, with UV-Prune's own rounding
    (models.pruning.keep_top). is_video: bool [batch, seq]; scores: float
    [batch, seq] (read on visual tokens only); fractions: float [batch] in (0, 1], 1 keeps all."""
    keep = ~is_video.clone()
    for b in range(is_video.shape[0]):
        where = is_video[b].nonzero()[:, 0]
        if where.numel() == 0:
            continue
        f = round(float(fractions[b]), 6)       # a float32 0.3 is 0.30000001: its ceiling would take a token more
        chosen = where if f >= 1.0 else where[keep_top(scores[b, where].float().cpu(), f).to(where.device)]
        keep[b, chosen] = True
    return keep


def uv_token_scores(hidden: tuple | list, is_video: torch.Tensor, prompt_end: torch.Tensor,
                    layers: tuple[int, int]) -> torch.Tensor:
    """UV-Prune's score (models.pruning.uv_scores, as_written, the query as text) of each visual token
    of each row, from a teacher's hidden states as the model's forward returns them (hidden[l]
    [batch, seq, d], l = 0 the embeddings): the change of its similarity to the text between the
    video and `prompt_end[b]` (where the answer starts), from layer layers[0] to layers[1]. The
    sum UV-Prune takes over consecutive layers telescopes, so the two ends decide it. Float [batch,
    seq], 0 on tokens that are not visual."""
    out = torch.zeros(is_video.shape, dtype=torch.float32, device=is_video.device)
    for b in range(is_video.shape[0]):
        where = is_video[b].nonzero()[:, 0]
        if where.numel() == 0:
            continue
        start, end = int(where[0]), int(where[-1]) + 1
        text = torch.arange(end, int(prompt_end[b]), device=is_video.device)
        rows = {layer: hidden[layer][b].detach() for layer in layers}
        out[b, start:end] = uv_scores(rows, slice(start, end), text, list(layers)).to(out.device)
    return out


def answer_starts(labels: torch.Tensor) -> torch.Tensor:
    """Per row, the index of its first scored token (where the answer starts; the prompt ends),
    int64 [batch]; a row without one gives its length."""
    scored = labels != -100
    first = scored.int().argmax(-1)
    return torch.where(scored.any(-1), first, torch.full_like(first, labels.shape[-1]))
