"""The lean step as one function of fixed roles, for torch.compile: the cached prefix goes in
read-only, the new tokens' keys and values come out, and the caller appends them to the cache.

    step = CompiledStep(lean, mode="default")                 # models.lean.LeanDecoder
    hidden, new_k, new_v = step(embeds, cos, sin, prefix_k, prefix_v, mask)
        embeds [n, hidden]; cos, sin [n, head_dim] (the rotary rows of the n positions);
        prefix_k, prefix_v: each layer's cached keys and values [kv_heads, L_l, head_dim];
        mask bool [n, n]: which new tokens each new token sees (causal, or a tree's ancestors)
        -> final-norm hidden [n, hidden], new keys and values [layers, kv_heads, n, head_dim]

Why this shape: a compiled function that writes into a cache buffer it captured has the write
functionalised, and the whole buffer is copied on every call (on 2 CPU cores a compiled toy step
that wrote its cache took 14-16 ms against 2.6 eager; written by the caller, 1.7 ms).

Attention is split in two and merged by log-sum-exp: the prefix with no mask at all (on the CPU by
reelflow's kernel where it serves, models.cpu_attention: `lean.prefix_kernel`), the new tokens
among themselves with their small mask. No mask of new tokens × context is ever built, and the
prefix stays read-only. Its results differ from the eager lean path (models.lean, the exact
reference) by float32 rounding: the same terms, summed in another order.

Compiled with the token count and the prefix lengths symbolic (models.compiling.compiled), so one
compile serves every cache length and every number of new tokens above one (torch specialises a
dimension of size 1, so a one-token step is a second compile); inductor's on-disk cache spares
later processes most of the compile time.
"""

from __future__ import annotations

import torch

from models import cpu_attention
from models.compiling import call_at_warmed_threads, compiled, thread_counts, varying, warm_at_thread_counts
from models.prefix_attention import merge_with_new

MODES = ("off", "default", "max-autotune-no-cudagraphs")   # model.<role>.compile, besides "auto" and the captured
def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor, scaling: float, held: torch.Tensor | None = None,
                    kernel: bool = False) -> torch.Tensor:
    """q [H, n, hd]; k, v [KV, m, hd] (the new tokens', m ≥ n when rows drafted earlier come
    first); keys, values [KV, L, hd] (the cached prefix, L ≥ 1, every entry seen, or with `held`
    bool [L] only those it marks: a fixed buffer whose tail is spare room); mask bool [n, m]:
    which of the m each query sees (each sees at least itself). Heads grouped as transformers'
    repeat_kv lays them out. kernel: the prefix's part by the CPU kernel (models.cpu_attention;
    the caller checked that it serves), every cached entry seen. -> [n, H * hd], softmax in float32."""
    heads, n, hd = q.shape
    kv, m = k.shape[0], k.shape[1]
    group = heads // kv
    qg = q.reshape(kv, group * n, hd)
    if kernel and held is None:
        out, lse = cpu_attention.prefix_attention(qg, keys, values, scaling)                # [KV, G*n, hd], [KV, G*n]
        new = (torch.matmul(qg, k.transpose(-1, -2)).float() * scaling).view(kv, group, n, m)
        new = new.masked_fill(~mask, float("-inf")).view(kv, group * n, m)
        merged = merge_with_new(out, lse, new, v).to(q.dtype)                              # [KV, G*n, hd]
        return merged.view(kv, group, n, hd).reshape(heads, n, hd).transpose(0, 1).reshape(n, heads * hd)
    prefix = torch.matmul(qg, keys.transpose(-1, -2)).float() * scaling                  # [KV, G*n, L]
    if held is not None:
        prefix = prefix.masked_fill(~held, float("-inf"))
    new = (torch.matmul(qg, k.transpose(-1, -2)).float() * scaling).view(kv, group, n, m)
    new = new.masked_fill(~mask, float("-inf")).view(kv, group * n, m)                   # [KV, G*n, m]
    top = torch.maximum(prefix.amax(-1, keepdim=True), new.amax(-1, keepdim=True))     # [KV, G*n, 1]
    p_prefix, p_new = (prefix - top).exp(), (new - top).exp()
    total = p_prefix.sum(-1, keepdim=True) + p_new.sum(-1, keepdim=True)
    out = (torch.matmul(p_prefix.to(values.dtype), values).float()
           + torch.matmul(p_new.to(v.dtype), v).float()) / total                         # [KV, G*n, hd]
    return out.to(q.dtype).view(kv, group, n, hd).reshape(heads, n, hd).transpose(0, 1).reshape(n, heads * hd)


def layers_step(lean, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefix_k: list, prefix_v: list,
                mask: torch.Tensor):
    """The decoder layers of `lean` (models.lean.LeanDecoder.run_layers) over the new tokens, with
    split_attention over the given prefix, collecting the new keys and values. See the module doc."""
    new_k, new_v = [], []

    def attend(i, q, k, v):
        new_k.append(k)
        new_v.append(v)
        return split_attention(q, k, v, prefix_k[i], prefix_v[i], mask, lean.scaling, kernel=lean.prefix_kernel)

    hidden = lean.run_layers(embeds, cos, sin, attend, fused=True)
    return hidden, torch.stack(new_k), torch.stack(new_v)


class CompiledStep:
    """layers_step for one LeanDecoder, through torch.compile in `mode` (MODES, "off" excluded)."""

    def __init__(self, lean, mode: str = "default"):
        if mode not in MODES or mode == "off":
            raise ValueError(f"compile={mode!r}: one of {', '.join(MODES)}")
        self.lean, self.mode = lean, mode
        self._fn = compiled(layers_step, mode)
        self.threads: tuple[int, ...] = (torch.get_num_threads(),)       # what warm compiled for

    def __call__(self, embeds, cos, sin, prefix_k, prefix_v, mask):
        return call_at_warmed_threads(self._fn, self.threads, *self._marked(embeds, cos, sin, prefix_k, prefix_v, mask))

    def _marked(self, embeds, cos, sin, prefix_k, prefix_v, mask) -> tuple:
        """The compiled function's arguments, with what changes between calls marked: the token
        count and each layer's prefix length."""
        for t in (embeds, cos, sin):
            varying(t, 0)
        for t in (*prefix_k, *prefix_v):
            varying(t, 1)
        return self.lean, embeds, cos, sin, prefix_k, prefix_v, varying(mask, 0, 1)

    def run(self, cache, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            among: torch.Tensor) -> torch.Tensor:
        """The n new tokens (embeds [n, hidden], rotary rows cos/sin [n, hd], among bool [n, n]) over
        `cache`, read as each layer's prefix; their keys and values appended here, outside the
        compiled function. -> hidden [n, hidden]."""
        layers = cache.layers
        hidden, new_k, new_v = self(embeds, cos, sin, [layer.keys[0] for layer in layers],
                                    [layer.values[0] for layer in layers], among)
        for layer, k, v in zip(layers, new_k, new_v):
            layer.update(k[None], v[None])
        return hidden

    @torch.inference_mode()
    def warm(self, device, dtype, name: str = "step") -> float:
        """Compile now what a run calls (a one-token step; several tokens, one compile for every
        count above one) over a dummy prefix, so that no request pays for it. Returns the seconds."""
        lean = self.lean
        self.threads = thread_counts(device)
        hidden = lean.layers[0].q.shape[1]
        # laid out as the cache's are (models.cache: views of buffers with spare room), or the
        # first request would recompile on the prefix's strides
        prefix_k, prefix_v = ([torch.zeros(1, lean.n_kv_heads, 8, lean.head_dim, device=device, dtype=dtype)[0, :, :3]
                               for _ in lean.layers] for _ in range(2))

        def one_and_several_tokens():
            for n in (1, 2):
                self._fn(*self._marked(torch.zeros(n, hidden, device=device, dtype=dtype),
                                       torch.ones(n, lean.head_dim, device=device, dtype=dtype),
                                       torch.zeros(n, lean.head_dim, device=device, dtype=dtype), prefix_k, prefix_v,
                                       torch.ones(n, n, dtype=torch.bool, device=device).tril()))

        return warm_at_thread_counts(self.threads, one_and_several_tokens, f"{name} lean step", self.mode)
