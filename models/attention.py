"""`reelflow` attention: transformers' sdpa for prefill, plain grouped matmuls for a few new tokens.

With an explicit mask, torch's sdpa leaves its fused kernel, so scoring a few new tokens over a
long cache costs several times one token; a speculative verifier pays that every round. For a query of at most `SMALL_QUERY` tokens this
function computes softmax(q kᵀ · scale + mask) v directly, one matmul per KV head group (no
repeated keys), in float32 softmax. A larger query over a cache it hands to sdpa with a
bottom-right causal bias: a prefill group after earlier ones (QuickPrefill) attends to all of the
cache and causally within itself, which with transformers' [q, k] mask runs in sdpa's slow masked
kernel; the causal bias lets sdpa pick its flash kernel (with the mask, a 4,096-token group over
46K cached entries of a 7B-shaped model took 1.0 s on an H100).
Anything else (padding, other mask rules, training) goes to transformers' own sdpa function.

Registered with transformers' AttentionInterface (and the sdpa mask function) as "reelflow", so a
model loaded with attn_implementation="reelflow" runs it inside its own attention modules:

    load_model(path, attn_implementation="reelflow")      # or model.target.attn_implementation=reelflow
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

NAME = "reelflow"
SMALL_QUERY = 32


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float) -> torch.Tensor:
    """query [b, h, q, d]; key, value [b, kv_h, k, d] (h a multiple of kv_h, heads grouped as
    transformers' repeat_kv lays them out); mask: bool [b, 1, q, k] (True: attend), float (added)
    or None (causal, the q queries being the last q of the k positions). -> [b, q, h, d]."""
    b, h, q, d = query.shape
    kv_heads, k = key.shape[1], key.shape[2]
    group = h // kv_heads
    scores = torch.matmul(query.reshape(b, kv_heads, group * q, d), key.transpose(-1, -2)) * scaling
    scores = scores.view(b, kv_heads, group, q, k).float()                          # [b, kv_h, g, q, k]
    if mask is None and q > 1:        # bottom-right causal: only the last q columns hold masked entries
        future = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)
        scores[..., k - q:] = scores[..., k - q:].masked_fill(future, float("-inf"))
    elif mask is not None:
        mask = mask[:, :, None]                                                       # [b, 1, 1, q, k]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(-1).to(value.dtype).view(b, kv_heads, group * q, k)
    out = torch.matmul(probs, value)                                                  # [b, kv_h, g*q, d]
    return out.view(b, kv_heads, group, q, d).reshape(b, h, q, d).transpose(1, 2)


def sdpa_kernels(device: torch.device):
    """On CUDA, sdpa may use flash, memory-efficient or math kernels, not cuDNN's: cuDNN attention
    builds an execution plan for every new key length, and in decoding, where the cache grows by
    one each step, that host time per layer per token costs more than the step's kernels (1.5 ms
    per layer per token on an H200: a 7B-shaped decode step of 57 ms instead of about 20)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float) -> torch.Tensor:
    """grouped_attention's contract ([b, h, q, d] over [b, kv_h, k, d], bool mask [b, 1, q, k] or
    None for causal) -> [b, q, h, d], for the lean decode path. On the CPU, and for masks and
    several queries, it is grouped_attention (the operations transformers' own attention runs, so
    the lean path matches the model's forward). One query on CUDA takes sdpa's flash kernel with
    grouped heads: cuBLAS's batched products serve one query against a long cache badly (on an
    H200 the lean 7B step stayed flat from 8K to 32K cached tokens with it, where the model's own
    forward grew by two thirds)."""
    if query.device.type == "cuda" and mask is None and query.shape[2] == 1:
        with sdpa_kernels(query.device):
            out = F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2)                                                    # [b, q, h, d]
    return grouped_attention(query, key, value, mask, scaling)


_LAST_ROW: contextvars.ContextVar[dict | None] = contextvars.ContextVar("reelflow_last_row", default=None)


@contextlib.contextmanager
def capture_last_row(layers):
    """Inside the block, attention layers (0-based `layer_idx`) in `layers` record the last query
    token's attention probabilities over all keys, averaged over heads (float32 [k]) into the
    yielded dict: what FastV ranks visual tokens by, without materialising an [n, n] map."""
    captured: dict[int, torch.Tensor] = {}
    token = _LAST_ROW.set({"layers": set(layers), "out": captured})
    try:
        yield captured
    finally:
        _LAST_ROW.reset(token)


def _record_last_row(module, query, key, attention_mask, scale) -> None:
    want = _LAST_ROW.get()
    if not want or getattr(module, "layer_idx", None) not in want["layers"]:
        return
    group = query.shape[1] // key.shape[1]
    q = query[:, :, -1:].float()                                               # [b, h, 1, d]
    k = key.float().repeat_interleave(group, 1)                                # [b, h, k, d]
    scores = (q @ k.transpose(-1, -2))[:, :, 0] * scale                        # [b, h, k]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[:, :, -1, : k.shape[2]], float("-inf"))
    want["out"][module.layer_idx] = scores.softmax(-1).mean(1)[0]


def reelflow_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs):
    """transformers' attention-function signature; returns (output [b, q, h, d], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _record_last_row(module, query, key, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5)

    if dropout or module.training or (query.shape[2] > SMALL_QUERY and attention_mask is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[2] > SMALL_QUERY:       # mask None: the plain causal rule, the query the last q of the keys
        return causal_attention(query, key, value, scaling), None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if attention_mask is not None and attention_mask.shape[-1] != key.shape[2]:
        attention_mask = attention_mask[..., : key.shape[2]]
    return grouped_attention(query, key, value, attention_mask, scale), None


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Bottom-right causal attention of the q queries, the last q of the k keys' positions.
    query [b, h, q, d]; key, value [b, kv_h, k, d]. -> [b, q, h, d]."""
    q, k = query.shape[2], key.shape[2]
    bias = None if q == k else _lower_right_bias(q, k, query.device)
    # grouped heads (as transformers' repeat_kv lays them out) read their shared keys and values in
    # place: a group prefill would otherwise copy the whole cache, heads-per-group times, every layer
    grouped = query.shape[1] != key.shape[1]
    try:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, is_causal=bias is None,
                                                               scale=scaling, enable_gqa=grouped)
    except TypeError:   # a torch whose causal bias takes no enable_gqa: the heads' copies, as transformers makes them
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, is_causal=bias is None,
                                                               scale=scaling)
    return out.transpose(1, 2)


def _lower_right_bias(q: int, k: int, device: torch.device):
    """torch's lower-right causal bias for q queries over k keys, which lets sdpa take its flash
    kernel on a GPU; under a dispatch mode (models.memory.PeakMemory's tensor count on the CPU)
    that tensor subclass cannot be made, and the same rule as a bool mask [q, k] takes its place
    (what torch itself builds for the bias on the CPU)."""
    from torch.nn.attention.bias import causal_lower_right

    try:
        return causal_lower_right(q, k)
    except RuntimeError:
        return torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)


def reelflow_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, local_size=None, **kwargs):
    """sdpa's mask, except for a query over an unpadded cache under the plain causal rule: None,
    which `reelflow_attention` reads as bottom-right causal without building a [q, k] mask
    (building it costs as much as the attention at 8K entries, and it keeps sdpa off its flash kernel)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = kwargs.get("mask_function", causal_mask_function) is causal_mask_function
    if attention_mask is None and local_size is None and plain:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, attention_mask=attention_mask, local_size=local_size,
                     **kwargs)


def register() -> None:
    """Make "reelflow" an attn_implementation transformers knows (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(NAME, reelflow_attention)
    AttentionMaskInterface.register(NAME, reelflow_mask)
