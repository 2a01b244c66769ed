"""The lean forward: a few new tokens over a cached prefix (a decode step, a k-token verification,
a tree of candidates), computed from the model's own weights without transformers' per-call
machinery.

A decode step of a small model is mostly fixed cost, not arithmetic: transformers' decoder layer
builds a causal mask, dispatches through the attention interface, kwargs handling, deprecation
checks and cache bookkeeping for every layer of every step, and on 2 CPU cores that costs more
than the layer's matmuls over 1,080 cached tokens. This module runs the same operations the
layers run (RMSNorm in float32, the q/k/v projections with their biases, rotary embedding as
`rotate_half` applies it, grouped attention with a float32 softmax, SwiGLU), in the same order,
on the same tensors, with nothing else in between. Rotary cos/sin come from the model's own
`rotary_emb`, evaluated once for a table of positions and then indexed.

It serves the tokens after the prompt only: their rotary position is one number on every MRoPE
row (logical index + rope_delta, models.adapter.Layout.decode_positions), so one table row per
position is exact. Prefill, taps and attention capture stay on the model's own forward.

    lean = LeanDecoder.of(lm.text)            # None when the model's layers are not the Qwen2 kind
    hidden = lean.forward(cache, embeds, positions)                       # [n, hidden], final norm
    hidden = lean.forward(cache, embeds, positions, mask=mask)   # candidates as a tree (speculative.tree)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.attention import decode_attention
from models.packing import PackedLayer, mlp_products, o_product, qkv_products

TABLE_STEP = 4096       # rotary table rows added at a time (positions beyond it extend it)


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's parameters, the model's own tensors (no copies)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [n, d] -> [n, d]: the Qwen2 RMSNorm, variance in float32, scaled in the input's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, n, head_dim]; cos, sin [n, head_dim] -> x rotated (transformers' rotate_half rule)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class LeanDecoder:
    """The decoder layers of a Qwen2-kind text model (Qwen2.5-VL's and LLaVA-OneVision's), run
    lean over a models.cache GrowingLayer cache."""

    def __init__(self, text_model):
        config = text_model.config
        self.text = text_model
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        self.layers = [self._weights(layer) for layer in text_model.layers]
        self.final_norm = text_model.norm.weight
        self._cos = self._sin = None
        self._masks: dict = {}        # (n, device) -> causal bool [n, n] (_causal)
        self.step = None          # models.compiled_step.CompiledStep or models.captured_step.CapturedStep (load_model)
        self.packed: list[PackedLayer] | None = None     # models.packing, when load_model packed the weights
        self.prefix_kernel = False    # compiled steps' prefix attention by models.cpu_attention (load_model)

    @classmethod
    def of(cls, text_model) -> LeanDecoder | None:
        """A LeanDecoder when every layer is the Qwen2 kind with full attention, else None."""
        config = text_model.config
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "use_sliding_window", False):
            return None
        if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
            return None
        needed = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
        if not all(all(hasattr(layer, n) for n in needed) for layer in text_model.layers):
            return None
        attn = text_model.layers[0].self_attn
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")):      # Qwen3-style norms: another kind
            return None
        return cls(text_model)

    @staticmethod
    def _weights(layer) -> LayerWeights:
        a, m = layer.self_attn, layer.mlp
        return LayerWeights(layer.input_layernorm.weight, a.q_proj.weight, a.q_proj.bias, a.k_proj.weight,
                            a.k_proj.bias, a.v_proj.weight, a.v_proj.bias, a.o_proj.weight, a.o_proj.bias,
                            layer.post_attention_layernorm.weight, m.gate_proj.weight, m.up_proj.weight,
                            m.down_proj.weight)

    # ------------------------------------------------------------------------- rotary table

    def _rotary(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, head_dim] of 1-D positions [n], rows of a table the model's own rotary
        embedding computed (every MRoPE row at the same position, as after the prompt)."""
        need = int(positions.max()) + 1
        if self._cos is None or need > self._cos.shape[0] or self._cos.dtype != like.dtype:
            rows = (need // TABLE_STEP + 1) * TABLE_STEP
            pos = torch.arange(rows, device=like.device)[None]                     # [1, rows]
            if getattr(self.text.rotary_emb, "mrope_section", None) is not None:
                pos = pos[None].expand(3, 1, rows)                                 # [3, 1, rows]
            cos, sin = self.text.rotary_emb(like[None, :1], pos)
            self._cos, self._sin = cos.reshape(rows, -1), sin.reshape(rows, -1)
        positions = positions.to(self._cos.device)
        return self._cos[positions], self._sin[positions]

    # ------------------------------------------------------------------------- forward

    @torch.inference_mode()
    def forward(self, cache, embeds: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds [n, hidden] at 1-D rotary positions [n] after the cached entries of every layer;
        appends their keys and values to `cache`. mask: None (causal among the n) or bool [n, n]
        (row i sees column j among the new tokens; every cached entry is seen). Returns the
        final-norm hidden states [n, hidden]. Through `step` when the model was loaded with one
        (compiled or captured), else eager."""
        if self.step is None:
            return self.forward_eager(cache, embeds, positions, mask)
        n = embeds.shape[0]
        # the step's inputs made here, in inference mode, whatever mode the caller built them in:
        # a compiled step is guarded on its inputs' dispatch keys and would compile again for a
        # normal tensor (a copy of a few rows costs nothing beside a step)
        if not embeds.is_inference():
            embeds = embeds.clone()
        cos, sin = self._rotary(positions, embeds)
        if mask is not None and not mask.is_inference():
            mask = mask.clone()
        among = mask.to(embeds.device) if mask is not None else self._causal(n, embeds.device)
        return self.step.run(cache, embeds, cos, sin, among)

    def _causal(self, n: int, device) -> torch.Tensor:
        """The causal mask among n new tokens on `device`, made once (a host-to-device copy per step
        would stall a GPU's step behind the host)."""
        key = (n, str(device))
        if key not in self._masks:
            self._masks[key] = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        return self._masks[key]

    @torch.inference_mode()
    def forward_eager(self, cache, embeds: torch.Tensor, positions: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
        """forward on the eager path, whatever `step` is: the exact reference."""
        n = embeds.shape[0]

        def attend(i, q, k, v):
            keys, values = cache.layers[i].update(k[None], v[None])                                 # [1, KV, L, hd]
            full = None
            if mask is not None:          # every cached entry, then the tree among the new ones
                full = torch.ones(1, 1, n, keys.shape[2], dtype=torch.bool, device=q.device)
                full[..., keys.shape[2] - n:] = mask.to(q.device)
            return decode_attention(q[None], keys, values, full, self.scaling)                     # [1, n, H, hd]

        return self.run_layers(embeds, *self._rotary(positions, embeds), attend)

    def run_layers(self, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                   fused: bool = False) -> torch.Tensor:
        """The decoder layers over embeds [n, hidden] with the rotary rows cos, sin [n, head_dim] of
        their positions (`_rotary`). attend(layer, q [H, n, hd], k [KV, n, hd], v [KV, n, hd])
        stores the new keys and values wherever its cache keeps them and returns the attention,
        [1, n, H, hd] or [n, H * hd]. fused: the products by the packed weights where the model
        has them (q, k and v in one product, gate and up in one: compiled steps), else one
        product a projection, as the model's own forward. Returns the final-norm hidden states
        [n, hidden]."""
        x = embeds
        packed = self.packed if fused and self.packed is not None else [None] * len(self.layers)
        for i, (w, p) in enumerate(zip(self.layers, packed)):
            x = self.layer(x, w, cos, sin, lambda q, k, v, i=i: attend(i, q, k, v), p)
        return rms_norm(x, self.final_norm, self.eps)

    def layer(self, x: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, attend,
              packed: PackedLayer | None = None) -> torch.Tensor:
        """One decoder layer with weights `w` (or their packed layout) over x [n, hidden];
        attend(q, k, v) as in run_layers. -> the layer's output [n, hidden]."""
        n = x.shape[0]
        h = rms_norm(x, w.input_norm, self.eps)
        if packed is not None:
            q, k, v = qkv_products(h, packed)
        else:
            q, k, v = F.linear(h, w.q, w.q_bias), F.linear(h, w.k, w.k_bias), F.linear(h, w.v, w.v_bias)
        q = q.reshape(n, self.n_heads, self.head_dim).transpose(0, 1)        # [H, n, hd]
        k = k.reshape(n, self.n_kv_heads, self.head_dim).transpose(0, 1)     # [KV, n, hd]
        v = v.reshape(n, self.n_kv_heads, self.head_dim).transpose(0, 1)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attn = attend(q, k, v).reshape(n, self.n_heads * self.head_dim)
        x = x + (o_product(attn, packed) if packed is not None else F.linear(attn, w.o, w.o_bias))
        h = rms_norm(x, w.post_norm, self.eps)
        if packed is not None:
            return x + mlp_products(h, packed)
        return x + F.linear(F.silu(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)
