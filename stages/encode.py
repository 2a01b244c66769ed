"""encode: decoded frame groups -> visual tokens, streamed (the vision tower of the model).

A group is encoded as soon as it arrives. Qwen2.5-VL encodes frames two at a time (its temporal
patch), so an odd frame at the end of a group waits for the next group; the video's last group
takes whatever is left (the model repeats its last frame, as its processor does).
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from stages.types import FrameGroup, VisualTokens


class VisionEncoder(Stage):
    """The model's vision tower (and projector) over each frame group.

    model: the model entry (`${model.target}`); fps: the rate the frames were sampled at (the
    decoder's), which Qwen2.5-VL's temporal positions depend on."""

    placement = "gpu"
    inputs = {"group": In(FrameGroup, stream=True)}
    outputs = {"tokens": Out(VisualTokens, stream=True)}

    def __init__(self, model: dict, fps: float):
        if not fps or fps <= 0:
            raise ValueError(f"fps must be the decoder's sampling rate (> 0), got {fps}")
        self.model, self.fps = dict(model), float(fps)
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        self._reset()

    def _reset(self) -> None:
        self.carry, self.frames_in, self.index = None, 0, 0

    def start_run(self, ctx) -> None:      # a new run (the last one may have been cancelled midway)
        self._reset()

    def __call__(self, ctx, group: FrameGroup):
        frames = group.frames if self.carry is None else torch.cat([self.carry, group.frames])
        self.carry = None
        step = self.lm.frames_per_step
        if not group.last and frames.shape[0] % step:
            cut = frames.shape[0] - frames.shape[0] % step
            frames, self.carry = frames[:cut], frames[cut:]
        if frames.shape[0] == 0:
            return {}
        embeds = self.lm.encode(frames, last=group.last)
        ctx.count("flops", self.lm.encode_flops(int(frames.shape[0]), tuple(frames.shape[-2:])))
        meta = {"first_frame": self.frames_in, "frames": int(frames.shape[0]),
                "frame_hw": tuple(frames.shape[-2:]), "fps": self.fps}
        self.frames_in += int(frames.shape[0])
        ctx.emit("tokens", VisualTokens(self.index, embeds, meta, last=group.last))
        self.index += 1
        if group.last:
            self._reset()
        return {}
