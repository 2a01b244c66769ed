"""verify: the target checks a draft's proposal in one forward and commits what it accepts.

The acceptance rules are pure functions:

    greedy_verify(draft [k], target_logits [k+1, V])            temperature 0: accept while the
        -> (accepted, next_token)                                target's argmax agrees
    speculative_verify(draft [k], q [k, V], p [k+1, V], rng)    temperature > 0 (Leviathan et al.
        -> (accepted, next_token)                                2023, Chen et al. 2023): accept d_i
                                                                 with prob min(1, p_i(d)/q_i(d));
                                                                 on rejection draw from
                                                                 max(0, p_i − q_i), renormalised;
                                                                 all accepted: draw from p_k

p and q are the *warped* distributions (models.sampling.warp with the same temperature, top-k and
top-p on both, over the shared vocabulary: docs/design.md, pitfall 5), so the committed tokens follow the
target's own sampling distribution exactly, and with temperature 0 they are the target's greedy
tokens: the output is the target's `generate()`'s.

`Verifier` is the stage: it holds the target's cache after the prompt, scores the last committed
token plus the k proposed ones in one forward (the first round: the prefill's logits judge the
first proposed token, and the k proposed ones are scored; with the proposal edge primed, the
first token is committed from the prefill before any round and the first round's first token
must equal it), commits the accepted tokens and the target's own
next token (bonus or correction), rolls its cache back to the committed sequence, and answers
with a Verdict on the feedback edge. A proposal drafted on a prefix that a verdict has since
rejected (the draft runs a round ahead, PEARL-style) is stale: it is answered without work.
EOS and max_new_tokens inside an accepted block cut the block there (docs/design.md, pitfall 6).

A proposal with `parents` is a tree of candidates (stages.tree): the committed tokens not yet
cached and the whole tree go through one forward (VideoLM.score_tree: each node at the position of
its depth, seeing only its ancestors), the tree rules pick one root-to-node path, and only that
path's cache entries are kept, moved up behind the committed ones (VideoLM.keep_path). A chain
given as a tree is verified exactly as the chain.
"""

from __future__ import annotations


import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sampling import Sampling, greedy, sample
from models.lean import tree_depths
from stages.tree import check_tree, tree_greedy_verify, tree_sample_verify
from stages.types import KV, Proposal, SpeculativeStats, Tokens, Verdict


# ------------------------------------------------------------------------------ the rules

def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft int64 [k]; target_logits [k+1, V] (row i predicts the token after draft[:i]).
    Returns (accepted ∈ 0..k, the target's token after the accepted prefix)."""
    choice = target_logits.argmax(-1).to(draft.device)                   # [k+1], beside the draft's tokens
    agree = (choice[:-1] == draft).long()
    accepted = int(agree.cumprod(0).sum())
    return accepted, int(choice[accepted])


def speculative_verify(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """draft int64 [k]; q [k, V] the draft's distributions it drew draft[i] from; p [k+1, V] the
    target's (both warped alike). Returns (accepted, next token) with next ~ the residual
    max(0, p_i − q_i) at the first rejection, else ~ p_k."""
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


def commit(committed: list[int], accepted: list[int], next_token: int | None, eos_ids,
           max_new_tokens: int) -> tuple[list[int], bool]:
    """Appends the accepted tokens and the target's next one (None: none), cut at the first EOS
    or at max_new_tokens. Returns (the new committed list, done)."""
    out = list(committed)
    for token in [*accepted, *([] if next_token is None else [next_token])]:
        out.append(token)
        if token in eos_ids or len(out) >= max_new_tokens:
            return out, True
    return out, False


# ------------------------------------------------------------------------------ the stage

class Verifier(Stage):
    """The target's side of speculative decoding.

    model: the target entry; max_new_tokens; temperature (0: greedy), top_k, top_p, seed: the
    sampling both sides share; vocab: the shared vocabulary size (0: the tokenizer's);
    judge_ahead: with temperature > 0, a round accepted whole commits no token of the target's
    own: the first token of the next round, which a draft running ahead drafted on exactly that
    assumption, is judged by the acceptance rule against the target's distribution at that
    position (kept from this forward) instead of having to equal a token the target sampled.
    Lossless: it is an ordinary draft token drawn from a known q. At temperature 0 the two are the
    same rule (the draft's token must be the target's argmax), so nothing changes."""

    placement = "gpu"
    inputs = {"kv": In(KV), "proposal": In(Proposal, stream=True)}
    outputs = {"verdict": Out(Verdict, stream=True), "first": Out(Tokens, tap=True), "tokens": Out(Tokens)}

    def __init__(self, model: dict, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, vocab: int = 0, judge_ahead: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        self.model, self.max_new_tokens = dict(model), max_new_tokens
        self.judge_ahead = bool(judge_ahead)
        self.sampling, self.seed, self.vocab = Sampling(temperature, top_k, top_p), seed, vocab
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        self._reset()

    def _reset(self) -> None:
        self.committed: list[int] = []
        self.in_cache = 0            # committed tokens whose entries the cache holds
        self.done, self.rounds, self.stale = False, 0, 0
        self.accepted: list[int] = []          # per round
        self.drafted: list[int] = []           # per round
        self.rng = torch.Generator().manual_seed(self.seed + 1)
        self.info: dict = {}
        self.verify_s: list[float] = []        # per round: the forward and the rule (Tp)
        self.windows: list[int] = []           # per round: the γ the draft used
        self.tq_s: float | None = None         # the draft's own measure of one drafted token (Tq)
        self.pre_verify = 0                    # rounds the draft marked as pre-verify
        self.ahead: torch.Tensor | None = None  # judge_ahead: the logits [V] after a round accepted whole
        self.judged_ahead = 0                  # rounds accepted whole that left their next token to the draft
        self.tree_nodes: list[int] = []        # per tree round: its size
        self.first_pending = False             # the first token came from the prefill; the first round is still to judge

    def start_run(self, ctx) -> None:
        self._reset()

    def __call__(self, ctx, kv: KV, proposal: Proposal | None):
        if proposal is None:          # a primed call: the prefill is done, no round has arrived yet
            if self.committed or self.rounds:
                raise ValueError("the verifier's proposal edge is primed more than once: it takes prime: 1 (the "
                                 "first token from the prefill) or none")
            return self._first_from_prefill(ctx, kv)
        if not self.info:             # the run's first proposal: what draft and target worked from
            self.info = {**proposal.meta, "target_prefill": kv.prefill,
                         "n_video_tokens": kv.n_video_tokens}
        if self.done:
            return {}                 # a proposal drafted ahead of the end: nothing left to check
        draft, q = proposal.tokens.reshape(-1), proposal.probs
        # A round drafted ahead starts where the draft assumed the last round would end; when the
        # target's own token landed there and equals the draft's, the rest of the round is valid.
        # A round drafted on a token the target has since replaced (the last of a window rejected)
        # is stale too: its tokens continue another sequence.
        overlap = len(self.committed) - proposal.base
        replaced = (0 < proposal.base <= len(self.committed) and proposal.after >= 0
                    and self.committed[proposal.base - 1] != proposal.after)
        # the first round after a first token committed from the prefill: its first token is
        # judged against that one, and the round is accounted as the first round always is (it
        # commits the target's first token, so M and acceptance mean what they mean unprimed)
        judged_first = self.first_pending and proposal.base == 0
        if judged_first:
            self.first_pending = False
            if proposal.parents is not None:
                raise ValueError("a tree proposal after a first token committed from the prefill: leave the "
                                 "verifier's proposal edge unprimed for tree drafts")
            if int(draft[0]) != self.committed[0]:     # rejected at its first token: no forward needed
                self._record(proposal, accepted=0, drafted=int(draft.shape[0]))
                ctx.emit("verdict", Verdict(proposal.round, 0, self.committed[0], len(self.committed)))
                return {}
        if (replaced or overlap < 0 or overlap > draft.shape[0]
                or draft[:overlap].tolist() != self.committed[proposal.base:]):
            self.stale += 1
            ctx.emit("verdict", Verdict(proposal.round, 0, -1, len(self.committed), stale=True))
            return {}
        if proposal.parents is not None:
            if overlap:            # a tree is drafted on the committed sequence, never ahead of it
                self.stale += 1
                ctx.emit("verdict", Verdict(proposal.round, 0, -1, len(self.committed), stale=True))
                return {}
            return self._verify_tree(ctx, kv, proposal)
        draft, q = draft[overlap:], (q[overlap:] if q is not None else None)
        lm, layout = self.lm, kv.layout
        vocab = self.vocab or len(lm.tokenizer)
        with ctx.timer("verify") as verify:    # the forward and the rule: Tp
            pending = torch.tensor(self.committed[self.in_cache:], dtype=torch.long)
            if pending.shape[0]:          # the last committed token(s) and the draft, in one forward
                logits = lm.score(kv.cache, torch.cat([pending, draft]), kv.logical_length + self.in_cache, layout)
                logits = logits[pending.shape[0] - 1:]                         # [k+1, V]: after each draft prefix
            else:     # the first round, or after a round accepted whole (judge_ahead): the logits
                # kept from the forward before (the prefill's, or that round's last) predict its first token
                before_draft = kv.logits if self.ahead is None else self.ahead
                scored = (lm.score(kv.cache, draft, kv.logical_length + self.in_cache, layout)
                          if draft.shape[0] else None)
                logits = (before_draft[None, :vocab] if scored is None
                          else torch.cat([before_draft[None, :vocab], scored[:, :vocab]]))
            self.ahead = None
            logits = logits[:, :vocab]
            if self.sampling.greedy:
                accepted, token = greedy_verify(draft, logits)
            else:
                # the rule runs on the host, so its draws come from the CPU generator on any device
                accepted, token = speculative_verify(draft, q[:, :vocab].float().cpu(),
                                                     self.sampling.probs(logits).float().cpu(), self.rng)
        spent = verify.seconds
        self.verify_s.append(spent)
        before = len(self.committed)
        if self.judge_ahead and not self.sampling.greedy and accepted == draft.shape[0] > 0:
            self.committed, self.done = commit(self.committed, draft.tolist(), None, lm.eos_ids, self.max_new_tokens)
            if not self.done:     # (done: EOS or the budget came first, no token after it is needed)
                token, self.ahead = -1, logits[-1]   # the next round's first token is judged against this row
                self.judged_ahead += 1
        else:
            self.committed, self.done = commit(self.committed, draft[:accepted].tolist(), token, lm.eos_ids,
                                               self.max_new_tokens)
        # the cache now holds committed[:in_cache] + pending + draft: keep what was committed
        cached = self.in_cache + pending.shape[0] + draft.shape[0]
        keep = min(before + accepted, len(self.committed))
        lm.drop_last(kv.cache, cached - keep)
        self.in_cache = keep
        credit = int(judged_first)          # its first token, accepted before this forward
        self._record(proposal, accepted=min(accepted, len(self.committed) - before) + credit,
                     drafted=int(draft.shape[0]) + credit)
        if before == 0:
            ctx.emit("first", Tokens(self.committed[:1]))
        if self.done:
            ctx.end("verdict")
            return {}
        ctx.emit("verdict", Verdict(proposal.round, accepted, token, len(self.committed), verify_s=spent))
        return {}

    def _record(self, proposal: Proposal, *, accepted: int, drafted: int) -> None:
        """One verified chain round in the run's statistics."""
        self.rounds += 1
        self.accepted.append(accepted)
        self.drafted.append(drafted)
        self.windows.append(proposal.meta.get("window", drafted))
        if "tq_s" in proposal.meta:
            self.tq_s = proposal.meta["tq_s"]
        self.pre_verify += proposal.meta.get("mode") == "pre"

    def _first_from_prefill(self, ctx, kv: KV):
        """The target's first token from its prefill's logits (greedy, or drawn from the warped
        distribution), committed and published at once: the first token does not wait for the
        draft's first round (the graph primes the proposal edge). That round is then judged
        against it: a first token equal to it and the rest verified as usual, or else answered
        with it. At temperature 0 this is the token the first round's rule would have committed;
        above, the first token is drawn from the target's own distribution, so the output's
        distribution is the target's either way."""
        lm = self.lm
        vocab = self.vocab or len(lm.tokenizer)
        logits = kv.logits[:vocab]
        if self.sampling.greedy:
            token = int(greedy(logits))
        else:     # on the host, from the CPU generator, as the acceptance rule's draws
            token = int(sample(self.sampling.probs(logits).float().cpu(), self.rng))
        self.committed, self.done = commit([], [], token, lm.eos_ids, self.max_new_tokens)
        self.first_pending = True
        ctx.emit("first", Tokens(self.committed[:1]))
        if self.done:
            ctx.end("verdict")
        return {}

    def _verify_tree(self, ctx, kv: KV, proposal: Proposal):
        """A tree of candidates (proposal.parents, stages.tree) in one forward: the committed tokens
        not yet cached as a chain, then the tree under the last of them; one root-to-node path is
        accepted, its entries moved up behind the committed ones, the other nodes' dropped."""
        tokens, parents = proposal.tokens.reshape(-1), proposal.parents.reshape(-1).long()
        check_tree(tokens, parents)
        lm, layout, n = self.lm, kv.layout, tokens.shape[0]
        vocab = self.vocab or len(lm.tokenizer)
        before = len(self.committed)
        want_features = bool(proposal.meta.get("features"))
        with ctx.timer("verify") as verify:
            pending = torch.tensor(self.committed[self.in_cache:], dtype=torch.long)
            m = pending.shape[0]
            start = kv.logical_length + self.in_cache
            if m:      # one tree: the pending chain, the candidates under its last token
                ids = torch.cat([pending, tokens])
                tree = torch.cat([torch.arange(m) - 1, torch.where(parents < 0, m - 1, parents + m)])
            else:
                ids, tree = tokens, parents
            logits, states = lm.score_tree(kv.cache, ids, tree, start, layout, hidden=True)
            if m:
                logits = logits[m - 1:, :vocab]                                      # [n+1, V]
            else:
                root = kv.logits if self.ahead is None else self.ahead
                logits = torch.cat([root[None, :vocab], logits[:, :vocab]])
            self.ahead = None
            if self.sampling.greedy:
                path, token = tree_greedy_verify(tokens, parents, logits)
            else:
                q = proposal.probs[:, :vocab].float().cpu() if proposal.probs is not None else None
                path, token = tree_sample_verify(tokens, parents, self.sampling.probs(logits).float().cpu(),
                                                 self.rng, q)
        spent = verify.seconds
        self.verify_s.append(spent)
        depth = int(tree_depths(parents).max()) + 1
        self.windows.append(depth)
        self.tree_nodes.append(int(n))
        if "tq_s" in proposal.meta:
            self.tq_s = proposal.meta["tq_s"]
        self.committed, self.done = commit(self.committed, tokens[path].tolist(), token, lm.eos_ids,
                                           self.max_new_tokens)
        keep = min(before + len(path), len(self.committed))
        # the cache holds committed[:before] then the n nodes: keep the path's (up to `keep`)
        kept = path[:keep - before]
        lm.keep_path(kv.cache, n, kept)
        features = None
        if want_features:     # the states of what this forward cached and kept: pending, then the path
            features = torch.cat([states[:m], states[m:][torch.tensor(kept, dtype=torch.long)]]).detach()
        self.in_cache = keep
        self.rounds += 1
        self.accepted.append(keep - before)
        self.drafted.append(depth)
        if before == 0:
            ctx.emit("first", Tokens(self.committed[:1]))
        if self.done:
            ctx.end("verdict")
            return {}
        ctx.emit("verdict", Verdict(proposal.round, len(path), token, len(self.committed), verify_s=spent,
                                    path=tuple(path), features=features))
        return {}

    def finish(self, ctx):
        lm = self.lm
        ids = self.committed
        stats = SpeculativeStats(len(ids), tuple(self.accepted), tuple(self.drafted), tuple(self.windows),
                                 tuple(self.verify_s), self.tq_s, self.stale, self.pre_verify, tuple(self.tree_nodes))
        meta = {"model": lm.name, **self.info,
                "stopped": "eos" if ids and ids[-1] in lm.eos_ids else "max_new_tokens"}
        if self.judge_ahead:
            meta["judged_ahead"] = self.judged_ahead
        out = Tokens(list(ids), lm.tokenizer.decode(ids, skip_special_tokens=True), meta, stats)
        self._reset()
        return {"tokens": out}

