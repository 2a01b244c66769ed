"""The verification rules for a draft *tree*: candidates that branch, scored by the target in one
forward (VideoLM.score_tree), of which one root-to-node path is accepted.

A tree is `tokens` int64 [n] and `parents` int64 [n] (parents[i] < i; -1: a child of the last
committed token), listed parents first. A chain is the tree whose parents are i − 1, and on a chain
every rule here gives what the chain rules of stages.verify give.

Target logits come as `p` [n + 1, V]: row 0 predicts the token after the committed sequence (the
roots' position), row i + 1 the token after node i (its children's position).

    tree_greedy_verify(tokens, parents, logits [n+1, V]) -> (path, next_token)
        temperature 0: from the root, follow the child whose token is the target's argmax; stop
        where no child has it; next_token is that argmax. The committed tokens are the target's
        greedy ones whatever the tree holds.

    tree_sample_verify(tokens, parents, p [n+1, V], rng, q=None) -> (path, next_token)
        temperature > 0, multi-candidate rejection sampling (SpecInfer, Miao et al. 2024; EAGLE):
        at a node, try its children in order; child x is accepted with probability
        min(1, p(x) / q(x)); on rejection p becomes the residual norm(max(0, p − q)) and q loses x
        (q(x) := 0, renormalised: the next sibling was drawn without replacement); when every
        child is rejected, the next token is drawn from what is left of p. With q = None the
        children are taken as fixed candidates (EAGLE-2's top-k expansion), that is q = a point
        mass on each in turn: x is accepted with probability p(x), and on rejection x is removed
        from p. Either way the committed token at every position follows the target's p exactly
        (the residual argument of Leviathan et al., applied once per sibling).
"""

from __future__ import annotations

import torch

from models.sampling import sample


def children_of(parents: torch.Tensor) -> dict[int, list[int]]:
    """parents [n] -> {node (-1: the root): its children in tree order}."""
    out: dict[int, list[int]] = {}
    for i, p in enumerate(parents.tolist()):
        out.setdefault(p, []).append(i)
    return out


def check_tree(tokens: torch.Tensor, parents: torch.Tensor) -> None:
    """Raise ValueError unless tokens [n] and parents [n] form a tree listed parents first whose
    siblings carry different tokens (two equal siblings would be one candidate counted twice)."""
    if tokens.shape != parents.shape or tokens.dim() != 1:
        raise ValueError(f"a tree needs tokens and parents of one shape [n], got {tuple(tokens.shape)} "
                         f"and {tuple(parents.shape)}")
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not before it: a tree lists parents first")
    for node, kids in children_of(parents).items():
        toks = tokens[kids].tolist()
        if len(set(toks)) != len(toks):
            raise ValueError(f"node {node} has two children with the same token: {toks}")


def tree_greedy_verify(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor) -> tuple[list[int], int]:
    """tokens, parents [n]; logits [n+1, V]. Returns (accepted path of node indices, the target's
    token after it)."""
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
    """tokens, parents [n]; p [n+1, V] the target's warped distributions; q None (fixed
    candidates) or [n, V]: q[i] the distribution node i's token was drawn from (the same row for
    siblings, drawn without replacement). Returns (accepted path, next token)."""
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
