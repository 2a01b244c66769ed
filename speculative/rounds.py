"""One request's decoding on the target's side: the committed tokens, how many of them the target's
cache holds, and the record of every round, for chains and trees alike. A round ends in one place,
`Rounds.end_round`, and `Rounds.stats()` is what metrics.json reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from speculative.protocol import Proposal, RoundKind
from speculative.rules import commit


@dataclass(frozen=True)
class SpeculativeStats:
    """What a speculative run did, round by round; `metrics()` gives its figures for metrics.json.

    M (mean_accepted_length): tokens committed per verification round, the accepted draft tokens
    and the target's own; tokens_per_rollback: the paper's (ParallelVLM's) M, tokens committed
    between rollbacks: the rounds from one rejection (a round that commits fewer draft tokens than
    it drafted) to the next, or to the end, each give one run of tokens, and this is their mean
    length; acceptance: accepted over drafted tokens; Tp: the target's verification of a round; Tq:
    the draft's forward for one drafted token (both timed by the engine); pre_verify_rounds: rounds
    of one token drafted right after a rollback (ParallelVLM's pre-verify). For a tree proposal a
    round's `drafted` is the tree's depth (the most it could accept), so per_position_acceptance
    is the acceptance by depth, and `tree_nodes` its size."""

    committed: int                  # tokens committed in all
    accepted: tuple = ()            # per round: draft tokens accepted
    drafted: tuple = ()             # per round: draft tokens verified
    windows: tuple = ()             # per round: the γ the draft used (a tree: its depth)
    verify_s: tuple = ()            # per round with a forward: Tp
    tq_s: float | None = None       # the draft's mean time per drafted token
    stale_proposals: int = 0        # rounds drafted ahead on a prefix the target did not commit
    pre_verify_rounds: int = 0      # one-token rounds right after a rollback (pre-verify)
    tree_nodes: tuple = ()          # per round of a tree proposal: its nodes

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def per_position_acceptance(self) -> list[float]:
        """Share of the rounds that drafted a token at position i whose draft was accepted up to i."""
        k_max = max(self.drafted, default=0)
        return [round(sum(a > i for a in self.accepted) / max(1, sum(d > i for d in self.drafted)), 4)
                for i in range(k_max)]

    def runs_between_rollbacks(self) -> int:
        """Rounds with a rejection, plus a last run that ended without one (EOS, the token budget)."""
        rejections = [a < d for a, d in zip(self.accepted, self.drafted)]
        return sum(rejections) + (1 if rejections and not rejections[-1] else 0)

    def metrics(self) -> dict:
        rounds = self.rounds
        runs = self.runs_between_rollbacks()
        return {"rounds": rounds, "stale_proposals": self.stale_proposals,
                "pre_verify_rounds": self.pre_verify_rounds,
                "mean_accepted_length": round(self.committed / rounds, 4) if rounds else None,
                "tokens_per_rollback": round(self.committed / runs, 4) if runs else None,
                "acceptance_rate": round(sum(self.accepted) / max(1, sum(self.drafted)), 4),
                "per_position_acceptance": self.per_position_acceptance(),
                "window_mean": round(sum(self.windows) / len(self.windows), 3) if self.windows else None,
                "window_last": self.windows[-1] if self.windows else None,
                "tp_ms": round(1000 * sum(self.verify_s) / len(self.verify_s), 3) if self.verify_s else None,
                "tq_ms": round(1000 * self.tq_s, 3) if self.tq_s else None,
                **({"tree_nodes_mean": round(sum(self.tree_nodes) / len(self.tree_nodes), 2)} if self.tree_nodes else {})}


class Rounds:
    """The committed sequence and the round records of one request (see the module docstring)."""

    def __init__(self, eos_ids, max_new_tokens: int):
        self.eos_ids, self.max_new_tokens = tuple(eos_ids), max_new_tokens
        self.committed: list[int] = []
        self.in_cache = 0                 # committed tokens whose entries the target's cache holds
        self.done = False
        self.accepted: list[int] = []     # per round
        self.drafted: list[int] = []
        self.windows: list[int] = []
        self.tree_nodes: list[int] = []   # per tree round
        self.verify_s: list[float] = []   # per round with a forward
        self.tq_s: float | None = None
        self.stale = 0
        self.pre_verify = 0
        self.judged_ahead = 0             # rounds accepted whole that left their next token to the draft

    @property
    def pending(self) -> list[int]:
        """Committed tokens the cache does not hold yet (the target's own last token, usually)."""
        return self.committed[self.in_cache:]

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def commit(self, accepted: list[int], next_token: int | None) -> int:
        """Appends the accepted draft tokens and the target's next token (None: none), cut at EOS or
        at the token budget. Returns how many of the accepted draft tokens were kept."""
        before = len(self.committed)
        self.committed, self.done = commit(self.committed, accepted, next_token, self.eos_ids, self.max_new_tokens)
        return min(len(accepted), len(self.committed) - before)

    def cache_holds(self, n: int) -> None:
        """The target's cache now holds the first `n` committed tokens (after a round's rollback)."""
        self.in_cache = n

    def stale_round(self) -> None:
        """A proposal drafted on a prefix the target has since rejected: answered without work."""
        self.stale += 1

    def end_round(self, proposal: Proposal, *, accepted: int, drafted: int, verify_s: float | None,
                  judged_ahead: bool = False) -> None:
        """Record a verified round: `accepted` of `drafted` draft tokens (a tree: of its depth);
        verify_s None for a round answered without a forward; judged_ahead: it was accepted whole
        and left its next token to the next round's rule."""
        self.judged_ahead += judged_ahead
        self.accepted.append(accepted)
        self.drafted.append(drafted)
        if proposal.is_tree:
            self.windows.append(drafted)
            self.tree_nodes.append(int(proposal.tokens.numel()))
        else:
            self.windows.append(proposal.window or drafted)
        if verify_s is not None:
            self.verify_s.append(verify_s)
        if proposal.draft_s is not None:
            self.tq_s = proposal.draft_s
        self.pre_verify += proposal.kind == RoundKind.PRE_VERIFY

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(len(self.committed), tuple(self.accepted), tuple(self.drafted), tuple(self.windows),
                                tuple(self.verify_s), self.tq_s, self.stale, self.pre_verify, tuple(self.tree_nodes))
