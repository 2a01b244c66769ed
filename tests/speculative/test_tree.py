"""Draft trees: the structure helpers (speculative.tree) and the tree acceptance rules
(speculative.rules): structure checks, greedy = the target's argmax path
and the chain rule on a chain, and sampling that commits tokens with exactly the target's
distribution, with fixed candidates and with candidates drawn from a draft.

The sampling tests compare counts over many seeded draws with the exact distribution by a Pearson
chi-square. The draws are seeded, so each test is deterministic; the bound is the 0.999 quantile
of the chi-square law for the degrees of freedom used (a rule that were wrong by a few percent on
any token fails by far: the statistic grows with the number of draws)."""

from __future__ import annotations

import pytest
import torch

from speculative.rules import greedy_verify, tree_greedy_verify, tree_sample_verify
from speculative.tree import (
    best_subtree,
    bushy_tree,
    check_tree,
    children_of,
    to_expand,
    tree_depths,
    tree_mask,
    under_chain,
)

CHI2_999 = {5: 20.52, 11: 31.26}       # 0.999 quantiles of chi-square with 5 and 11 degrees of freedom
V = 6


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_structure_checks():
    check_tree(torch.tensor([1, 2, 3]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="not before it"):
        check_tree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    with pytest.raises(ValueError, match="same token"):
        check_tree(torch.tensor([1, 2, 2]), torch.tensor([-1, 0, 0]))
    with pytest.raises(ValueError, match="one shape"):
        check_tree(torch.tensor([1, 2]), torch.tensor([-1]))
    assert children_of(torch.tensor([-1, 0, 0, -1])) == {-1: [0, 3], 0: [1, 2]}


def test_greedy_on_a_chain_is_the_chain_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = 4
        logits = torch.randn(k + 1, V, generator=g)
        draft = logits.argmax(-1)[:k].clone()
        cut = int(torch.randint(0, k + 1, (), generator=g))
        if cut < k:
            draft[cut] = (draft[cut] + 1) % V
        path, token = tree_greedy_verify(draft, torch.arange(k) - 1, logits)
        assert (len(path), token) == greedy_verify(draft, logits) and path == list(range(len(path)))


def test_greedy_follows_the_argmax_through_the_branches():
    #        root
    #      /  |   \
    #    0:a 1:b  2:c           the target's argmax at the root is b, then e
    #         |  \
    #       3:d  4:e -- 5:f
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    parents = torch.tensor([-1, -1, -1, 1, 1, 4])
    logits = torch.full((7, V), -5.0)
    logits[0, 1] = logits[2, 4] = 5.0        # root -> b, after b -> e
    logits[5, 2] = 5.0                       # after e: c, which is not e's child (f is)
    path, token = tree_greedy_verify(tokens, parents, logits)
    assert path == [1, 4] and token == 2
    logits[0] = -5.0
    logits[0, 5] = 5.0                       # no root child carries the argmax: nothing accepted
    assert tree_greedy_verify(tokens, parents, logits) == ([], 5)


@pytest.mark.parametrize("drawn", [False, True], ids=["fixed candidates", "drawn from q"])
def test_sampling_commits_the_targets_distribution(drawn):
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V + 1, V, generator=g) * 1.5, -1)      # target rows: root and after each token
    q_root = torch.softmax(torch.randn(V, generator=g), -1)
    n_draws = 12000
    first = torch.zeros(V)
    pairs = torch.zeros(V)
    rng = torch.Generator().manual_seed(2)
    for _ in range(n_draws):
        if drawn:     # three different root candidates drawn without replacement from q_root
            roots = torch.multinomial(q_root, 3, replacement=False, generator=rng)
        else:
            roots = torch.tensor([0, 3, 5])
        # each root candidate gets one child: token (root + 1) % V (a fixed candidate)
        tokens = torch.cat([roots, (roots + 1) % V])
        parents = torch.tensor([-1, -1, -1, 0, 1, 2])
        # row i + 1 of p_tree: the target after node i; root candidates' rows depend on their token
        p_tree = torch.stack([p[0], *[p[1 + int(t)] for t in tokens]])
        q = None
        if drawn:
            q = torch.stack([q_root] * 3 + [torch.zeros(V)] * 3)
        # the drawn-from-q rule takes q for the roots; their fixed children use a point mass
        path, token = _mixed_verify(tokens, parents, p_tree, rng, q)
        out = [int(tokens[i]) for i in path] + [token]
        first[out[0]] += 1
        if out[0] == 0:
            pairs[out[1]] += 1
    assert chi_square(first, p[0]) < CHI2_999[5]
    assert chi_square(pairs, p[1]) < CHI2_999[5]          # the second token, given the first was 0


def _mixed_verify(tokens, parents, p_tree, rng, q):
    """Roots judged with q (or as fixed candidates), the single children as fixed candidates: the
    rule is applied level by level, as tree_sample_verify does, which this checks end to end."""
    if q is None:
        return tree_sample_verify(tokens, parents, p_tree, rng)
    # children of the roots are point masses: give them q = one-hot rows, which is the same rule
    q = q.clone()
    for i in range(3, 6):
        q[i] = torch.nn.functional.one_hot(tokens[i], V).float()
    return tree_sample_verify(tokens, parents, p_tree, rng, q)


def test_sampling_on_a_chain_accepts_as_the_chain_rule_would():
    """On a chain with q the rule is the chain's (Leviathan et al.): acceptance rate of the first
    token min(1, p/q) in expectation."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, V, generator=g), -1)
    q = torch.softmax(torch.randn(1, V, generator=g), -1)
    rng = torch.Generator().manual_seed(4)
    accepted, n = 0, 8000
    for _ in range(n):
        x = torch.multinomial(q[0], 1, generator=rng)
        path, _ = tree_sample_verify(x, torch.tensor([-1]), p, rng, q)
        accepted += len(path)
    expected = float(torch.minimum(p[0], q[0]).sum())     # Σ min(p, q): the chain rule's acceptance rate
    assert abs(accepted / n - expected) < 4 * (expected * (1 - expected) / n) ** 0.5


def test_tree_helpers():
    parents = torch.tensor([-1, 0, 0, 1, -1])
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 0]
    mask = tree_mask(parents)
    assert mask[3].tolist() == [True, True, False, True, False]       # itself, its parent and grandparent
    assert mask[2].tolist() == [True, False, True, False, False]      # not its sibling
    assert mask[4].tolist() == [False, False, False, False, True]     # a second root sees no other node
    chain = tree_mask(torch.arange(-1, 4))
    assert torch.equal(chain, torch.ones(5, 5, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parent"):
        tree_mask(torch.tensor([-1, 2, 0]))


def test_the_bushy_tree_is_a_draft_trees_shape():
    parents = bushy_tree(30)
    assert parents.shape == (30,) and (parents[:4] == -1).all()
    assert all(p < i for i, p in enumerate(parents.tolist()))                # parents come first
    assert tree_depths(parents).max() == 2 and torch.bincount(parents[4:]).max() <= 4


def test_a_tree_hung_under_a_pending_chain():
    parents = [-1, 0, 0, 1, -1]
    # two committed tokens not yet cached, then the tree under the second one
    assert under_chain(2, torch.tensor(parents)).tolist() == [-1, 0, 1, 2, 2, 3, 1]
    assert under_chain(0, torch.tensor(parents)).tolist() == parents


def test_best_subtree_keeps_the_most_likely_nodes_closed_under_ancestors():
    #        0 (-1.0) ─ 2 (-1.5)
    # root ─ ┤
    #        1 (-1.2) ─ 3 (-1.2: a tie with its parent)
    parents = torch.tensor([-1, -1, 0, 1])
    scores = torch.tensor([-1.0, -1.2, -1.5, -1.2], dtype=torch.float64)
    kept, kept_parents = best_subtree(parents, scores, total=2)
    assert kept.tolist() == [0, 1] and kept_parents.tolist() == [-1, -1]     # the tie goes to the earlier node
    kept, kept_parents = best_subtree(parents, scores, total=3)
    assert kept.tolist() == [0, 1, 3] and kept_parents.tolist() == [-1, -1, 1]   # renumbered among the kept
    # scores no drafted tree has (a child above its parents) show the closure under ancestors
    scores = torch.tensor([-3.0, -2.0, -1.0], dtype=torch.float64)
    kept, kept_parents = best_subtree(torch.tensor([-1, 0, 1]), scores, 1)
    assert kept.tolist() == [0, 1, 2] and kept_parents.tolist() == [-1, 0, 1]


def tensor_best_subtree(parents: torch.Tensor, scores: torch.Tensor, total: int):
    """best_subtree as tensor operations (how it was first written): the reference for the lists."""
    keep = torch.zeros(parents.shape[0], dtype=torch.bool)
    keep[torch.sort(-scores, stable=True).indices[:total]] = True
    while True:
        up = parents[keep & (parents >= 0)]
        if keep[up].all():
            break
        keep[up] = True
    kept = keep.nonzero().squeeze(1)
    number = torch.cumsum(keep, 0) - 1
    kept_parents = parents[kept]
    return kept, torch.where(kept_parents >= 0, number[kept_parents.clamp_min(0)], -1)


def test_best_subtree_and_the_mask_on_random_trees_with_ties():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        parents = torch.tensor([-1 if i == 0 else int(torch.randint(-1, i, (1,), generator=g)) for i in range(n)])
        scores = -torch.randint(0, 6, (n,), generator=g).double() / 2          # few values: many ties
        total = int(torch.randint(0, n + 2, (1,), generator=g))
        for got, want in zip(best_subtree(parents, scores, total), tensor_best_subtree(parents, scores, total)):
            assert got.dtype == torch.long and got.tolist() == want.tolist()
        mask = tree_mask(parents)
        for i in range(n):                         # row i: i and the ancestors a walk up finds
            seen, node = {i}, i
            while parents[node] >= 0:
                node = int(parents[node])
                seen.add(node)
            assert mask[i].nonzero().squeeze(1).tolist() == sorted(seen)


def test_expansion_takes_the_best_frontier_nodes_ties_to_the_earlier():
    scores = torch.tensor([-1.0, -0.5, -1.0, -0.5, -2.0], dtype=torch.float64)
    assert to_expand(scores, 3).tolist() == [1, 3, 0]
    assert to_expand(scores, 9).tolist() == [1, 3, 0, 2, 4]
