"""The target's side of speculative decoding, for one request: judge a proposal, commit what the
rule accepts and the target's own next token, roll the cache back to the committed sequence, and
answer with a Verdict. The Verifier stage (stages.verify) and the reference loop
(speculative.reference) both drive this object; it knows nothing of the engine.

One round of `verify(proposal)`:

1. Is it still about the committed sequence? A round drafted ahead (the draft works on round i+1
   while round i is verified) assumed round i was accepted whole; if the target's own token landed
   where the draft continued and equals the draft's, the rest is valid; otherwise it is stale and
   is answered without work.
2. One forward of the committed tokens the cache lacks plus the draft's tokens (a chain), or plus
   the whole tree, each node at the position of its depth seeing only its ancestors.
3. The rule (speculative.rules) on the logits: how many draft tokens, or which tree path, and the
   target's next token.
4. Commit (cut at EOS and the token budget), then drop what the cache holds beyond the committed
   tokens (a tree keeps only its accepted path's entries, moved up behind the committed ones).

Two ways a first token can come without a round: `first_from_prefill()` commits the target's first
token from its prefill's logits at once (the graph primes the proposal edge), and the first round is
then judged against it; with `judge_ahead` and sampling, a round accepted whole commits no token of
the target's own, and the next round's first token is judged by the rule against the target's
distribution kept from this forward (an ordinary draft token from a known q, so still lossless; at
temperature 0 the two rules coincide).
"""

from __future__ import annotations

import torch

from models.sampling import Sampling, greedy, sample
from speculative.protocol import Proposal, Timer, Verdict
from speculative.rounds import Rounds
from speculative.rules import verify_chain, verify_tree
from speculative.tree import check_tree, tree_depths, tree_mask, under_chain


class TargetVerifier:
    """lm: the target (models.adapter.VideoLM); cache, start, layout, logits: its prefill (the cache,
    the prompt's logical length, its layout, the logits [V] of the first new token); vocab: the
    token ids compared (the shared vocabulary); generator: the CPU generator the sampling rule draws
    from."""

    def __init__(self, lm, cache, start: int, layout, logits: torch.Tensor, *, sampling: Sampling,
                 max_new_tokens: int, vocab: int, generator: torch.Generator | None = None,
                 judge_ahead: bool = False):
        self.lm, self.cache, self.start, self.layout = lm, cache, start, layout
        self.sampling, self.vocab, self.generator = sampling, vocab, generator
        self.judge_ahead = judge_ahead and not sampling.greedy
        self.rounds = Rounds(lm.eos_ids, max_new_tokens)
        # [V]: the logits of the first token the cache lacks, read only while no committed token is
        # pending: before the first round, and after a round judged ahead (which sets it anew)
        self.before_pending = logits[:vocab]
        self.first_pending = False             # the first token came from the prefill; the first round is still to judge

    @property
    def done(self) -> bool:
        return self.rounds.done

    def first_from_prefill(self) -> int:
        """Commit the target's first token from its prefill's logits (greedy, or drawn from the warped
        distribution on the host's generator, as the rule's draws are)."""
        if self.rounds.committed or self.rounds.rounds:
            raise ValueError("the verifier's proposal edge is primed more than once: it takes prime: 1 (the "
                             "first token from the prefill) or none")
        logits = self.before_pending
        token = int(greedy(logits)) if self.sampling.greedy else int(
            sample(self.sampling.probs(logits).float().cpu(), self.generator))
        self.rounds.commit([], token)
        self.first_pending = True
        return token

    def verify(self, proposal: Proposal, timer: Timer) -> Verdict | None:
        """Judge one proposal; None once the answer is complete (nothing more to verify)."""
        rounds = self.rounds
        draft, q = proposal.tokens.reshape(-1), proposal.probs
        credit = 0                 # the first round after a first token from the prefill
        if self.first_pending and proposal.base == 0:
            self.first_pending = False
            if proposal.is_tree:
                raise ValueError("a tree proposal after a first token committed from the prefill: leave the "
                                 "verifier's proposal edge unprimed for tree drafts")
            if int(draft[0]) != rounds.committed[0]:      # rejected at its first token: no forward needed
                rounds.end_round(proposal, accepted=0, drafted=int(draft.shape[0]), verify_s=None)
                return Verdict(proposal.round, 0, rounds.committed[0], len(rounds.committed))
            credit = 1             # accounted as the first round always is: it commits the first token
        overlap = self._overlap(proposal)
        if overlap is None:
            rounds.stale_round()
            return Verdict(proposal.round, 0, -1, len(rounds.committed), stale=True)
        if proposal.is_tree:
            return self._verify_tree(proposal, timer)
        return self._verify_chain(proposal, draft[overlap:], None if q is None else q[overlap:], credit, timer)

    def _overlap(self, proposal: Proposal) -> int | None:
        """How many of the proposal's first tokens the target has committed already (its own token
        after a round the draft assumed whole), or None when the proposal is stale."""
        committed, draft = self.rounds.committed, proposal.tokens.reshape(-1)
        overlap = len(committed) - proposal.base
        replaced = (0 < proposal.base <= len(committed) and proposal.after >= 0
                    and committed[proposal.base - 1] != proposal.after)
        if replaced or overlap < 0 or overlap > draft.shape[0] or draft[:overlap].tolist() != committed[proposal.base:]:
            return None
        if proposal.is_tree and overlap:       # a tree is drafted on the committed sequence, never ahead of it
            return None
        return overlap

    def _verify_chain(self, proposal: Proposal, draft: torch.Tensor, q, credit: int, timer: Timer) -> Verdict | None:
        rounds, vocab = self.rounds, self.vocab
        before, k = len(rounds.committed), int(draft.shape[0])
        with timer("verify") as spent:        # the forward and the rule: Tp
            pending = torch.tensor(rounds.pending, dtype=torch.long)
            m = pending.shape[0]
            if m:          # the committed tokens the cache lacks, then the draft, in one forward
                logits = self.lm.score(self.cache, torch.cat([pending, draft]), self.start + rounds.in_cache,
                                       self.layout)[m - 1:, :vocab]                                   # [k+1, V]
            else:          # the logits kept from the forward before predict the draft's first token
                scored = self.lm.score(self.cache, draft, self.start + rounds.in_cache, self.layout)[:, :vocab] if k else None
                logits = self.before_pending[None] if scored is None else torch.cat([self.before_pending[None], scored])
            accepted, token = verify_chain(draft, logits, self.sampling, q if q is None else q[:, :vocab], self.generator)
        ahead = self.judge_ahead and accepted == k > 0
        kept = rounds.commit(draft.tolist() if ahead else draft[:accepted].tolist(), None if ahead else token)
        if ahead and not rounds.done:        # the next round's first token is judged against this row
            token, self.before_pending = -1, logits[-1]
        # the cache holds the committed tokens before this round, then the draft: keep what was committed
        self.lm.drop_last(self.cache, k - kept)
        rounds.cache_holds(before + kept)
        rounds.end_round(proposal, accepted=kept + credit, drafted=k + credit, verify_s=spent.seconds,
                         judged_ahead=ahead and not rounds.done)
        if rounds.done:
            return None
        return Verdict(proposal.round, accepted, token, len(rounds.committed), verify_s=spent.seconds)

    def _verify_tree(self, proposal: Proposal, timer: Timer) -> Verdict | None:
        rounds, vocab = self.rounds, self.vocab
        tokens, parents = proposal.tokens.reshape(-1), proposal.parents.reshape(-1).long()
        check_tree(tokens, parents)
        n, before = int(tokens.shape[0]), len(rounds.committed)
        with timer("verify") as spent:
            pending = torch.tensor(rounds.pending, dtype=torch.long)
            m = pending.shape[0]          # one tree: the pending chain, the candidates under its last token
            tree = under_chain(m, parents)
            logits, states = self.lm.score_tree(self.cache, torch.cat([pending, tokens]), tree_mask(tree),
                                                tree_depths(tree), self.start + rounds.in_cache, self.layout,
                                                hidden=True)
            if m:
                logits = logits[m - 1:, :vocab]                                                       # [n+1, V]
            else:
                logits = torch.cat([self.before_pending[None], logits[:, :vocab]])
            q = proposal.probs[:, :vocab] if proposal.probs is not None else None
            path, token = verify_tree(tokens, parents, logits, self.sampling, q, self.generator)
        kept = rounds.commit(tokens[path].tolist(), token)
        # the cache holds the committed tokens, then the n nodes: keep the accepted path's
        self.lm.keep_path(self.cache, n, path[:kept])
        rounds.cache_holds(before + kept)
        features = None
        if proposal.wants_features:     # the states of what this forward cached and kept: pending, then the path
            features = torch.cat([states[:m], states[m:][torch.tensor(path[:kept], dtype=torch.long)]]).detach()
        depth = int(tree_depths(parents).max()) + 1
        rounds.end_round(proposal, accepted=kept, drafted=depth, verify_s=spent.seconds)
        if rounds.done:
            return None
        return Verdict(proposal.round, len(path), token, len(rounds.committed), verify_s=spent.seconds,
                       path=tuple(path), features=features)
