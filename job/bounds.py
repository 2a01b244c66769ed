"""The analytic bounds benchmark reports set beside measured times, as pure functions a report's
`derived:` expression calls by name (its `formulas: job.bounds` names this module). Each says
where it comes from; the tests check them on hand-computed values.

    bound_ms_per_token: sd_ms_per_token_bound(window, tq_ms, tp_ms, acceptance)
"""

from __future__ import annotations

__all__ = ["sd_ms_per_token_bound", "sd_speedup_eq7", "overlapped_ttft_bound_s"]


def sd_ms_per_token_bound(window: float, tq_ms: float, tp_ms: float, acceptance: float) -> float | None:
    """ParallelVLM's Theorem 6, as the paper writes it: the time per generated token of parallel
    speculative decoding with window γ, draft step Tq, target verification Tp and acceptance τ,

        2 · max(γ · Tq, Tp) / ((1 + τ^γ) · τ · (1 − τ^γ) / (1 − τ)).

    It counts only the accepted draft tokens of a round (not the target's own token), so at low
    acceptance it is no bound: measured times can beat it. τ = 1 is the limit γ; τ = 0 accepts
    nothing, and the expression has no finite value (None)."""
    if acceptance <= 0:
        return None
    tokens_per_round = window if acceptance == 1 else (1 - acceptance ** window) / (1 - acceptance) * acceptance
    return 2 * max(window * tq_ms, tp_ms) / ((1 + acceptance ** window) * tokens_per_round)


def sd_speedup_eq7(acceptance: float, c: float) -> float:
    """ParallelVLM's Theorem 1 (Eq. 7): the speed-up τ̂ · c* of drafting γ = c* = Tp / Tq tokens a
    round, for acceptance τ̂."""
    return acceptance * c


def overlapped_ttft_bound_s(decode_alone_s: float, target_alone_s: float, cpu_s_per_core: float, startup_s: float) -> float:
    """The best time to first token overlapped decoding and prefill can reach: the longer of
    decoding alone and the target's encode + prefill alone (each measured by the sequential run of
    the same video), or of the CPU work spread over every core, whichever is largest, plus the
    start-up before the target's first group (the packet scan and the first group's decode)."""
    return max(decode_alone_s, target_alone_s, cpu_s_per_core) + startup_s
