"""What a draft head's or a draft's training needs in memory, said before it starts, and a setting that cannot
fit refused with the numbers.

The estimate is an upper-bound sketch, not a measurement: the frozen target's weights (loaded), the
head's weights, gradients and Adam moments in fp32, one step's activations (every text and video
position of `batch_examples` examples through one layer and the LM head, twice with MTP), and what
one example's build needs (the target's cache and widest activation over the longest clip).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("reelflow.train")

__all__ = ["check_memory", "free_bytes", "estimate"]

MiB = 2 ** 20


def free_bytes(device: torch.device) -> int:
    """Memory free for this process now: the GPU's free memory, or the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell how much memory is free (no MemAvailable in /proc/meminfo)")


def estimate(lm, head, *, frames: int, size: int, text_tokens: int, batch_examples: int,
             whole_model: bool = False) -> dict[str, int]:
    """Bytes: {"target": its weights, "head": the trained module's weights + gradients + Adam
    moments, "step": one training step's activations, "build": one example's target forward over
    the longest clip}. `head`: a Sparrow head (one layer at the target's width), or with
    `whole_model` a transformers video LM trained whole (a draft: every text layer at its own
    width, and its vision tower over every patch)."""
    config = lm.model.config.get_text_config() if hasattr(lm.model.config, "get_text_config") else lm.model.config
    hidden, vocab = lm.hidden_size, lm.vocabulary
    inter = getattr(config, "intermediate_size", 4 * hidden)
    layers = getattr(config, "num_hidden_layers", lm.n_layers)
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_attention_heads", 1)
    head_dim = hidden // getattr(config, "num_attention_heads", 1)
    video_tokens = lm.layout("x", frames, (size, size), float(max(1, frames))).n_video
    positions = text_tokens + video_tokens
    elem = torch.finfo(lm.dtype).bits // 8
    target = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    head_params = sum(p.numel() for p in head.parameters())
    per_position = 4 * (10 * hidden + 3 * inter) + 4 * 3 * vocab * text_tokens / positions   # fp32, with backward
    step = int(2 * batch_examples * positions * per_position + 2 * batch_examples * positions ** 2 * 4)
    if whole_model:
        step = _model_step(head, positions=positions, text_tokens=text_tokens, frames=frames, size=size,
                           batch_examples=batch_examples)
    build = int(2 * layers * positions * kv * head_dim * elem + 4 * positions * inter * elem
                + positions * vocab * 4)
    return {"target": target, "head": 16 * head_params, "step": step, "build": build}


def _model_step(model, *, positions: int, text_tokens: int, frames: int, size: int, batch_examples: int) -> int:
    """One step's fp32 activations (with backward) of a video LM trained whole: its text layers over
    every position, and its vision tower over every patch of the frames."""
    text = model.config.get_text_config()
    vision = model.config.vision_config
    hidden, inter = text.hidden_size, text.intermediate_size
    per_text = (4 * (10 * hidden + 3 * inter) * text.num_hidden_layers
                + 4 * 3 * text.vocab_size * text_tokens / positions)
    v_hidden = vision.hidden_size
    v_inter = getattr(vision, "intermediate_size", 4 * v_hidden)
    v_layers = getattr(vision, "depth", None) or getattr(vision, "num_hidden_layers", 1)
    patches = frames * (size // vision.patch_size) ** 2
    per_patch = 4 * (10 * v_hidden + 3 * v_inter) * v_layers
    return int(batch_examples * (positions * per_text + patches * per_patch + 2 * positions ** 2 * 4))


def check_memory(lm, head, device: torch.device, *, frames: int, size: int, text_tokens: int,
                 batch_examples: int, recipe: str = "train_sparrow", whole_model: bool = False) -> dict[str, int]:
    """Logs the estimate beside what is free; raises ConfigError when the larger of a step and an
    example's build does not fit in what is free after the target's weights (already loaded)."""
    from graph.spec import ConfigError

    need = estimate(lm, head, frames=frames, size=size, text_tokens=text_tokens, batch_examples=batch_examples,
                    whole_model=whole_model)
    free = free_bytes(device)
    trained = "the draft" if whole_model else "the head"
    log.info("memory on %s: the target's weights %.0f MiB (loaded); " + trained
             + " with its gradients and Adam %.0f MiB; "
             "a training step about %.0f MiB; building an example about %.0f MiB; free now %.0f MiB",
             device, need["target"] / MiB, need["head"] / MiB, need["step"] / MiB, need["build"] / MiB, free / MiB)
    peak = need["head"] + max(need["step"], need["build"])
    if peak > free:
        raise ConfigError(
            f"{recipe}: this setting needs about {peak / MiB:.0f} MiB beyond the target's weights ({trained} "
            f"{need['head'] / MiB:.0f}, a step {need['step'] / MiB:.0f}, an example's build {need['build'] / MiB:.0f}) "
            f"and {device} has {free / MiB:.0f} MiB free: shorten train.clip_seconds, lower train.batch_examples "
            f"or train.size, or train on a larger device")
    return need | {"free": free}
