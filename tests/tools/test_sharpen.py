"""tools/sharpen.py: a checkpoint whose queries are scaled, i.e. sharper attention."""

import json
import math

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tools.sharpen import main, sharpen
from zoo import WEIGHTS


def test_scaling_the_queries_scales_every_attention_logit(tmp_path):
    main([str(WEIGHTS / "qwen-draft"), str(tmp_path / "sharp"), "--scale", "1.5", "--layers", "0"])
    before = AutoModelForImageTextToText.from_pretrained(WEIGHTS / "qwen-draft", dtype=torch.float32)
    after = AutoModelForImageTextToText.from_pretrained(tmp_path / "sharp", dtype=torch.float32)
    q0, q0s = (m.model.language_model.layers[0].self_attn.q_proj for m in (before, after))
    x = torch.randn(3, q0.in_features)
    torch.testing.assert_close(q0s(x), 1.5 * q0(x), rtol=1e-2, atol=1e-2)        # bf16 weights, as shipped
    rest = [(a, b) for (n, a), (_, b) in zip(before.named_parameters(), after.named_parameters()) if "layers.0.self_attn.q_proj" not in n]
    assert all(torch.equal(a, b) for a, b in rest)
    record = json.loads((tmp_path / "sharp" / "training.json").read_text())
    assert record["sharpened"]["scale"] == 1.5 and record["sharpened"]["layers"] == [0]
    assert (tmp_path / "sharp" / "tokenizer.json").is_file()


def test_a_bad_scale_or_layer_is_refused():
    model = AutoModelForImageTextToText.from_pretrained(WEIGHTS / "qwen-draft", dtype=torch.float32)
    with pytest.raises(ValueError, match="positive"):
        sharpen(model, 0)
    with pytest.raises(ValueError, match="layers 0.."):
        sharpen(model, 1.2, [99])


def test_the_context_dependent_scale_is_one_up_to_the_length_and_grows_past_it():
    from tools.sharpen import logn_factor

    n = torch.tensor([1, 100, 400, 1600])
    torch.testing.assert_close(logn_factor(n, 400, 2.0), torch.tensor([1.0, 1.0, 1.0, (math.log(1600) / math.log(400)) ** 2]),
                               rtol=1e-3, atol=1e-3)
    assert torch.equal(logn_factor(n, 400, 0.0), torch.ones(4))


def test_the_probe_at_power_zero_is_the_plain_model():
    from tools.sharpen import probe_logn
    from zoo.tokenizer import build_tokenizer
    from zoo.train.toy import caption_f1

    (row,) = probe_logn(str(WEIGHTS / "qwen-draft"), 50, [0], [6], range(200, 202))
    plain = AutoModelForImageTextToText.from_pretrained(WEIGHTS / "qwen-draft", dtype=torch.float32)
    assert row["f1"] == round(caption_f1(plain, build_tokenizer("qwen2_5_vl"), range(200, 202), 6.0), 4)
