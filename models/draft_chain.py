"""A draft model's greedy round as one compiled call: the tokens its cache lacks, then `steps`
tokens drafted one after another, each the argmax of the one before, without returning to Python
in between.

    chain = DraftChain(lm, steps=4, vocab=64)   # lm: a models.adapter.VideoLM with a lean path
    chain.warm()
    tokens, logits = chain.run(cache, pending, positions)
        pending int64 [P] (P ≥ 1): the committed tokens the draft's cache lacks
        positions int64 [P + steps - 1]: the rotary positions of everything fed
        -> tokens int64 [steps], logits float32 [steps, vocab] (the argmax over the first `vocab`
           ids: the vocabulary the draft shares with its target); the cache holds pending and the
           first steps - 1 drafted tokens (the last is drafted, not fed)

Why: a small draft's step is fixed cost, not arithmetic. Drafting token by token, each step pays
for the embedding, the rotary rows, the compiled function's guards, the cache appends, the LM head
and the argmax on the host, which together cost more than the draft's layers (the toy draft on one
CPU core: 0.65-0.79 ms a drafted token, its layers alone 0.39). Drafting the round in one call pays
for them once: 0.30-0.33 ms a drafted token.

The drafted tokens are the draft's greedy tokens; its logits differ from token-by-token drafting by
float32 rounding only (models.compiled_step: the same terms summed in another order), so a near tie
may draft another token. The target's verification decides what is committed either way: the
answer stays the target's own.

Compiled with the cache length and P symbolic (models.compiling.compiled): one compile serves
every cache length; P = 1 and P ≥ 2 are the two compiles (torch specialises a dimension of size 1).
`steps` is fixed per chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.compiled_step import MODES, split_attention
from models.compiling import call_at_warmed_threads, compiled, thread_counts, varying, warm_at_thread_counts


def greedy_chain(lean, embed: torch.Tensor, head: torch.Tensor, head_bias: torch.Tensor | None, pending: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, prefix_k: list, prefix_v: list, steps: int, vocab: int):
    """lean: a models.lean.LeanDecoder; embed [V_all, hidden], head [V_all, hidden] (+ bias): the
    input embedding and LM head weights; pending int64 [P]; cos, sin [P + steps - 1, head_dim];
    prefix_k, prefix_v: each layer's cached keys and values [kv_heads, L, head_dim] (read only).
    -> tokens int64 [steps], logits float32 [steps, vocab], new keys and values
    [layers, kv_heads, P + steps - 1, head_dim] (of everything fed, in order)."""
    n_layers = len(lean.layers)
    new_k: list = [None] * n_layers             # per layer: [KV, fed so far, hd]
    new_v: list = [None] * n_layers
    ids, fed = pending, 0
    tokens, rows = [], []
    for _ in range(steps):
        n = ids.shape[0]

        def attend(i, q, k, v, n=n):
            k_all = k if new_k[i] is None else torch.cat([new_k[i], k], 1)       # [KV, m, hd]
            v_all = v if new_v[i] is None else torch.cat([new_v[i], v], 1)
            new_k[i], new_v[i] = k_all, v_all
            m = k_all.shape[1]
            among = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)   # causal, the n last of m
            return split_attention(q, k_all, v_all, prefix_k[i], prefix_v[i], among, lean.scaling,
                                   kernel=lean.prefix_kernel)

        hidden = lean.run_layers(F.embedding(ids, embed), cos[fed:fed + n], sin[fed:fed + n], attend, fused=True)
        logits = F.linear(hidden[-1:], head, head_bias).float()[:, :vocab]               # [1, vocab]
        ids = logits.argmax(-1)                                                           # [1]
        tokens.append(ids)
        rows.append(logits)
        fed += n
    # the last token's keys were never made: it is drafted, not fed
    return torch.cat(tokens), torch.cat(rows), torch.stack(new_k), torch.stack(new_v)


class DraftChain:
    """greedy_chain for one model and one round length, through torch.compile in `mode`
    (models.compiled_step.MODES, "off" excluded)."""

    def __init__(self, lm, steps: int, vocab: int, mode: str = "default"):
        if mode not in MODES or mode == "off":
            raise ValueError(f"compile={mode!r}: one of {', '.join(m for m in MODES if m != 'off')}")
        if lm.lean is None:
            raise ValueError(f"{lm.name}: a draft chain needs the lean path")
        if steps < 1:
            raise ValueError(f"steps must be ≥ 1, got {steps}")
        self.lm, self.steps, self.vocab, self.mode = lm, steps, vocab, mode
        self._fn = compiled(greedy_chain, mode)
        self.threads: tuple[int, ...] = (torch.get_num_threads(),)

    def _call(self, pending, cos, sin, prefix_k, prefix_v):
        return call_at_warmed_threads(self._fn, self.threads, *self._marked(pending, cos, sin, prefix_k, prefix_v))

    def _marked(self, pending, cos, sin, prefix_k, prefix_v) -> tuple:
        """The compiled function's arguments, with what changes between calls marked: the count
        of pending tokens and each layer's prefix length."""
        lm = self.lm
        for t in (pending, cos, sin):
            varying(t, 0)
        for t in (*prefix_k, *prefix_v):
            varying(t, 1)
        return (lm.lean, lm.text.embed_tokens.weight, lm.lm_head.weight, lm.lm_head.bias, pending, cos, sin,
                prefix_k, prefix_v, self.steps, self.vocab)

    @torch.inference_mode()
    def run(self, cache, pending: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """See the module doc. The fed tokens' keys and values are appended to `cache` here."""
        lean = self.lm.lean
        if pending.dim() != 1 or pending.shape[0] < 1:
            raise ValueError(f"pending must hold ≥ 1 token ids [P], got shape {tuple(pending.shape)}")
        if positions.shape != (pending.shape[0] + self.steps - 1,):
            raise ValueError(f"positions: one per fed token ({pending.shape[0] + self.steps - 1}), "
                             f"got shape {tuple(positions.shape)}")
        # made here in inference mode, whatever mode the caller built it in: the compiled function is
        # guarded on its inputs' dispatch keys and would compile again for a normal tensor
        pending = pending.to(self.lm.device)
        if not pending.is_inference():
            pending = pending.clone()
        cos, sin = lean._rotary(positions, lean.final_norm)
        layers = cache.layers
        tokens, logits, new_k, new_v = self._call(pending, cos, sin, [layer.keys[0] for layer in layers],
                                                  [layer.values[0] for layer in layers])
        for layer, k, v in zip(layers, new_k, new_v):
            layer.update(k[None], v[None])
        return tokens, logits

    @torch.inference_mode()
    def warm(self) -> float:
        """Compile now what a run calls (P = 1 and P = 2, at each thread count a pool gives the
        draft) over a dummy prefix, so that no request pays for it. Returns the seconds."""
        lm, lean = self.lm, self.lm.lean
        self.threads = thread_counts(lm.device)
        # laid out as the cache's are (models.cache: views of buffers with spare room), or the
        # first request would compile again on the prefix's strides; a prefix length unlike the
        # fed counts (P + steps - 1 for P = 1, 2), which torch would otherwise assume equal to it
        held = self.steps + 2
        prefix_k, prefix_v = ([torch.zeros(1, lean.n_kv_heads, held + 5, lean.head_dim, device=lm.device,
                                           dtype=lm.dtype)[0, :, :held] for _ in lean.layers] for _ in range(2))

        def one_and_two_pending():
            for p in (1, 2):
                cos, sin = lean._rotary(torch.arange(p + self.steps - 1), lean.final_norm)
                self._fn(*self._marked(torch.zeros(p, dtype=torch.long, device=lm.device), cos, sin, prefix_k,
                                       prefix_v))

        return warm_at_thread_counts(self.threads, one_and_two_pending, f"{lm.name} draft chain of {self.steps}",
                                     self.mode)
