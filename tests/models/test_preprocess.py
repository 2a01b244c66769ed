"""Pixel preprocessing: Qwen2.5-VL's patch layout (checked by rebuilding frames from patches) and
its temporal padding; normalisation."""

import pytest
import torch

from models.preprocess import normalized, qwen_video_patches


def test_qwen_patches_invert_to_the_frames_and_pad_an_odd_frame_count():
    frames = torch.randint(0, 256, (3, 3, 56, 84), dtype=torch.uint8)
    flat, (t, h, w) = qwen_video_patches(frames, (0, 0, 0), (1, 1, 1))
    assert (t, h, w) == (2, 4, 6) and flat.shape == (2 * 4 * 6, 3 * 2 * 14 * 14)
    # undo: rows are (t, h/2, w/2, 2, 2), columns (c, temporal, 14, 14)
    x = flat.reshape(t, h // 2, w // 2, 2, 2, 3, 2, 14, 14).permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(t * 2, 3, 56, 84)
    torch.testing.assert_close(x[:3], frames.float() / 255)
    torch.testing.assert_close(x[3], x[2])           # the last frame repeated to fill the temporal patch


def test_sizes_that_are_not_a_multiple_of_28_are_refused():
    with pytest.raises(ValueError, match="multiple of 28"):
        qwen_video_patches(torch.zeros(2, 3, 80, 84, dtype=torch.uint8))


def test_normalized():
    x = normalized(torch.full((1, 3, 2, 2), 255, dtype=torch.uint8), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert torch.allclose(x, torch.ones_like(x))
