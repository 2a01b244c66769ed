"""The acceptance rules: pure functions from the target's logits (or warped distributions) to
what a round commits.

    verify_chain(draft [k], logits [k+1, V], sampling, q [k, V] | None, rng) -> (accepted, next)
    verify_tree(tokens [n], parents [n], logits [n+1, V], sampling, q [n, V] | None, rng) -> (path, next)

Row i of the target's logits predicts the token after the first i draft tokens (for a tree: row
0 the roots' position, row i + 1 the children of node i). `next` is the target's own token after
what was accepted: the bonus after a whole block, the correction at the first rejection.

Temperature 0: a draft token is accepted while it is the target's argmax, so the committed tokens
are the target's greedy ones whatever was drafted. Temperature > 0 (Leviathan et al. 2023, Chen et
al. 2023): draft token d_i, drawn from q_i, is accepted with probability min(1, p_i(d)/q_i(d)); at
the first rejection the next token is drawn from max(0, p_i − q_i), renormalised; after a whole
block, from p_k. A tree tries a node's children in order (SpecInfer, Miao et al. 2024; EAGLE): each
rejected child turns p into that residual and takes its token out of q (siblings are drawn without
replacement); a tree drafted without q (EAGLE-2's top-k candidates) is q = a point mass on each
child in turn. Both p and q are warped alike (models.sampling.warp) over the shared vocabulary, so
every committed token follows the target's own sampling distribution.
"""

from __future__ import annotations

import torch

from models.sampling import Sampling, sample
from speculative.tree import children_of


def verify_chain(draft: torch.Tensor, logits: torch.Tensor, sampling: Sampling, q: torch.Tensor | None = None,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """draft int64 [k]; logits [k+1, V]; q [k, V] the draft's warped distributions (sampling only).
    Returns (accepted ∈ 0..k, the target's token after them). The sampling rule runs on the host,
    so its draws come from a CPU generator whatever device the logits are on."""
    if sampling.greedy:
        return greedy_verify(draft, logits)
    if q is None:
        raise ValueError("sampling needs the draft's distributions q: a proposal drafted with temperature > 0 carries them")
    return speculative_verify(draft, q.float().cpu(), sampling.probs(logits).float().cpu(), generator)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, sampling: Sampling,
                q: torch.Tensor | None = None, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """tokens, parents [n]; logits [n+1, V]; q None (fixed candidates) or [n, V]. Returns (the
    accepted root-to-node path as node indices, the target's token after it)."""
    if sampling.greedy:
        return tree_greedy_verify(tokens, parents, logits)
    q = q.float().cpu() if q is not None else None
    return tree_sample_verify(tokens, parents, sampling.probs(logits).float().cpu(), generator, q)


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft int64 [k]; target_logits [k+1, V]. Returns (accepted, the target's argmax after them)."""
    choice = target_logits.argmax(-1).to(draft.device)                   # [k+1], beside the draft's tokens
    agree = (choice[:-1] == draft).long()
    accepted = int(agree.cumprod(0).sum())
    return accepted, int(choice[accepted])


def speculative_verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """draft int64 [k]; q [k, V] the distributions draft[i] was drawn from; p [k+1, V] the
    target's. Returns (accepted, next token ~ the residual at the first rejection, else ~ p_k)."""
    k = draft.shape[0]
    u = torch.rand(k, generator=generator)
    rows = torch.arange(k)
    ratio = p[rows, draft] / q[rows, draft]                               # q > 0: draft[i] was drawn from q_i
    for i in range(k):
        if u[i] >= ratio[i]:                                              # rejected (accept iff u < min(1, ratio))
            residual = (p[i] - q[i]).clamp_min(0)
            total = residual.sum()
            # p == q exactly leaves no residual; any draw from p is then right (it never happens
            # after a rejection unless by rounding)
            return i, int(sample(residual / total if total > 0 else p[i], generator))
    return k, int(sample(p[k], generator))


def tree_greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """From the root, follow the child whose token is the target's argmax; stop where none is."""
    kids = children_of(parents)
    choice = logits.argmax(-1).tolist()                                   # [n+1]
    path, node = [], -1
    while True:
        want = choice[node + 1]
        step = next((c for c in kids.get(node, []) if int(tokens[c]) == want), None)
        if step is None:
            return path, want
        path.append(step)
        node = step


def tree_sample_verify(tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None, q: torch.Tensor | None = None) -> tuple[list[int], int]:
    """p [n+1, V] the target's warped distributions; q None or [n, V] (q[i]: the distribution node
    i's token was drawn from, the same row for siblings). Multi-candidate rejection sampling."""
    kids = children_of(parents)
    path, node = [], -1
    while True:
        target = p[node + 1].clone()
        draft = None
        accepted = None
        for child in kids.get(node, []):
            x = int(tokens[child])
            if q is not None and draft is None:
                draft = q[child].clone()
            qx = 1.0 if q is None else float(draft[x])
            if qx <= 0:
                raise ValueError(f"node {child}'s token {x} has probability 0 under the draft it was drawn from")
            if float(torch.rand((), generator=generator)) < min(1.0, float(target[x]) / qx):
                accepted = child
                break
            # rejected: the target's residual, and the draft without x (the next sibling differs)
            if q is None:
                target[x] = 0
            else:
                target = (target - draft).clamp_min(0)
                draft[x] = 0
                total = draft.sum()
                draft = draft / total if total > 0 else draft
            total = target.sum()
            # nothing left of p only when p was a point mass on rejected tokens, which cannot be
            # drawn; rounding aside, fall back to p itself
            target = target / total if total > 0 else p[node + 1].clone()
        if accepted is None:
            return path, int(sample(target, generator))
        path.append(accepted)
        node = accepted


def commit(committed: list[int], accepted: list[int], next_token: int | None, eos_ids,
           max_new_tokens: int) -> tuple[list[int], bool]:
    """Appends the accepted tokens and the target's next one (None: none), cut at the first EOS or
    at max_new_tokens (either can fall inside an accepted block). Returns (the new list, done)."""
    out = list(committed)
    for token in [*accepted, *([] if next_token is None else [next_token])]:
        out.append(token)
        if token in eos_ids or len(out) >= max_new_tokens:
            return out, True
    return out, False
