"""verify: the target checks a draft's proposals and commits what it accepts.

The stage is the engine's side of speculative.verifier.TargetVerifier (the rules, the forward,
the commit and the rollback live there): it builds one per run from the target's prefill, feeds it
the proposals as they stream in, and publishes what it decides. The first committed token goes out
at once on `first` (the time to the first token); each verdict goes back to the draft on the
feedback edge; the stream of verdicts ends when the answer is complete, which ends the loop.

With the proposal edge primed (`prime: 1`), the first call comes with the prefill alone and
commits the target's own first token from the prefill's logits before any round.
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sampling import Sampling
from speculative.protocol import Proposal
from speculative.rounds import Rounds
from speculative.verifier import TargetVerifier
from stages.types import PrefillResult, Tokens, Verdict


class Verifier(Stage):
    """The target's side of speculative decoding.

    model: the target entry; max_new_tokens; temperature (0: greedy), top_k, top_p, seed: the
    sampling both sides share; vocab: the compared vocabulary (0: the target's); judge_ahead: with
    temperature > 0, a round accepted whole commits no token of the target's own and the next
    round's first token is judged by the rule instead (speculative.verifier)."""

    placement = "gpu"
    inputs = {"kv": In(PrefillResult), "proposal": In(Proposal, stream=True)}
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
        self.start_run(ctx)

    def start_run(self, ctx) -> None:
        self.target: TargetVerifier | None = None
        self.info: dict = {}

    def verifier_for(self, kv: PrefillResult) -> TargetVerifier:
        """This stage's settings over a target prefill: what one run (request) verifies with."""
        return TargetVerifier(self.lm, kv.cache, kv.logical_length, kv.layout, kv.logits, sampling=self.sampling,
                              max_new_tokens=self.max_new_tokens, vocab=self.vocab or self.lm.vocabulary,
                              judge_ahead=self.judge_ahead, generator=torch.Generator().manual_seed(self.seed + 1))

    def __call__(self, ctx, kv: PrefillResult, proposal: Proposal | None):
        if self.target is None:
            self.target = self.verifier_for(kv)
        target = self.target
        committed_before = len(target.rounds.committed)
        if proposal is None:          # a primed call: the prefill is done, no round has arrived yet
            target.first_from_prefill()
            verdict = None
        else:
            if proposal.info is not None:     # what draft and target worked from, for the run's metrics
                self.info = {**proposal.info.metrics(), "target_prefill": kv.prefill,
                             "n_video_tokens": kv.n_video_tokens}
            if target.done:
                return {}             # a proposal drafted ahead of the end: nothing left to check
            verdict = target.verify(proposal, ctx.timer)
        if committed_before == 0 and target.rounds.committed:
            ctx.emit("first", Tokens(target.rounds.committed[:1]))
        if target.done:
            ctx.end("verdict")
        elif verdict is not None:
            ctx.emit("verdict", verdict)
        return {}

    def finish(self, ctx):
        lm = self.lm
        rounds = self.target.rounds if self.target is not None else Rounds(lm.eos_ids, self.max_new_tokens)
        ids = rounds.committed
        meta = {"model": lm.name, **self.info,
                "stopped": "eos" if ids and ids[-1] in lm.eos_ids else "max_new_tokens"}
        if self.judge_ahead:
            meta["judged_ahead"] = rounds.judged_ahead
        out = Tokens(list(ids), lm.tokenizer.decode(ids, skip_special_tokens=True), meta, rounds.stats())
        self.start_run(ctx)
        return {"tokens": out}
