"""draft: a small model proposes the next tokens for the target to verify.

The stage is the engine's side of speculative.model_draft.ModelDrafter (the drafting, rollback,
pre-verify and γ rules live there): it builds one per run from the draft's prefill and asks it for
a round on every verdict. How far it runs ahead is the graph's business, the primes on its verdict
edge:

    prime 1   draft, then verify, then draft ... (vanilla speculative decoding)
    prime 2   the draft works on round i+1 while the target verifies round i (ParallelVLM, PEARL)
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sampling import Sampling
from speculative.model_draft import ModelDrafter
from speculative.protocol import DraftInfo, Proposal, Verdict
from stages.types import PrefillResult


def draft_round(stage, ctx, prefilled, verdict: Verdict | None) -> dict:
    """What every draft stage does on a call: build its drafter (a ModelDrafter or a HeadDrafter)
    from what the run's first call brings (`stage.drafter_for`), ask it for the round after
    `verdict`, and emit the proposal."""
    if stage.drafter is None:
        stage.drafter = stage.drafter_for(prefilled)
    proposal = stage.drafter.propose(verdict, ctx.timer)
    if proposal is not None:
        ctx.emit("proposal", proposal)
    return {}


class ModelDraft(Stage):
    """model: the draft entry; window: tokens per round (γ), or "auto" (γ = Tp / Tq measured;
    start_window before the first verdict, at most max_window); temperature, top_k, top_p, seed: as
    the verifier's; vocab: the compared vocabulary (0: the one shared with `target`, else the
    draft's); max_new_tokens: no round drafts past it; target: the target's entry, whose tokenizer
    must be the draft's (checked at setup: a clear error otherwise); pre_verify: one-token rounds
    after each rollback (for a draft that runs ahead, prime 2; "auto": those that pay, by the
    measured times, speculative.model_draft.pre_verify_pays); confidence: a round ends after a
    token the draft gives less than this probability (0: always `window`); chain: draft a greedy
    round of a fixed window in one compiled call (models.draft_chain) when the draft's steps are
    compiled with inductor (model.draft.compile); false: a forward a token, as without compile."""

    placement = "gpu"
    inputs = {"kv": In(PrefillResult), "verdict": In(Verdict, stream=True)}
    outputs = {"proposal": Out(Proposal, stream=True)}

    def __init__(self, model: dict, window: int | str = 4, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, vocab: int = 0, max_new_tokens: int = 256, target: dict | None = None,
                 start_window: int = 4, max_window: int = 16, pre_verify: bool | str = False, confidence: float = 0.0,
                 chain: bool = True):
        if window != "auto" and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ValueError(f"window must be an integer ≥ 1 or 'auto', got {window!r}")
        if not 1 <= start_window <= max_window:
            raise ValueError(f"need 1 ≤ start_window ≤ max_window, got {start_window} and {max_window}")
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.model, self.window, self.max_new_tokens = dict(model), window, max_new_tokens
        self.start_window, self.max_window = start_window, max_window
        self.sampling, self.seed, self.vocab = Sampling(temperature, top_k, top_p), seed, vocab
        self.target = dict(target) if target else None
        if pre_verify not in (True, False, "auto"):
            raise ValueError(f"pre_verify must be true, false or 'auto', got {pre_verify!r}")
        self.pre_verify, self.confidence = pre_verify, float(confidence)
        self.use_chain = bool(chain)
        self.lm = self.chain = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        if self.target:     # one tokenizer, or no speculative decoding (lm_head padding alone is sliced off)
            from models.load import shared_vocabulary, tokenizer_of

            shared = shared_vocabulary(tokenizer_of(self.target["path"], self.target.get("name")), self.lm)
            self.vocab = min(self.vocab, shared) if self.vocab else shared
        self.chain = self._chain()
        self.start_run(ctx)

    def _chain(self):
        """The compiled greedy round (models.draft_chain), warmed now, where it applies: a fixed
        window, greedy, the draft's steps compiled by inductor (not captured, not eager)."""
        from models.compiled_step import MODES
        from models.draft_chain import DraftChain

        mode = getattr(self.lm, "compile", "off")
        if not (self.use_chain and self.window != "auto" and self.sampling.greedy and self.lm.lean is not None
                and mode in MODES and mode != "off"):
            return None
        chain = DraftChain(self.lm, self.window, self.vocab or self.lm.vocabulary, mode)
        chain.warm()
        return chain

    def start_run(self, ctx) -> None:
        self.drafter: ModelDrafter | None = None

    def drafter_for(self, kv: PrefillResult) -> ModelDrafter:
        """This stage's settings over the draft's prefill: what one run (request) drafts with."""
        return ModelDrafter(self.lm, kv.cache, kv.logical_length, kv.layout, kv.logits, window=self.window,
                            sampling=self.sampling, vocab=self.vocab or self.lm.vocabulary,
                            max_new_tokens=self.max_new_tokens, generator=torch.Generator().manual_seed(self.seed + 2),
                            start_window=self.start_window, max_window=self.max_window, pre_verify=self.pre_verify,
                            confidence=self.confidence, info=DraftInfo(self.lm.name, kv.prefill, self.window),
                            chain=self.chain)

    def __call__(self, ctx, kv: PrefillResult, verdict: Verdict | None):
        return draft_round(self, ctx, kv, verdict)
