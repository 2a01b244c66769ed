"""The report's bounds on hand-computed values and at their edges."""

import pytest

from job.bounds import overlapped_ttft_bound_s, sd_ms_per_token_bound, sd_speedup_eq7


def test_theorem6_on_a_hand_computed_case():
    # γ = 2, Tq = 1, Tp = 3, τ = 0.5: 2·max(2, 3) / ((1 + 0.25) · 0.5 · 0.75 / 0.5) = 6 / 0.9375
    assert sd_ms_per_token_bound(2, 1.0, 3.0, 0.5) == pytest.approx(6.4)


def test_theorem6_at_full_and_no_acceptance():
    # τ = 1: every drafted token accepted, γ tokens a round, (1 + 1) in the denominator
    assert sd_ms_per_token_bound(4, 1.0, 2.0, 1.0) == pytest.approx(2 * 4 / (2 * 4))
    assert sd_ms_per_token_bound(4, 1.0, 2.0, 1 - 1e-12) == pytest.approx(1.0, rel=1e-6)   # continuous there
    assert sd_ms_per_token_bound(4, 1.0, 2.0, 0.0) is None


def test_eq7_and_the_overlap_bound():
    assert sd_speedup_eq7(0.5, 4.0) == 2.0
    assert overlapped_ttft_bound_s(3.0, 5.0, 2.0, 0.5) == 5.5
    assert overlapped_ttft_bound_s(3.0, 1.0, 4.0, 0.0) == 4.0      # CPU-bound: the work spread over the cores
