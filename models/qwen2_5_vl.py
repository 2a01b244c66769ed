"""Qwen2.5-VL behind the VideoLM protocol (transformers' Qwen2_5_VLForConditionalGeneration).

Video: frames are cut into 14-pixel patches, two frames deep (the temporal patch), and the vision
tower merges 2x2 patches into one token, so a video of n frames at H x W gives
ceil(n / 2) * (H / 28) * (W / 28) tokens. The tower attends within one temporal patch at a time,
so encoding a video group by group gives the same tokens as encoding it whole, provided each
group but the last has an even number of frames (the encode stage carries an odd frame over).

Positions are 3-D (temporal, height, width) and come from the model's own `get_rope_index` on
the whole unpruned prompt, with `mm_token_type_ids` given explicitly: without them transformers
5 silently falls back to 1-D positions (docs/design.md, pitfall 1).
"""

from __future__ import annotations

import math

import torch

from models.adapter import VideoLM, matrix_weights
from models.preprocess import CLIP_MEAN, CLIP_STD, qwen_video_patches


class QwenVL(VideoLM):
    arch = "qwen2_5_vl"

    def __init__(self, model, tokenizer, preprocess: dict, name: str):
        super().__init__(model, tokenizer, preprocess, name)
        self.vision = model.config.vision_config
        if "flash" not in (self.vision._attn_implementation or ""):
            # window attention in one call per window length, not one per window (models/vision_attention.py)
            from models.vision_attention import NAME, register

            register()
            self.vision._attn_implementation = NAME
        self.placeholder_id = model.config.video_token_id
        self.mean = tuple(preprocess.get("image_mean", CLIP_MEAN))
        self.std = tuple(preprocess.get("image_std", CLIP_STD))
        self.frames_per_step = self.vision.temporal_patch_size

    def video_token_count(self, n_frames, frame_hw):
        unit = self.vision.patch_size * self.vision.spatial_merge_size
        h, w = frame_hw
        if h % unit or w % unit:
            raise ValueError(f"{self.name}: frames of {h}x{w} are not a multiple of {unit} pixels; "
                             f"decode to a size that is (e.g. {round(h / unit) * unit}x{round(w / unit) * unit})")
        t = math.ceil(n_frames / self.vision.temporal_patch_size)
        grid = (t, h // self.vision.patch_size, w // self.vision.patch_size)
        return t * (h // unit) * (w // unit), grid

    def _positions(self, ids, grid, fps):
        types = (ids == self.placeholder_id).int() * 2            # 0 text, 2 video
        with torch.inference_mode():
            pos, delta = self.model.model.get_rope_index(
                ids[None], mm_token_type_ids=types[None], video_grid_thw=torch.tensor([grid]),
                second_per_grid_ts=torch.tensor([self.vision.temporal_patch_size / fps]))
        pos = pos[:, 0, :]                                        # [3, L]
        # New tokens continue from the prompt's last position, as generate() does. That equals the
        # model's rope_deltas (max position + 1 - L) when the text after the video sits beyond the
        # video's largest temporal position (original Qwen2.5-VL); transformers 5's get_rope_index
        # starts that text after max(h, w) / merge only, so on a long video the video's temporal
        # positions exceed the last text position and rope_deltas would jump decoding far ahead
        # of what generate() and training use (a 30-s toy video then diverges within a few tokens).
        return pos, int(pos[:, -1].max()) + 1 - ids.shape[0]

    def generate_inputs(self, layout, frames: torch.Tensor, fps: float) -> dict:
        """The same prompt as `model.generate()` takes it (for checks against the unmodified model)."""
        # uint8 frames cross to the device (4x fewer bytes than float32 patches), normalised there
        flat, grid = qwen_video_patches(frames.to(self.device), self.mean, self.std, patch=self.vision.patch_size,
                                        temporal=self.vision.temporal_patch_size, merge=self.vision.spatial_merge_size)
        ids = layout.ids[None].to(self.device)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values_videos": flat.to(self.device, self.dtype),
                "video_grid_thw": torch.tensor([grid], device=self.device),
                "second_per_grid_ts": torch.tensor([self.vision.temporal_patch_size / fps], device=self.device),
                "mm_token_type_ids": (ids == self.placeholder_id).int() * 2}

    def encode_flops(self, frames, frame_hw):
        tower, cfg = self.model.model.visual, self.vision
        merge, patch = cfg.spatial_merge_size, cfg.patch_size
        h, w = frame_hw[0] // patch, frame_hw[1] // patch
        steps = math.ceil(frames / cfg.temporal_patch_size)          # temporal patches: an odd last frame repeats
        patches = steps * h * w
        # window blocks attend within windows of `side` x `side` merged units, tiled from the
        # top-left (the last row and column cut short); full blocks within each temporal patch
        side = cfg.window_size // merge // patch
        full_blocks = len(cfg.fullatt_block_indexes)
        window_pairs = merge ** 4 * _tiled_squares(h // merge, side) * _tiled_squares(w // merge, side)
        pairs = full_blocks * (h * w) ** 2 + (cfg.depth - full_blocks) * window_pairs    # query-key pairs, a step
        attention = 4 * cfg.hidden_size * steps * pairs
        merged = patches // merge ** 2
        return (2 * patches * (matrix_weights(tower.patch_embed) + matrix_weights(tower.blocks))
                + 2 * merged * matrix_weights(tower.merger) + attention)

    @torch.inference_mode()
    def encode(self, frames, *, last=True):
        # uint8 frames cross to the device (4x fewer bytes than float32 patches), normalised there
        flat, grid = qwen_video_patches(frames.to(self.device), self.mean, self.std, patch=self.vision.patch_size,
                                        temporal=self.vision.temporal_patch_size, merge=self.vision.spatial_merge_size)
        # the grid goes where the tower runs: it computes rotary positions from it on its device
        out = self.model.model.get_video_features(flat.to(self.device, self.dtype), torch.tensor([grid], device=self.device))
        return out.pooler_output[0]


def _tiled_squares(n: int, side: int) -> int:
    """Sum of the squared lengths of the pieces `side` long (the last one shorter) that cover n."""
    return sum(min(side, n - start) ** 2 for start in range(0, n, side))
