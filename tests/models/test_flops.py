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


def test_a_causal_prefill_counts_what_the_same_tokens_cost_one_at_a_time(qwen):
    """New token i of a causal prefill sees the cache and the new tokens up to itself: the very
    keys it sees when the tokens go in one at a time, where no key is masked and torch counts the
    arithmetic itself. So the causal count of 40 tokens (each scored) is torch's count of 40 steps."""
    ids = torch.arange(65) % (qwen.vocab_size - 10) + 5
    positions = torch.arange(65)[None].expand(3, -1)
    cache = qwen.new_cache()
    qwen.prefill(cache, qwen.embed(ids[:25]), positions[:, :25], logits="none")

    def one_at_a_time():
        for i in range(25, 65):
            qwen.prefill(cache, qwen.embed(ids[i:i + 1]), positions[:, i:i + 1], logits="last")

    assert counted(one_at_a_time) == qwen.forward_flops(40, 25, causal=True, logits=40)
    assert qwen.forward_flops(40, 25, causal=True) < qwen.forward_flops(40, 25)      # the masked pairs left out
    # linear in the cache's length: a mean length over the layers is exact
    assert qwen.forward_flops(40, 12.5) * 2 == qwen.forward_flops(40, 0) + qwen.forward_flops(40, 25)
