"""Draft trees: their structure, the masks and positions a forward needs, the shapes benchmarks
use, and the choices of EAGLE-2's dynamic tree. Every tree in reelflow goes through here: the
Sparrow head's drafting (speculative.head_draft), the target's verification (speculative.verifier
and models.adapter's tree forward), the acceptance rules (speculative.rules) and the cost bench.

A tree is `tokens` int64 [n] and `parents` int64 [n], listed parents first: parents[i] < i, and
-1 marks a root (a child of the last committed token). A chain of k tokens is the tree whose
parents are i − 1, and every function here treats it as the chain it is.

    chain_parents(k), children_of(parents), check_tree(tokens, parents)   structure
    tree_mask(parents)       bool [n, n]: node i sees node j iff j is i or an ancestor of i
    tree_depths(parents)     int64 [n]: a root has depth 0
    under_chain(m, parents)  the tree hung under m committed tokens not yet cached (one forward)
    bushy_tree(n, width)     a draft tree's shape, for timing a tree forward
    to_expand, best_subtree  EAGLE-2's choices, as tensors: which nodes grow, which are kept
"""

from __future__ import annotations

import torch


def chain_parents(k: int) -> torch.Tensor:
    """parents [k] of a chain: each token follows the one before it, the first follows the cache."""
    return torch.arange(k) - 1


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
    check_parents(parents)
    token_ids = tokens.tolist()            # on the host once: a round checks a tree of dozens of nodes
    for node, kids in children_of(parents).items():
        toks = [token_ids[k] for k in kids]
        if len(set(toks)) != len(toks):
            raise ValueError(f"node {node} has two children with the same token: {toks}")


def check_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless every parent comes before its child (or is -1, a root)."""
    for i, p in enumerate(parents.tolist()):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} is not before it: a tree lists parents first")


def tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents int64 [n] -> bool [n, n]: row i attends to column j iff j is i or one of its
    ancestors. A chain gives the causal mask."""
    check_parents(parents)
    n = parents.shape[0]
    rows: list[list[bool]] = []            # built on the host: a torch operation per node costs more
    for i, p in enumerate(parents.tolist()):
        row = list(rows[p]) if p >= 0 else [False] * n
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(n, n)


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """parents int64 [n] -> the depth of each node [n] (a root has depth 0): a node sits at the
    logical position `first + depth`, the position it would have in its own chain."""
    depth: list[int] = []
    for p in parents.tolist():
        depth.append(0 if p < 0 else depth[p] + 1)
    return torch.tensor(depth, dtype=torch.long)


def under_chain(m: int, parents: torch.Tensor) -> torch.Tensor:
    """parents [n] of a tree -> parents [m + n] of one tree: a chain of m tokens (committed, not yet
    cached) with the tree's roots hung under its last one. With m = 0 the tree itself."""
    if m == 0:
        return parents
    return torch.cat([chain_parents(m), torch.where(parents < 0, m - 1, parents + m)])


def bushy_tree(n: int, width: int = 4) -> torch.Tensor:
    """parents [n] of a tree shaped like a draft's dynamic tree: `width` roots, each node with up
    to `width` children, filled breadth first (30 nodes, width 4: depths 0-2). For timing a tree
    forward of a given size when no head drafts one."""
    return torch.tensor([-1 if i < width else (i - width) // width for i in range(n)], dtype=torch.long)


# ---------------------------------------------------------------------- EAGLE-2's dynamic tree

def to_expand(frontier_scores: torch.Tensor, topk: int) -> torch.Tensor:
    """frontier_scores float64 [F] (cumulative log-probabilities of the frontier, in node order)
    -> the positions in the frontier of its `topk` best, best first, ties to the earlier node: the
    next level grows under them (EAGLE-2's expansion). float64 and a stable sort make the choice
    the same on every machine for the same scores."""
    return torch.sort(-frontier_scores, stable=True).indices[:topk]


def best_subtree(parents: torch.Tensor, scores: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's reranking. parents int64 [N] of a tree listed level by level (no node deeper than
    a later one), scores float64 [N] -> (kept [m]: the `total` best nodes, ties to the earlier,
    closed under ancestors, in their original order, so by depth; their parents [m] renumbered
    among them). A node's ancestors are at least as likely as it, so the closure only matters on
    ties."""
    # on the host, in lists: a tree of a few dozen nodes, where each torch operation costs more
    up, score = parents.tolist(), scores.tolist()
    best = sorted(range(len(up)), key=lambda i: -score[i])[:total]     # stable: ties to the earlier
    keep = set(best)
    for node in best:                # close under ancestors
        while up[node] >= 0 and up[node] not in keep:
            node = up[node]
            keep.add(node)
    kept = sorted(keep)
    number = {node: i for i, node in enumerate(kept)}                    # a kept node's new number
    return (torch.tensor(kept, dtype=torch.long),
            torch.tensor([number[up[node]] if up[node] >= 0 else -1 for node in kept], dtype=torch.long))
