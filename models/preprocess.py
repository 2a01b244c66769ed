"""Pixel preprocessing for the two model families, as pure functions on uint8 frames.

transformers' own video processors need torchvision, which has no build matching the CPU torch
these machines use, so the two steps they perform for video are written here, following the
processors' documented output layout (and tested against the models: a wrong layout makes a
model's placeholder count or its outputs disagree).

    pixels, grid = qwen_video_patches(frames, mean, std)      # Qwen2.5-VL: flattened patches + (t, h, w)
    pixels = siglip_video_pixels(frames, mean, std)           # LLaVA-OneVision: [n, 3, H, W] normalised
"""

from __future__ import annotations

import torch

CLIP_MEAN, CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN, SIGLIP_STD = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)


def normalized(frames: torch.Tensor, mean, std) -> torch.Tensor:
    """uint8 [n, 3, H, W] -> float32 [n, 3, H, W], (x / 255 - mean) / std per channel."""
    x = frames.to(torch.float32).div_(255.0)
    mean = torch.tensor(mean, dtype=torch.float32, device=frames.device).view(1, 3, 1, 1)
    std = torch.tensor(std, dtype=torch.float32, device=frames.device).view(1, 3, 1, 1)
    return x.sub_(mean).div_(std)


def qwen_video_patches(frames: torch.Tensor, mean=CLIP_MEAN, std=CLIP_STD, *, patch: int = 14,
                       temporal: int = 2, merge: int = 2) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [n, 3, H, W] -> (float32 [t*h*w, 3*temporal*patch*patch], (t, h, w)).

    t = ceil(n / temporal) (a short last patch repeats the last frame, as Qwen's processor does);
    h, w = H / patch, W / patch, both multiples of `merge`. Rows come in merge-window order: for
    each temporal patch, each merge x merge block of patches (row-major), its patches row-major,
    which is the order the vision tower's patch merger expects.
    """
    n, c, height, width = frames.shape
    if height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"frames of {height}x{width} are not a multiple of {patch * merge} pixels "
                         f"(patch {patch} x merge {merge}); decode to a size that is")
    x = normalized(frames, mean, std)
    if n % temporal:
        x = torch.cat([x, x[-1:].expand(temporal - n % temporal, -1, -1, -1)])
    t, h, w = x.shape[0] // temporal, height // patch, width // patch
    x = x.reshape(t, temporal, c, h // merge, merge, patch, w // merge, merge, patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)          # t, hb, wb, hm, wm, c, temporal, py, px
    return x.reshape(t * h * w, c * temporal * patch * patch).contiguous(), (t, h, w)


def siglip_video_pixels(frames: torch.Tensor, mean=SIGLIP_MEAN, std=SIGLIP_STD) -> torch.Tensor:
    """uint8 [n, 3, H, W] -> float32 [n, 3, H, W] normalised (frames already at the tower's size)."""
    return normalized(frames, mean, std)
