"""LLaVA-OneVision behind the VideoLM protocol (transformers' LlavaOnevisionForConditionalGeneration).

Video: each frame goes through the SigLIP tower at its own size (frames must already be
image_size x image_size), the projector, and a 2x2 bilinear pooling, giving
ceil(p / 2)^2 tokens a frame (p = image_size / patch_size); after the last frame the model
appends one learned newline token. Frames are independent, so group-wise encoding equals
whole-video encoding; the newline is added to the last group only.

Positions are 1-D: the prompt's token index; rope_delta is 0.
"""

from __future__ import annotations

import math

import torch

from models.adapter import VideoLM, matrix_weights
from models.preprocess import SIGLIP_MEAN, SIGLIP_STD, siglip_video_pixels


class LlavaOneVision(VideoLM):
    arch = "llava_onevision"

    def __init__(self, model, tokenizer, preprocess: dict, name: str):
        super().__init__(model, tokenizer, preprocess, name)
        self.vision = model.config.vision_config
        self.placeholder_id = model.config.video_token_index
        self.mean = tuple(preprocess.get("image_mean", SIGLIP_MEAN))
        self.std = tuple(preprocess.get("image_std", SIGLIP_STD))
        self.frames_per_step = 1
        self.side = math.ceil(self.vision.image_size // self.vision.patch_size / 2)

    def video_token_count(self, n_frames, frame_hw):
        size = self.vision.image_size
        if tuple(frame_hw) != (size, size):
            raise ValueError(f"{self.name}: frames are {frame_hw[0]}x{frame_hw[1]}, the vision tower takes "
                             f"{size}x{size}; decode to that size")
        return n_frames * self.side * self.side + 1, (n_frames, self.side, self.side)

    def _positions(self, ids, grid, fps):
        return torch.arange(ids.shape[0])[None], 0

    def generate_inputs(self, layout, frames: torch.Tensor, fps: float) -> dict:
        ids = layout.ids[None].to(self.device)
        pixels = siglip_video_pixels(frames, self.mean, self.std)[None]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values_videos": pixels.to(self.device, self.dtype)}

    def encode_flops(self, frames, frame_hw):
        self.video_token_count(frames, frame_hw)                     # the tower's own size, or a clear error
        cfg = self.vision
        tower = self.model.model.vision_tower
        tower = getattr(tower, "vision_model", tower)
        hidden, patches = cfg.hidden_size, (cfg.image_size // cfg.patch_size) ** 2     # tokens a frame
        per_frame = 2 * patches * (matrix_weights(tower.embeddings.patch_embedding)
                                   + matrix_weights(tower.encoder.layers))
        per_frame += 4 * hidden * cfg.num_hidden_layers * patches ** 2            # full attention in each frame
        if getattr(tower, "head", None) is not None:   # SigLIP's pooling head (its output is not used)
            head = tower.head
            # one probe query against every token's key and value; the rest on the probe alone
            per_frame += 2 * (2 * hidden * hidden * patches + 2 * hidden * hidden + matrix_weights(head.mlp))
            per_frame += 4 * hidden * patches
        dropped = self.model.config.vision_feature_select_strategy == "default"    # the first token, a CLS
        per_frame += 2 * (patches - dropped) * matrix_weights(self.model.model.multi_modal_projector)
        return frames * per_frame

    @torch.inference_mode()
    def encode(self, frames, *, last=True):
        pixels = siglip_video_pixels(frames.to(self.device), self.mean, self.std)[None].to(self.dtype)
        out = self.model.model.get_video_features(pixels).pooler_output[0]   # [n * side^2 + 1, d]
        return out if last else out[:-1]
