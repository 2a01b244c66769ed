"""draft: a small model proposes the next `window` tokens for the target to verify.

`ModelDraft` holds the draft model's cache after its own prefill (of the whole video for vanilla
speculative decoding; of the pruned video for ParallelVLM). Each call drafts one round of
`window` tokens from what it believes is committed, and is called again on every verdict:

    prime 1 on the verdict edge  draft, then verify, then draft ... (vanilla speculative decoding)
    prime 2                      the draft works on round i+1 while the target verifies round i,
                                 assuming round i is accepted whole; a verdict that rejects part
                                 of it makes the round in flight stale (the verifier answers it
                                 without work) and the draft restarts from the committed tokens

Pre-verify (ParallelVLM App. B, Alg. 1; `pre_verify: true`): the first round, and every round
drafted right after a rollback, is one token, so the target verifies it at once instead of
idling while the draft restarts a whole window; the draft meanwhile drafts a full window on top
of it (post-verify). A pre-verify round whose token is accepted leads into post-verify rounds; a
rejected one into another pre-verify round. Proposals say which mode drafted them (meta "mode").

The first round starts from the draft's own prefill logits (nothing is committed yet), so a draft
whose prefill ends before the target's has its first window ready when the target's prefill ends
(ParallelVLM's start-up tokens). On a verdict the draft rolls its cache back to the longest prefix it shares with the committed
sequence. With temperature > 0 each proposal carries the draft's warped distributions q, which
the verifier needs for the acceptance rule; the draft's vocabulary is sliced to the shared one.

`window: auto` sets γ the way ParallelVLM's Eq. 6 does, γ = c* = Tp / Tq(α): the draft times its
own forwards (Tq, per drafted token, on its pruned cache) and reads the target's verification
time (Tp) off each verdict, and after every verdict drafts the next round with
γ = round(mean Tp / mean Tq), clamped to 1..max_window. The seed fixes γ once from measured
times; measuring online is the same rule without a calibration run, and it follows the times as
the caches grow. Until the first verdict it drafts `start_window` tokens.
"""

from __future__ import annotations


import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from models.sampling import Sampling
from stages.types import KV, Proposal, Verdict


class ModelDraft(Stage):
    """model: the draft entry; window: tokens per round (γ), or "auto" (γ = Tp / Tq measured, see
    above; start_window before the first verdict, at most max_window); temperature, top_k, top_p,
    seed: as the verifier's; vocab: the shared vocabulary size (0: the tokenizer's);
    max_new_tokens: no round drafts past it; target: the target's entry, whose tokenizer must be
    the draft's (checked at setup: a clear error otherwise); pre_verify: one-token rounds after
    each rollback (see above; for a draft that runs ahead, prime 2); confidence: a round ends
    early, after the token it drafted with its own probability below this (the softmax of its
    logits when greedy, q when sampling), so `window` is then the most a round drafts (0: always
    `window`). Drafts agree with the target on easy tokens and miss the content ones; a token the
    draft itself doubts is the likely rejection, and drafting past it is mostly wasted."""

    placement = "gpu"
    inputs = {"kv": In(KV), "verdict": In(Verdict, stream=True)}
    outputs = {"proposal": Out(Proposal, stream=True)}

    def __init__(self, model: dict, window: int | str = 4, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, vocab: int = 0, max_new_tokens: int = 256, target: dict | None = None,
                 start_window: int = 4, max_window: int = 16, pre_verify: bool = False, confidence: float = 0.0):
        self.auto = window == "auto"
        if self.auto:
            window = start_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ValueError(f"window must be an integer ≥ 1 or 'auto', got {window!r}")
        if not 1 <= start_window <= max_window:
            raise ValueError(f"need 1 ≤ start_window ≤ max_window, got {start_window} and {max_window}")
        self.start_window, self.max_window = start_window, max_window
        self.model, self.window, self.max_new_tokens = dict(model), window, max_new_tokens
        self.sampling, self.seed, self.vocab = Sampling(temperature, top_k, top_p), seed, vocab
        self.target = dict(target) if target else None
        self.pre_verify = bool(pre_verify)
        if not 0 <= confidence < 1:
            raise ValueError(f"confidence must be in [0, 1), got {confidence}")
        self.confidence = float(confidence)
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        if self.target:     # one tokenizer, or no speculative decoding (lm_head padding alone is sliced off)
            from models.load import shared_vocabulary, tokenizer_of

            shared = shared_vocabulary(tokenizer_of(self.target["path"], self.target.get("name")), self.lm)
            self.vocab = min(self.vocab, shared) if self.vocab else shared
        self._reset()

    def _reset(self) -> None:
        self.sequence: list[int] = []      # committed tokens, then the rounds in flight
        self.committed = 0                 # how many of `sequence` the target has committed
        self.in_cache = 0                  # how many of `sequence` the draft's cache holds
        self.round = 0
        self.restarted = True              # the next round starts after a rollback (or is the first)
        self.pre_rounds: set[int] = set()  # the rounds drafted in pre-verify mode
        self.rng = torch.Generator().manual_seed(self.seed + 2)
        if self.auto:
            self.window = self.start_window
        self.tp = [0.0, 0]                 # the target's verification time: sum, count
        self.tq = [0.0, 0]                 # the draft's time per drafted token: sum, count

    def start_run(self, ctx) -> None:
        self._reset()

    def __call__(self, ctx, kv: KV, verdict: Verdict | None):
        if verdict is not None and not verdict.stale:
            self._apply(kv, verdict)
            # γ follows the verification of a whole window: a pre-verify round's one token is not one
            if self.auto and verdict.verify_s > 0 and self.tq[1] and verdict.round not in self.pre_rounds:
                self.tp = [self.tp[0] + verdict.verify_s, self.tp[1] + 1]
                self.window = auto_window(self.tp[0] / self.tp[1], self.tq[0] / self.tq[1], self.max_window)
        if len(self.sequence) >= self.max_new_tokens:
            return {}                     # everything left is in flight already
        base = len(self.sequence)
        after = self.sequence[-1] if self.sequence else -1
        pre = self.pre_verify and self.restarted
        self.restarted = False
        k = 1 if pre else self.window
        tokens, probs = self._draft(ctx, kv, min(k, self.max_new_tokens - base))
        self.sequence += tokens
        self.round += 1
        if pre:
            self.pre_rounds.add(self.round)
        # window: the γ in force (a pre-verify round drafts one token whatever γ is; the verifier
        # records the tokens it verified apart), so window_mean stays the γ of the seed's bounds;
        # with `confidence` a round's own length is its γ
        window = len(tokens) if self.confidence and not pre else self.window
        meta = {"window": window, "mode": "pre" if pre else "post"}
        if self.tq[1]:
            meta["tq_s"] = self.tq[0] / self.tq[1]
        if self.round == 1:      # what the draft works from, for the run's metrics
            meta |= {"draft_model": self.lm.name, "window_setting": "auto" if self.auto else self.window,
                     "draft_prefill": kv.prefill}
        ctx.emit("proposal", Proposal(self.round, base, torch.tensor(tokens), torch.stack(probs) if probs else None,
                                      meta, after))
        return {}

    def _apply(self, kv: KV, verdict: Verdict) -> None:
        """The target verified the tokens from `start` on: it committed our first `accepted` of
        them, then its own token. What was drafted on exactly that stays; otherwise the tokens
        in flight are void and the cache goes back to the agreed prefix."""
        own = [verdict.token] if verdict.token >= 0 else []     # none: our next token is judged as a draft
        start = verdict.length - verdict.accepted - len(own)
        agreed = self.sequence[:start + verdict.accepted] + own
        self.committed = len(agreed)
        if self.sequence[:len(agreed)] == agreed:
            return
        self.sequence = agreed
        self.restarted = True
        keep = min(self.in_cache, start + verdict.accepted)
        self.lm.drop_last(kv.cache, self.in_cache - keep)
        self.in_cache = keep

    def _draft(self, ctx, kv: KV, k: int) -> tuple[list[int], list[torch.Tensor]]:
        lm, layout = self.lm, kv.layout
        vocab = self.vocab or len(lm.tokenizer)
        pending = torch.tensor(self.sequence[self.in_cache:], dtype=torch.long)
        tokens, probs = [], []
        for _ in range(k):
            with ctx.timer("draft_token") as step:
                if pending.shape[0]:
                    logits = lm.score(kv.cache, pending, kv.logical_length + self.in_cache, layout)[-1, :vocab]
                    self.in_cache += pending.shape[0]
                else:                     # nothing after the prompt yet: the prefill's logits
                    logits = kv.logits[:vocab]
                token, q = self.sampling.pick(logits, self.rng)
            if pending.shape[0] == 1:     # one drafted token's forward, as the engine timed it: Tq
                self.tq = [self.tq[0] + step.seconds, self.tq[1] + 1]
            if q is not None:
                probs.append(q)
            tokens.append(token)
            if self.confidence and own_probability(logits, token, q) < self.confidence:
                break
            pending = torch.tensor([token])
        return tokens, probs


def own_probability(logits: torch.Tensor, token: int, q: torch.Tensor | None) -> float:
    """The draft's probability of the token it drafted: q[token] when sampling (q: the warped
    distribution it was drawn from), else the softmax of the logits [V] at it."""
    if q is not None:
        return float(q[token])
    return float(torch.softmax(logits.float(), -1)[token])


def auto_window(tp_s: float, tq_s: float, max_window: int) -> int:
    """ParallelVLM's Eq. 6: γ = c* = Tp / Tq, rounded, within 1..max_window. At that γ, drafting a
    round takes as long as verifying one, so neither side of the overlapped pipeline waits."""
    if tq_s <= 0:
        return max_window
    return max(1, min(max_window, round(tp_s / tq_s)))
