"""generate: the autoregressive baseline: one target step per token, greedy or sampled.

The loop is models.decoding's, shared with the model card and the trainer's check; greedy
(temperature 0) is token-identical to the model's own `generate(do_sample=False)`; tests check
it for both architectures. The first token is published on `first` the moment it
is known (time to first token), the whole answer on `tokens` at the end.
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.decoding import decode
from models.registry import get_model
from models.sampling import Sampling
from stages.types import PrefillResult, Tokens


class Generate(Stage):
    placement = "gpu"
    inputs = {"kv": In(PrefillResult)}
    outputs = {"first": Out(Tokens, tap=True), "tokens": Out(Tokens)}

    def __init__(self, model: dict, max_new_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        self.model, self.max_new_tokens, self.seed = dict(model), max_new_tokens, seed
        self.sampling = Sampling(temperature, top_k, top_p)
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)

    def _pick(self, logits: torch.Tensor, rng: torch.Generator) -> int:
        return self.sampling.pick(logits, rng)[0]

    def __call__(self, ctx, kv: PrefillResult):
        lm = self.lm
        rng = torch.Generator().manual_seed(self.seed)
        out = []
        for token in decode(lm, kv.cache, kv.logits, kv.logical_length, kv.layout,
                            self.max_new_tokens, lambda logits: self._pick(logits, rng)):
            out.append(token)
            if len(out) == 1:
                ctx.emit("first", Tokens([token]))
        text = lm.tokenizer.decode(out, skip_special_tokens=True)
        meta = {"model": lm.name, "n_video_tokens": kv.n_video_tokens,
                "prompt_tokens": kv.logical_length, "stopped": "eos" if out[-1] in lm.eos_ids else "max_new_tokens",
                "prefill": kv.prefill}
        return {"tokens": Tokens(out, text, meta)}

