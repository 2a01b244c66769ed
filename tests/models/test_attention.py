"""The `reelflow` attention function: the same numbers as torch's attention for a few new tokens
over a cache (grouped heads, bottom-right causal, explicit masks), and a model loaded with it
decodes the same tokens as the unmodified model's generate()."""

from __future__ import annotations

import pytest
import torch

from models.attention import causal_attention, grouped_attention, reelflow_mask


def reference(query, key, value, mask, scale):
    group = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("q, k, heads, kv_heads", [(1, 50, 4, 2), (5, 50, 4, 2), (16, 300, 8, 1), (3, 3, 2, 2)])
def test_grouped_attention_matches_sdpa_with_bottom_right_causal_mask(q, k, heads, kv_heads):
    g = torch.Generator().manual_seed(q * k)
    query = torch.randn(1, heads, q, 16, generator=g)
    key, value = torch.randn(1, kv_heads, k, 16, generator=g), torch.randn(1, kv_heads, k, 16, generator=g)
    causal = (torch.arange(k)[None, :] <= torch.arange(q)[:, None] + (k - q))[None, None]
    expected = reference(query, key, value, causal, 0.25)
    torch.testing.assert_close(grouped_attention(query, key, value, None, 0.25), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_attention(query, key, value, causal, 0.25), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q, k, heads, kv_heads", [(40, 100, 4, 2), (64, 64, 4, 4), (33, 500, 8, 1)])
def test_a_long_query_over_a_cache_is_bottom_right_causal(q, k, heads, kv_heads):
    """What a prefill group after earlier ones computes (sdpa with a causal bias, no [q, k] mask)."""
    g = torch.Generator().manual_seed(q + k)
    query = torch.randn(1, heads, q, 16, generator=g)
    key, value = torch.randn(1, kv_heads, k, 16, generator=g), torch.randn(1, kv_heads, k, 16, generator=g)
    causal = (torch.arange(k)[None, :] <= torch.arange(q)[:, None] + (k - q))[None, None]
    torch.testing.assert_close(causal_attention(query, key, value, 0.25), reference(query, key, value, causal, 0.25),
                               rtol=1e-5, atol=1e-5)


def test_a_long_query_under_the_memory_probe_gives_the_same_attention():
    """Inside models.memory.PeakMemory (a dispatch mode on the CPU, which torch's causal-bias tensor
    cannot be made under) a prefill group's attention is the same: a QuickPrefill run measuring its
    groups' memory used to fail there."""
    from models.memory import PeakMemory

    g = torch.Generator().manual_seed(3)
    query = torch.randn(1, 4, 40, 16, generator=g)
    key, value = torch.randn(1, 2, 100, 16, generator=g), torch.randn(1, 2, 100, 16, generator=g)
    want = causal_attention(query, key, value, 0.25)
    with PeakMemory(torch.device("cpu")) as probe:
        got = causal_attention(query, key, value, 0.25)
    assert probe.peak_bytes > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_mask_is_left_to_the_attention_only_under_the_plain_causal_rule():
    assert reelflow_mask(1, 100, 400, cache_position=torch.arange(300, 400)) is None
    padded = torch.ones(1, 400, dtype=torch.bool)
    padded[0, 0] = False
    assert reelflow_mask(1, 100, 400, cache_position=torch.arange(300, 400), attention_mask=padded) is not None


def test_grouped_attention_applies_an_explicit_mask():
    query, key, value = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    mask = torch.rand(1, 1, 3, 10) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(grouped_attention(query, key, value, mask, 0.3), reference(query, key, value, mask, 0.3),
                               rtol=1e-5, atol=1e-5)


def test_a_model_with_reelflow_attention_decodes_like_generate(tmp_path):
    from models.load import load_model
    from zoo.videos import make_video
    from video import read_video
    from tests.models.test_adapters import random_checkpoint

    path = random_checkpoint(tmp_path / "model", "qwen-target", seed=3)
    video = tmp_path / "v.mp4"
    make_video(4, 12, 2, 84, video)
    frames, _ = read_video(str(video), fps=2, size=84)
    ours, plain = load_model(str(path), attn_implementation="reelflow"), load_model(str(path))
    layout = ours.layout("what happened after the red circle appeared ?", frames.shape[0], (84, 84), 2)
    ref = plain.model.generate(**plain.generate_inputs(layout, frames, 2), max_new_tokens=12, do_sample=False)[0, layout.length:]
    cache = ours.new_cache()
    logits = ours.prefill(cache, ours.embed(layout.ids, ours.encode(frames), layout.video_start), layout.positions)
    tokens = [int(logits.argmax())]
    while len(tokens) < 12 and tokens[-1] not in ours.eos_ids:
        tokens.append(int(ours.score(cache, torch.tensor(tokens[-1:]), layout.length + len(tokens) - 1, layout)[-1].argmax()))
    assert tokens == ref.tolist() and len(set(tokens)) > 5
    # k tokens scored in one forward (a verification) give the logits of k one-token steps
    block_cache, step_cache = ours.new_cache(), ours.new_cache()
    embeds = ours.embed(layout.ids, ours.encode(frames), layout.video_start)
    for c in (block_cache, step_cache):
        ours.prefill(c, embeds, layout.positions)
    block = ours.score(block_cache, torch.tensor(tokens[:6]), layout.length, layout)
    steps = torch.cat([ours.score(step_cache, torch.tensor([t]), layout.length + i, layout) for i, t in enumerate(tokens[:6])])
    torch.testing.assert_close(block, steps, rtol=1e-3, atol=1e-3)    # fp32 rounding of logits ~10
    # the prompt prefilled in two spans (a group over a cache: the bottom-right causal path) gives
    # the one-shot prefill's logits
    split = layout.video_start + 40
    two_cache = ours.new_cache()
    ours.prefill(two_cache, embeds[:split], layout.positions[:, :split], logits="none")
    torch.testing.assert_close(ours.prefill(two_cache, embeds[split:], layout.positions[:, split:]),
                               plain.prefill(plain.new_cache(), embeds, layout.positions), rtol=1e-4, atol=1e-4)
