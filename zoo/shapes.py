"""The toy zoo's model shapes: real transformers configs (Qwen2.5-VL and LLaVA-OneVision) shrunk
to a few million parameters, sized for the toy world.

Frames are 84x84: Qwen2.5-VL's 14-pixel patches merged 2x2 make one visual token per 28x28
cell, i.e. one token per cell of the world's 3x3 board, 9 tokens per temporal patch of 2 frames;
LLaVA-OneVision's SigLIP patches (6x6) pooled 2x2 by the model make the same 9 per frame, plus
the one newline token the model appends after a video. At the zoo's frame rates (Qwen 2 fps,
LLaVA 1 fps) both see 9 visual tokens per second of video.

    config = zoo_config("qwen-target")     # a Qwen2_5_VLConfig, random weights via from_config
"""

from __future__ import annotations

from zoo.tokenizer import PAD_TO, build_tokenizer

FRAME_SIZE = 84
FPS = {"qwen2_5_vl": 2.0, "llava_onevision": 1.0}

# name -> (architecture, text shape, vision shape)
SHAPES = {
    "qwen-target": ("qwen2_5_vl", dict(hidden=256, layers=6, heads=4, kv_heads=2, mlp=768),
                    dict(hidden=128, depth=2, heads=4, mlp=384)),
    "qwen-draft": ("qwen2_5_vl", dict(hidden=128, layers=2, heads=2, kv_heads=1, mlp=384),
                   dict(hidden=64, depth=1, heads=2, mlp=192)),
    "llava-target": ("llava_onevision", dict(hidden=256, layers=6, heads=4, kv_heads=2, mlp=768),
                     dict(hidden=128, depth=2, heads=4, mlp=384)),
    "llava-draft": ("llava_onevision", dict(hidden=128, layers=2, heads=2, kv_heads=1, mlp=384),
                    dict(hidden=64, depth=1, heads=2, mlp=192)),
}


# Rotary base, as in the real checkpoints (Qwen2.5-VL and LLaVA-OneVision's Qwen2: 1e6). With
# 10000 (the zoo's first base) the toy Qwen2.5-VL's temporal section, the 8 highest of its 32
# frequencies, has a slowest period of 2*pi*10000**(7/32) = 47 positions, i.e. 47 s of video, so
# order is aliased beyond that; 1e6 gives 129 (real Qwen2.5-VL, head 128 with 16 temporal
# frequencies: 160). A checkpoint keeps its own (the first zoo's LLaVA pair has 10000).
ROPE_THETA = 1e6


def zoo_config(name: str, rope_theta: float | None = None):
    """The transformers config of zoo model `name` (see SHAPES), with rotary base `rope_theta`
    (default ROPE_THETA)."""
    if name not in SHAPES:
        raise ValueError(f"no toy model {name!r}; the zoo has {', '.join(SHAPES)}")
    arch, text, vision = SHAPES[name]
    tok = build_tokenizer(arch)
    theta = float(rope_theta or ROPE_THETA)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    text_config = dict(
        vocab_size=PAD_TO, hidden_size=text["hidden"], num_hidden_layers=text["layers"],
        num_attention_heads=text["heads"], num_key_value_heads=text["kv_heads"],
        intermediate_size=text["mlp"], max_position_embeddings=65536, rms_norm_eps=1e-6,
        tie_word_embeddings=True, **ids)
    if arch == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig

        head_dim = text["hidden"] // text["heads"]
        # MRoPE splits each head's rotary half into (temporal, height, width) sections
        t = head_dim // 2 - 2 * (3 * head_dim // 16)
        text_config["rope_parameters"] = {"rope_type": "default", "rope_theta": theta,
                                          "mrope_section": [t, 3 * head_dim // 16, 3 * head_dim // 16]}
        return Qwen2_5_VLConfig(
            text_config=text_config,
            vision_config=dict(depth=vision["depth"], hidden_size=vision["hidden"], num_heads=vision["heads"],
                               intermediate_size=vision["mlp"], out_hidden_size=text["hidden"], patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                               fullatt_block_indexes=[vision["depth"] - 1],
                               tokens_per_second=1),   # temporal position advances 1 per second of video
            video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
            image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
            vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
            tie_word_embeddings=True, **ids)
    from transformers import LlavaOnevisionConfig

    text_config.update(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": theta})
    return LlavaOnevisionConfig(
        text_config=text_config,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=vision["hidden"],
                           num_hidden_layers=vision["depth"], num_attention_heads=vision["heads"],
                           intermediate_size=vision["mlp"], image_size=FRAME_SIZE, patch_size=14),
        video_token_index=tok.convert_tokens_to_ids("<video>"),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-1, vision_feature_select_strategy="full",
        tie_word_embeddings=True, **ids)
