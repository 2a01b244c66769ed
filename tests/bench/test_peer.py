"""The peer decoder (bench.peer): transformers' Qwen2 decoder built over a VideoLM's own weights is
the same model (its logits are the text decoder's), shares the weights instead of copying them,
and times decode steps over a static cache. Tiny random shapes on the CPU; the timings that mean
something are taken on a GPU by bench_realsize --peer."""

import pytest
import torch

from bench.peer import PeerDecoder
from models.load import load_model
from tests.bench.test_bench_realsize import SMALLER


@pytest.fixture(scope="module")
def lm():
    return load_model(SMALLER, dtype="float32")


@torch.inference_mode()
def test_the_peer_is_the_models_text_decoder_on_its_own_weights(lm):
    peer = PeerDecoder(lm, compile="off")
    ids = torch.randint(0, lm.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    mine = lm.lm_head(lm.text(input_ids=ids).last_hidden_state)
    theirs = peer.model(input_ids=ids).logits
    # the same operations on the same tensors: equal up to a float32 rounding or two of logits ~1
    torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
    assert peer.model.model.layers[0].self_attn.q_proj.weight.data_ptr() == \
        lm.text.layers[0].self_attn.q_proj.weight.data_ptr()
    assert peer.mode == "off" and peer.step_ms(context=64, steps=2, warm=1) > 0


def test_peer_settings_are_checked(lm):
    with pytest.raises(ValueError, match="reduce-overhead"):
        PeerDecoder(lm, compile="fast")
    assert PeerDecoder(lm).mode == "default"          # auto on the CPU: inductor without CUDA graphs
