"""A small model as the draft: from its own cache after its own prefill (the whole video for
vanilla speculative decoding, the pruned video for ParallelVLM), each round drafts `window` tokens
after what it believes is committed. The ModelDraft stage (stages.draft) and the reference loop
(speculative.reference) both drive this object.

Rounds in flight: with the verdict edge primed twice the draft works on round i+1 while the target
verifies round i, assuming round i is accepted whole; a verdict that rejects part of it makes the
round in flight stale (the target answers it without work) and the draft restarts from the
committed tokens, rolling its cache back to the longest prefix it shares with them.

Pre-verify (ParallelVLM App. B, Alg. 1; `pre_verify`): the first round, and every round drafted
right after a rollback, is one token, so the target verifies it at once instead of idling while
the draft restarts a whole window; the draft meanwhile drafts a full window on top of it.
`pre_verify="auto"` keeps only the pre-verify rounds that pay (`pre_verify_pays`): one is free
when the draft's window takes as long as the target's one-token verification (γ = c*, the paper's
setting), and a loss when the draft is much faster than the target, where a one-token round costs
the target nearly a whole round's time for about one token.

`window="auto"` sets γ the way ParallelVLM's Eq. 6 does, γ = c* = Tp / Tq: the draft times its own
forwards (Tq, per drafted token, on its pruned cache), reads the target's verification time (Tp)
off each verdict, and drafts the next round with γ = round(mean Tp / mean Tq), clamped to
1..max_window. The paper fixes γ once from measured times; measuring online is the same rule
without a calibration run, and it follows the times as the caches grow. Until the first verdict it
drafts `start_window` tokens.

`confidence`: a round ends early, after a token the draft gives less than this probability (the
softmax of its logits when greedy, q when sampling). A draft agrees with the target on easy tokens
and misses the content ones; a token it doubts is the likely rejection, and drafting past it is
mostly wasted.

`chain` (models.draft_chain.DraftChain, greedy only): a round of the chain's length drafted in one
compiled call instead of a forward a token; the pre-verify round, the first round (whose first
token comes from the prefill) and a short last round still go token by token. `confidence` then
cuts the round after its first doubtful token and drops the rest from the cache.
"""

from __future__ import annotations

import torch

from models.sampling import Sampling
from speculative.protocol import DraftInfo, Proposal, RoundKind, Timer, Verdict


def auto_window(tp_s: float, tq_s: float, max_window: int) -> int:
    """ParallelVLM's Eq. 6: γ = c* = Tp / Tq, rounded, within 1..max_window. At that γ, drafting a
    round takes as long as verifying one, so neither side of the overlapped pipeline waits."""
    if tq_s <= 0:
        return max_window
    return max(1, min(max_window, round(tp_s / tq_s)))


def pre_verify_pays(tq_s: float, window: int, tp1_s: float, target_s_per_token: float) -> bool:
    """Whether a one-token round after a rollback is worth the target's time. After a rollback the
    target waits for the draft either way: for a window (window · tq_s) without pre-verify; with
    it, for the one token (tq_s), then it verifies that token (tp1_s) while the draft drafts the
    window on top of it. So pre-verify delays the window's verification by tq_s plus whatever of
    tp1_s the window's drafting does not cover, and it commits about one token sooner. It pays
    when that delay is less than what a committed token costs the target so far
    (target_s_per_token: its verification time over the committed tokens)."""
    delay = tq_s + max(0.0, tp1_s - window * tq_s)
    return delay < target_s_per_token


def own_probability(logits: torch.Tensor, token: int, q: torch.Tensor | None) -> float:
    """The draft's probability of the token it drafted: q[token] when sampling (q: the warped
    distribution it was drawn from), else the softmax of the logits [V] at it."""
    if q is not None:
        return float(q[token])
    return float(torch.softmax(logits.float(), -1)[token])


class ModelDrafter:
    """lm: the draft model; cache, start, layout, logits: its prefill; window: γ or "auto";
    vocab: the shared vocabulary; info: what the first proposal tells the target."""

    def __init__(self, lm, cache, start: int, layout, logits: torch.Tensor, *, window: int | str, sampling: Sampling,
                 vocab: int, max_new_tokens: int, generator: torch.Generator | None = None, start_window: int = 4,
                 max_window: int = 16, pre_verify: bool | str = False, confidence: float = 0.0,
                 info: DraftInfo | None = None, chain=None):
        if chain is not None and (window == "auto" or not sampling.greedy or chain.vocab != vocab):
            raise ValueError("a draft chain drafts a fixed window greedily over the shared vocabulary")
        self.lm, self.cache, self.start, self.layout, self.logits = lm, cache, start, layout, logits
        self.chain = chain
        self.auto = window == "auto"
        self.window = start_window if self.auto else window
        self.max_window, self.sampling, self.vocab, self.generator = max_window, sampling, vocab, generator
        if pre_verify not in (True, False, "auto"):
            raise ValueError(f"pre_verify must be true, false or 'auto', got {pre_verify!r}")
        self.max_new_tokens, self.pre_verify, self.confidence, self.info = max_new_tokens, pre_verify, confidence, info
        self.sequence: list[int] = []      # committed tokens, then the rounds in flight
        self.in_cache = 0                  # how many of `sequence` the draft's cache holds
        self.round = 0
        self.restarted = True              # the next round starts after a rollback (or is the first)
        self.pre_rounds: set[int] = set()  # the rounds drafted in pre-verify mode
        self.tp = [0.0, 0]                 # the target's verification time: sum, count
        self.tq = [0.0, 0]                 # the draft's time per drafted token: sum, count
        self.tp1 = [0.0, 0]                # the target's verification of a pre-verify round: sum, count
        self.target_s = 0.0                # the target's verification time over all verdicts
        self.committed = 0                 # the committed length, as the last verdict said

    def propose(self, verdict: Verdict | None, timer: Timer) -> Proposal | None:
        """The next round after `verdict` (None: a round before any verdict); None when every token
        the budget allows is in flight already."""
        if verdict is not None and not verdict.stale:
            self._apply(verdict)
            self.target_s, self.committed = self.target_s + verdict.verify_s, verdict.length
            if verdict.round in self.pre_rounds and verdict.verify_s > 0:
                self.tp1 = [self.tp1[0] + verdict.verify_s, self.tp1[1] + 1]
            # γ follows the verification of a whole window: a pre-verify round's one token is not one
            if self.auto and verdict.verify_s > 0 and self.tq[1] and verdict.round not in self.pre_rounds:
                self.tp = [self.tp[0] + verdict.verify_s, self.tp[1] + 1]
                self.window = auto_window(self.tp[0] / self.tp[1], self.tq[0] / self.tq[1], self.max_window)
        if len(self.sequence) >= self.max_new_tokens:
            return None
        base = len(self.sequence)
        after = self.sequence[-1] if self.sequence else -1
        pre = self.restarted and self._pre_verify_now()
        self.restarted = False
        tokens, probs = self._draft(1 if pre else self.window, timer)
        self.sequence += tokens
        self.round += 1
        if pre:
            self.pre_rounds.add(self.round)
        # the γ in force: a pre-verify round drafts one token whatever γ is (the target records
        # the tokens it verified apart), so window_mean stays the γ of the paper's bounds; with
        # `confidence` a round's own length is its γ
        window = len(tokens) if self.confidence and not pre else self.window
        return Proposal(self.round, base, torch.tensor(tokens), after=after,
                        probs=torch.stack(probs) if probs else None,
                        kind=RoundKind.PRE_VERIFY if pre else RoundKind.WINDOW, window=window,
                        draft_s=self.tq[0] / self.tq[1] if self.tq[1] else None,
                        info=self.info if self.round == 1 else None)

    def _pre_verify_now(self) -> bool:
        """pre_verify as set; "auto": until the times it needs are measured (the first round is a
        pre-verify round, so they soon are), yes; then pre_verify_pays on them."""
        if self.pre_verify != "auto":
            return self.pre_verify
        if not (self.tq[1] and self.tp1[1] and self.committed and self.target_s > 0):
            return True
        return pre_verify_pays(self.tq[0] / self.tq[1], self.window, self.tp1[0] / self.tp1[1],
                               self.target_s / self.committed)

    def _apply(self, verdict: Verdict) -> None:
        """The target verified our tokens from `start` on: it committed the first `accepted` of them,
        then its own token. What was drafted on exactly that stays; otherwise the tokens in flight
        are void and the cache goes back to the agreed prefix."""
        own = [verdict.token] if verdict.token >= 0 else []     # none: our next token is judged as a draft
        start = verdict.length - verdict.accepted - len(own)
        agreed = self.sequence[:start + verdict.accepted] + own
        if self.sequence[:len(agreed)] == agreed:
            return
        self.sequence = agreed
        self.restarted = True
        keep = min(self.in_cache, start + verdict.accepted)
        self.lm.drop_last(self.cache, self.in_cache - keep)
        self.in_cache = keep

    def _draft(self, k: int, timer: Timer) -> tuple[list[int], list[torch.Tensor]]:
        """Up to `min(k, budget)` tokens after `sequence`: one forward each, or one chain call for a
        round of the chain's length after at least one pending token."""
        k = min(k, self.max_new_tokens - len(self.sequence))
        pending = torch.tensor(self.sequence[self.in_cache:], dtype=torch.long)
        if self.chain is not None and k == self.chain.steps and pending.shape[0]:
            return self._draft_chained(pending, timer), []
        tokens, probs = [], []
        for _ in range(k):
            with timer("draft_token") as step:
                if pending.shape[0]:
                    logits = self.lm.score(self.cache, pending, self.start + self.in_cache, self.layout)[-1, :self.vocab]
                    self.in_cache += pending.shape[0]
                else:                     # nothing after the prompt yet: the prefill's logits
                    logits = self.logits[:self.vocab]
                token, q = self.sampling.pick(logits, self.generator)
            if pending.shape[0] == 1:     # one drafted token's forward, as the engine timed it: Tq
                self.tq = [self.tq[0] + step.seconds, self.tq[1] + 1]
            if q is not None:
                probs.append(q)
            tokens.append(token)
            if self.confidence and own_probability(logits, token, q) < self.confidence:
                break
            pending = torch.tensor([token])
        return tokens, probs

    def _draft_chained(self, pending: torch.Tensor, timer: Timer) -> list[int]:
        """A greedy round of `chain.steps` tokens after `pending` [P], in one compiled call."""
        k, fed = self.chain.steps, pending.shape[0] + self.chain.steps - 1
        with timer("draft_chain") as spent:
            positions = self.layout.decode_positions(self.start + self.in_cache, fed)[0]
            drafted, logits = self.chain.run(self.cache, pending, positions)
            tokens = drafted.tolist()
        self.in_cache += fed
        self.tq = [self.tq[0] + spent.seconds, self.tq[1] + k]
        if self.confidence:
            doubtful = torch.softmax(logits, -1).gather(1, drafted[:, None])[:, 0] < self.confidence    # [k]
            if bool(doubtful.any()):
                cut = int(doubtful.nonzero()[0]) + 1         # keep the doubtful token, draft nothing past it
                self.lm.drop_last(self.cache, k - cut)
                self.in_cache -= k - cut
                tokens = tokens[:cut]
        return tokens
