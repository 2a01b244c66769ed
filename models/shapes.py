"""Real-size models with random weights, for timing: `model.target.path=random:qwen2.5-vl-32b`.

No checkpoint can be downloaded on reelflow's own machines, yet what a GPU costs depends on the
real models' shapes, not their weights. A `random:` path builds the published architecture of a
real checkpoint (layer count, widths, heads, KV heads, vocabulary, vision tower) with randomly
initialised weights, directly on the device and in the dtype asked for, behind the same adapter
as any checkpoint. Its tokenizer, chat template and special-token ids come from the toy zoo's
checkpoint of the same family; the lm_head keeps the real vocabulary's width (its rows past the
toy tokenizer are what a real checkpoint's padding rows are), so decoding pays the real cost.

    lm = load_model("random:qwen2.5-vl-7b", dtype="bfloat16", device="cuda")
    lm = load_model("random:qwen2.5-vl-7b,num_hidden_layers=2,vision.depth=4")   # a smaller variant

On the command line: model.target.path=random:qwen2.5-vl-32b; a variant needs quotes, since Hydra
reads unquoted commas as a sweep: 'model.target.path="random:qwen2.5-vl-7b,num_hidden_layers=8"'.

Text from a random model is noise; use these for time and memory, never for quality.
The shapes are the published config.json values of each checkpoint's text model and vision tower.
"""

from __future__ import annotations

import copy

PREFIX = "random:"

# Text decoders: Qwen2.5 (Qwen2.5-VL) and Qwen2 (LLaVA-OneVision) sizes.
_QWEN25_TEXT = {
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "72b": dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
_QWEN2_TEXT = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": _QWEN25_TEXT["7b"],
    "72b": _QWEN25_TEXT["72b"],
}
# Qwen2.5-VL's window-attention ViT (675 M parameters at every size; its merger projects to the
# text width), and LLaVA-OneVision's SigLIP-so400m at 384 px.
_QWEN25_VISION = dict(depth=32, hidden_size=1280, num_heads=16, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                      tokens_per_second=2)
_QWEN25_VISION_INTERMEDIATE = {"3b": 3420, "7b": 3420, "32b": 3456, "72b": 3456}
_SIGLIP = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16,
               image_size=384, patch_size=14, vision_use_head=False)     # no pooling head: LLaVA reads the states

# name -> (family, text shape, vision shape, preprocessing of the real checkpoint's video input)
SHAPES: dict[str, tuple[str, dict, dict, dict]] = {}
for _size, _text in _QWEN25_TEXT.items():
    SHAPES[f"qwen2.5-vl-{_size}"] = ("qwen2_5_vl", _text,
                                     {**_QWEN25_VISION, "intermediate_size": _QWEN25_VISION_INTERMEDIATE[_size],
                                      "out_hidden_size": _text["hidden_size"]},
                                     {"fps": 2.0, "size": [448, 448]})
for _size, _text in _QWEN2_TEXT.items():
    SHAPES[f"llava-onevision-{_size}"] = ("llava_onevision", _text, dict(_SIGLIP), {"fps": 1.0, "size": [384, 384]})

# The toy checkpoint whose tokenizer, chat template and token ids a random model of a family borrows.
TOKENIZER_OF = {"qwen2_5_vl": "zoo/weights/qwen-target", "llava_onevision": "zoo/weights/llava-target"}


def is_random(path: str) -> bool:
    return str(path).startswith(PREFIX)


def parse(path: str) -> tuple[str, dict]:
    """'random:NAME[,key=value...]' -> (NAME, overrides); values parse as int, float or as given.
    Overrides name text-config fields (num_hidden_layers=2) or vision ones with a `vision.` prefix
    (vision.depth=4); a Qwen tower's full-attention blocks follow its depth."""
    spec = path[len(PREFIX):]
    name, *pairs = [part.strip() for part in spec.split(",")]
    if name not in SHAPES:
        raise KeyError(f"unknown random shape {name!r}; known: {', '.join(sorted(SHAPES))}")
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{path!r}: expected key=value after the shape name, got {pair!r}")
        overrides[key.strip()] = _number(value.strip())
    return name, overrides


def _number(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def build_config(base, name: str, overrides: dict):
    """The toy config `base` (same family) reshaped to SHAPES[name] plus `overrides`."""
    family, text, vision, _ = SHAPES[name]
    if base.model_type != family:
        raise ValueError(f"shape {name!r} is a {family} model; its base config is {base.model_type}")
    config = copy.deepcopy(base)
    text = {**text, **{k: v for k, v in overrides.items() if not k.startswith("vision.")}}
    vision = {**vision, **{k.removeprefix("vision."): v for k, v in overrides.items() if k.startswith("vision.")}}
    unknown = sorted(k for k in text if not hasattr(config.text_config, k)) + \
        sorted(f"vision.{k}" for k in vision if not hasattr(config.vision_config, k))
    if unknown:
        raise ValueError(f"shape {name!r}: no such config fields {unknown}")
    tie = text.pop("tie_word_embeddings")
    for key, value in text.items():
        setattr(config.text_config, key, value)
    if family == "qwen2_5_vl" and "depth" in vision and vision["depth"] != _QWEN25_VISION["depth"]:
        # the real towers attend in full every 8th block (7, 15, 23, 31) and in windows elsewhere
        vision["fullatt_block_indexes"] = list(range(7, vision["depth"], 8)) or [vision["depth"] - 1]
    for key, value in vision.items():
        setattr(config.vision_config, key, value)
    if family == "qwen2_5_vl" and "out_hidden_size" not in overrides and "vision.out_hidden_size" not in overrides:
        config.vision_config.out_hidden_size = config.text_config.hidden_size
    config.text_config.layer_types = ["full_attention"] * config.text_config.num_hidden_layers
    if family == "qwen2_5_vl":
        # MRoPE splits the rotary frequencies into temporal / height / width sections in the real
        # checkpoints' proportions, 1 : 1.5 : 1.5 ([16, 24, 24] for head_dim 128)
        half = config.text_config.hidden_size // config.text_config.num_attention_heads // 2
        config.text_config.rope_parameters = {**config.text_config.rope_parameters,
                                              "mrope_section": [half // 4, 3 * half // 8, 3 * half // 8]}
    if "max_position_embeddings" not in overrides:      # the published context, unless a variant asks for more
        config.text_config.max_position_embeddings = 128000
    config.text_config.tie_word_embeddings = config.tie_word_embeddings = tie
    return config


def preprocess_of(name: str) -> dict:
    """What the real checkpoint's processor gives a video: its frame rate and a frame size."""
    return dict(SHAPES[name][3])
