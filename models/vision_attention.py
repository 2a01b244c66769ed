"""Window attention of the Qwen2.5-VL vision tower, batched by window length.

The tower attends inside windows (112x112 px in most blocks) and inside whole frames (every 8th
block), given as one packed sequence with cumulative boundaries `cu_seqlens`. transformers hands
those boundaries only to flash-attention implementations; with sdpa or eager it splits the
sequence and calls attention once per window: a 32-frame group of 448x448 frames has 256 windows,
so the 7B tower makes ~7000 small attention calls per group. On an H100 that loop, not the
arithmetic, set the encoder's time: 23 s for a 30-min video at 1 fps, where its matrix work
takes ~3 s (bench_quickvideo_gpu's video on one H100).

`packed_sdpa_attention` takes the packed call instead: windows of equal length (nearly all of them)
are gathered into one batch and go through one sdpa call per distinct length. The arithmetic is
sdpa's, window by window, as in transformers' own loop; only the number of calls changes.

transformers routes the packed form to an implementation whose name contains "flash"
(`is_flash_attention_requested`), hence NAME. It is set on the vision config only (the adapter
does this, `vision_attention="packed"`): the language model keeps its own implementation, since
a "flash" name there would change how its masks are built.
"""

from __future__ import annotations

import torch

NAME = "reelflow_packed_flash_api"


def window_batches(cu_seqlens: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """Groups the packed windows by length: [(length L, starts [m] of the m windows that long)],
    lengths ascending. `cu_seqlens` [w + 1] holds the windows' boundaries (0 first, ascending)."""
    cu = cu_seqlens.to("cpu", torch.int64)
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError(f"cu_seqlens must be ascending, got {cu.tolist()[:16]}...")
    return [(int(L), starts[lengths == L]) for L in torch.unique(lengths).tolist() if L > 0]


def packed_sdpa_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask=None, scaling: float | None = None, dropout: float = 0.0,
                          cu_seq_lens_q: torch.Tensor | None = None, cu_seq_lens_k: torch.Tensor | None = None,
                          is_causal: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention within each packed window. query/key/value [1, heads, n, d]; the windows'
    boundaries in `cu_seq_lens_q` (== `cu_seq_lens_k`). Returns ([1, n, heads, d], None), the
    layout transformers' attention implementations return."""
    if attention_mask is not None or is_causal:
        raise ValueError(f"{NAME} is for the vision tower's bidirectional window attention (no mask, not causal)")
    if cu_seq_lens_q is None or (cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q, cu_seq_lens_k)):
        raise ValueError(f"{NAME} needs the packed windows' boundaries (cu_seq_lens_q == cu_seq_lens_k)")
    from models.attention import sdpa_kernels

    _, heads, n, d = query.shape
    out = query.new_empty(n, heads, d)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))          # [n, heads, d]
    with sdpa_kernels(query.device):
        for length, starts in window_batches(cu_seq_lens_q):
            index = (starts[:, None] + torch.arange(length)).to(query.device)    # [m, L] token rows
            qb, kb, vb = (t[index].permute(0, 2, 1, 3) for t in (q, k, v))     # [m, heads, L, d]
            o = torch.nn.functional.scaled_dot_product_attention(
                qb, kb, vb, dropout_p=dropout if module.training else 0.0, scale=scaling)
            out[index] = o.permute(0, 2, 1, 3)                                  # back to [m, L, heads, d]
    return out[None], None


def register() -> None:
    """Makes NAME known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_sdpa_attention)
