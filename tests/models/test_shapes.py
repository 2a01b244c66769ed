"""Random-weight models of real checkpoints' shapes (models/shapes.py, `random:` paths)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from models import shapes
from models.load import ModelError, load_model, resolve, shared_vocabulary, tokenizer_of

# a few-layer variant of the 7B shape: the same code path, small enough for a CPU test
TINY = ("random:qwen2.5-vl-7b,num_hidden_layers=2,hidden_size=256,intermediate_size=512,num_attention_heads=4,"
        "num_key_value_heads=2,vision.depth=2,vision.hidden_size=128,vision.intermediate_size=256,vision.num_heads=4")


def config_of(name, overrides=None):
    family = shapes.SHAPES[name][0]
    return shapes.build_config(AutoConfig.from_pretrained(resolve(shapes.TOKENIZER_OF[family])), name, overrides or {})


@pytest.mark.parametrize("name, published", [("qwen2.5-vl-7b", 8.29e9), ("qwen2.5-vl-32b", 33.45e9),
                                             ("llava-onevision-7b", 8.03e9)])
def test_a_shape_has_its_checkpoints_parameter_count(name, published):
    with torch.device("meta"):           # no memory: only the count
        model = AutoModelForImageTextToText.from_config(config_of(name), dtype=torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - published) / published < 0.01, n


def test_the_llava_tower_has_no_pooling_head_as_the_real_checkpoints():
    """SigLIP's attention-pooling head is not in LLaVA-OneVision's checkpoints (it reads the
    tower's states): a random tower that had one would time arithmetic the real model never does."""
    assert config_of("llava-onevision-7b").vision_config.vision_use_head is False


def test_qwen_shapes_split_rotary_frequencies_as_the_real_checkpoints():
    text = config_of("qwen2.5-vl-32b").text_config
    assert text.hidden_size // text.num_attention_heads == 128
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert len(text.layer_types) == text.num_hidden_layers == 64


def test_overrides_reach_text_and_vision_and_a_shallower_tower_keeps_a_full_attention_block():
    name, overrides = shapes.parse("random:qwen2.5-vl-7b,num_hidden_layers=3,vision.depth=4,rms_norm_eps=1e-5")
    assert name == "qwen2.5-vl-7b" and overrides == {"num_hidden_layers": 3, "vision.depth": 4, "rms_norm_eps": 1e-5}
    config = config_of(name, overrides)
    assert config.text_config.num_hidden_layers == 3 and len(config.text_config.layer_types) == 3
    assert config.vision_config.depth == 4 and config.vision_config.fullatt_block_indexes == [3]
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 3584


@pytest.mark.parametrize("path, message", [
    ("random:qwen2.5-vl-8b", "unknown random shape 'qwen2.5-vl-8b'; known: "),
    ("random:qwen2.5-vl-7b,layers", "expected key=value"),
    ("random:qwen2.5-vl-7b,no_such_field=1", "no such config fields ['no_such_field']"),
])
def test_a_bad_random_path_is_a_clear_model_error(path, message):
    with pytest.raises(ModelError, match="model path") as info:
        load_model(path)
    assert message in str(info.value)
    if "no such config fields" not in message:       # the tokenizer check reads the path, not the fields
        with pytest.raises(ModelError, match="model path"):
            tokenizer_of(path)


def test_a_random_model_runs_behind_the_adapter_with_the_real_vocabulary_width():
    lm = load_model(TINY)
    again = load_model(TINY)
    assert lm.arch == "qwen2_5_vl" and lm.vocab_size == 152064 and lm.lm_head.out_features == 152064
    assert lm.frame_size == (448, 448) and lm.fps == 2.0
    for a, b in zip(lm.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)                     # seeded: the same weights each time
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model(TINY)
    assert torch.equal(torch.rand(3), expected)      # ... without resetting the caller's random state
    layout = lm.layout("describe the video .", n_frames=2, frame_hw=(448, 448), fps=2.0)
    assert layout.n_video == 256 and layout.positions.shape[0] == 3
    frames = torch.randint(0, 256, (2, 3, 448, 448), dtype=torch.uint8)
    cache = lm.new_cache()
    logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions)
    assert logits.shape == (152064,) and torch.isfinite(logits).all()
    step = lm.score(cache, torch.tensor([int(logits.argmax())]), layout.length, layout)
    assert step.shape == (1, 152064) and lm.cached_length(cache) == layout.length + 1


def test_a_random_model_compares_with_its_family_over_the_toy_tokenizer():
    target = tokenizer_of("random:qwen2.5-vl-32b")
    assert target.vocab_size == 152064
    assert shared_vocabulary(target, tokenizer_of("zoo/weights/qwen-draft")) == len(target.tokenizer)


def test_a_variant_may_ask_for_a_longer_context_than_the_published_one():
    assert config_of("qwen2.5-vl-7b").text_config.max_position_embeddings == 128000
    config = config_of("qwen2.5-vl-7b", {"max_position_embeddings": 262144})
    assert config.text_config.max_position_embeddings == 262144
