"""The acceptance rules of stages/verify.py on hand-made distributions: greedy acceptance, the
committed tokens' distribution under speculative sampling (chi-square against the target's p, with
a naive rule as the control that must fail), and EOS / max_new_tokens inside an accepted block."""

from __future__ import annotations

import pytest
import torch

from speculative.rules import commit, greedy_verify, speculative_verify

CHI2_DF5_P001 = 20.52          # chi-square critical value, 5 degrees of freedom, p = 0.001


def logits_choosing(tokens, vocab=8):
    out = torch.full((len(tokens), vocab), -5.0)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return out


@pytest.mark.parametrize("draft, target, accepted, token", [
    ([3, 4, 5], [3, 4, 5, 6], 3, 6),      # all accepted, the target's bonus token
    ([3, 4, 5], [3, 1, 5, 6], 1, 1),      # the target's correction at the first disagreement
    ([3, 4, 5], [0, 4, 5, 6], 0, 0),
    ([], [2], 0, 2),                       # nothing proposed: one plain step
])
def test_greedy_verify_accepts_the_agreeing_prefix(draft, target, accepted, token):
    assert greedy_verify(torch.tensor(draft, dtype=torch.long), logits_choosing(target)) == (accepted, token)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def committed_tokens(rule, p, q, trials, seed=0):
    """First and second committed token of `trials` rounds of k = 2 drafted tokens (position i's
    token drawn from q[i], scored against p[i]); the second only where the first was accepted."""
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(p.shape[1]), torch.zeros(p.shape[1])
    for _ in range(trials):
        draft = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(2)])
        accepted, token = rule(draft, q, p, g)
        committed = [*draft[:accepted].tolist(), token]
        first[committed[0]] += 1
        if accepted >= 1:
            second[committed[1]] += 1
    return first, second


def test_speculative_verify_commits_tokens_distributed_as_the_target():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, 6, generator=g) * 1.5, -1)       # [k+1, V]
    q = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)       # [k, V]: a different draft
    first, second = committed_tokens(speculative_verify, p, q, 20000)
    assert chi_square(first, p[0]) < CHI2_DF5_P001
    assert chi_square(second, p[1]) < CHI2_DF5_P001
    assert 0 < (second.sum() / 20000) < 1          # some rounds were rejected, some accepted

    def accept_everything(draft, q, p, g):          # the control: keeps the draft's distribution
        return len(draft), int(torch.multinomial(p[-1], 1, generator=g))

    naive, _ = committed_tokens(accept_everything, p, q, 20000)
    assert chi_square(naive, p[0]) > 10 * CHI2_DF5_P001


def test_speculative_verify_accepts_everything_when_draft_equals_target():
    p = torch.softmax(torch.randn(4, 6), -1)
    draft = torch.tensor([1, 2, 3])
    accepted, _ = speculative_verify(draft, p[:3], p, torch.Generator().manual_seed(0))
    assert accepted == 3


@pytest.mark.parametrize("accepted, token, limit, expected, done", [
    ([5, 6], 7, 10, [1, 5, 6, 7], False),
    ([5, 0, 6], 7, 10, [1, 5, 0], True),            # EOS (0) inside the accepted block: cut there
    ([5, 6, 8], 7, 3, [1, 5, 6], True),             # max_new_tokens inside the block
    ([], 0, 10, [1, 0], True),                       # the target's own token is EOS
])
def test_commit_cuts_at_eos_and_max_new_tokens(accepted, token, limit, expected, done):
    assert commit([1], accepted, token, {0}, limit) == (expected, done)
