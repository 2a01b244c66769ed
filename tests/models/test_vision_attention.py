"""The Qwen2.5-VL tower's window attention batched by window length (models/vision_attention.py)."""

import pytest
import torch

from models import vision_attention
from models.load import load_model

# the 7B tower's windows (112 px) and full-attention blocks, at a few layers and a small width
TOWER = ("random:qwen2.5-vl-7b,num_hidden_layers=1,hidden_size=128,intermediate_size=256,num_attention_heads=2,"
         "num_key_value_heads=1,vision.depth=8,vision.hidden_size=64,vision.intermediate_size=128,vision.num_heads=2")


def test_windows_are_grouped_by_length_with_their_starts():
    cu = torch.tensor([0, 4, 8, 10, 14, 14, 17], dtype=torch.int32)
    groups = vision_attention.window_batches(cu)
    assert [(length, starts.tolist()) for length, starts in groups] == [(2, [8]), (3, [14]), (4, [0, 4, 10])]


def test_packed_attention_equals_attention_window_by_window():
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 10, 13, 18, 25])
    q, k, v = (torch.randn(1, 3, 25, 8) for _ in range(3))
    module = torch.nn.Module()
    out, _ = vision_attention.packed_sdpa_attention(module, q, k, v, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    assert out.shape == (1, 25, 3, 8)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.3)
        torch.testing.assert_close(out[:, a:b], ref.transpose(1, 2))


def test_it_refuses_what_is_not_window_attention():
    q = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="bidirectional"):
        vision_attention.packed_sdpa_attention(torch.nn.Module(), q, q, q, is_causal=True, cu_seq_lens_q=cu)
    with pytest.raises(ValueError, match="boundaries"):
        vision_attention.packed_sdpa_attention(torch.nn.Module(), q, q, q)


def test_the_qwen_adapter_encodes_as_transformers_own_window_loop(monkeypatch):
    from transformers import AttentionInterface

    lm = load_model(TOWER)
    assert lm.vision._attn_implementation == vision_attention.NAME       # the tower only
    assert lm.text_config._attn_implementation == "sdpa"
    calls = []

    def counted(*args, **kwargs):
        calls.append(len(kwargs["cu_seq_lens_q"]) - 1)
        return vision_attention.packed_sdpa_attention(*args, **kwargs)

    AttentionInterface.register(vision_attention.NAME, counted)
    try:
        frames = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8)   # 4 windows of 64 patches per step
        packed = lm.encode(frames)
    finally:
        vision_attention.register()
    # transformers still hands the packed windows to it: one call per block, not one per window
    # (2 temporal steps of 4 windows in the windowed blocks, 2 whole steps in the last, full, one)
    assert calls == [8] * 7 + [2]
    lm.vision._attn_implementation = "sdpa"                               # transformers: one call per window
    torch.testing.assert_close(packed, lm.encode(frames))
