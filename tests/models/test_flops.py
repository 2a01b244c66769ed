"""The models' arithmetic counts (`encode_flops`, `forward_flops`) against torch's own count of the
same calls: FlopCounterMode adds up every matrix product and convolution the call dispatches. The
attention kernels are held to sdpa's math path, whose products FlopCounterMode sees on a CPU (it
has no rule for the fused CPU kernel); the count is the same arithmetic whichever kernel does it."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models.load import load_model
from models.qwen2_5_vl import _tiled_squares


def counted(call) -> int:
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


@pytest.fixture(scope="module")
def qwen():
    return load_model("zoo/weights/qwen-target", lean=False)


@pytest.fixture(scope="module")
def llava():
    return load_model("zoo/weights/llava-target", lean=False)


def frames(n: int, hw: tuple[int, int]) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, *hw), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("n, hw", [(4, (84, 84)), (3, (252, 196)), (2, (56, 448))],
                         ids=["one-window", "cut-windows-odd-frames", "wide"])
def test_qwen_encode_flops_are_what_the_tower_computes(qwen, n, hw):
    """252x196: 9x7 merged units in 4x4 windows, the last row and column cut short; an odd frame
    count repeats the last frame into a third temporal patch."""
    assert qwen.encode_flops(n, hw) == counted(lambda: qwen.encode(frames(n, hw)))


def test_llava_encode_flops_are_what_the_tower_computes(llava):
    size = (llava.vision.image_size,) * 2
    assert llava.encode_flops(3, size) == counted(lambda: llava.encode(frames(3, size)))
    with pytest.raises(ValueError, match="decode to that size"):
        llava.encode_flops(3, (100, 100))


def test_windows_tile_from_the_top_left_with_the_last_cut_short():
    assert _tiled_squares(9, 4) == 16 + 16 + 1 and _tiled_squares(8, 4) == 32 and _tiled_squares(3, 4) == 9


@pytest.mark.parametrize("name", ["qwen", "llava"])
def test_a_prefill_does_the_forward_flops_of_its_tokens(name, request):
    """A prompt of 40 tokens after 25 cached ones, logits for the last token only: the decoder's
    count without the LM head, the head once, and attention over the whole square (math sdpa
    computes the masked half too; a causal kernel skips it: `causal=True` counts that)."""
    lm = request.getfixturevalue(name)
    ids = torch.arange(65) % (lm.vocab_size - 10) + 5
    cache = lm.new_cache()
    positions = torch.arange(65)[None].expand(3 if lm.arch == "qwen2_5_vl" else 1, -1)
    lm.prefill(cache, lm.embed(ids[:25]), positions[:, :25], logits="none")
    done = counted(lambda: lm.prefill(cache, lm.embed(ids[25:]), positions[:, 25:], logits="last"))
    assert done == lm.forward_flops(40, 25, logits=1)
    assert lm.forward_flops(40, 25) - done == 39 * 2 * lm.lm_head.weight.numel()      # the head on every token


def test_causal_counts_leave_out_the_masked_half_of_the_new_square(qwen):
    cfg = qwen.text_config
    per_pair = qwen.n_layers * cfg.num_attention_heads * 2 * (cfg.hidden_size // cfg.num_attention_heads) * 2
    masked = 40 * 39 // 2                                  # pairs (i, j) of new tokens with j > i
    assert qwen.forward_flops(40, 25) - qwen.forward_flops(40, 25, causal=True) == masked * per_pair
    assert qwen.forward_flops(1, 25, causal=True) == qwen.forward_flops(1, 25)      # one token sees all
    # linear in the cache's length: a mean length over the layers is exact
    assert qwen.forward_flops(40, 12.5) * 2 == qwen.forward_flops(40, 0) + qwen.forward_flops(40, 25)
