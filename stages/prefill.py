"""prefill: the prompt (text + visual tokens) into the model's KV cache.

    Prefill(mode="one_shot")   waits for the whole video, then one forward over the prompt
    Prefill(mode="groups")     prefills each visual-token group as it arrives (the prefix text
                               with the first), then the text after the video: decoding and
                               encoding overlap the prefill (QuickVideo's group prefill, unpruned)

Every token is prefilled at its position in the unpruned prompt (models.adapter.Layout), so
both modes give the same cache up to float rounding, and the same tokens as generate().
The result is a KV: the cache, its logical length, the layout and the last token's logits.
"""

from __future__ import annotations

import torch

from graph.stage import In, Out, Stage
from models.registry import get_model
from stages.types import KV, Request, VisualTokens

DEFAULT_PROMPT = "describe the video ."


class ContextTooLong(ValueError):
    pass


class Prefill(Stage):
    placement = "gpu"
    inputs = {"tokens": In(VisualTokens, stream=True), "request": In(Request)}
    outputs = {"kv": Out(KV)}

    def __init__(self, model: dict, mode: str = "one_shot", max_new_tokens: int = 256):
        if mode not in ("one_shot", "groups"):
            raise ValueError(f"mode must be one_shot or groups, got {mode!r}")
        self.model, self.mode, self.max_new_tokens = dict(model), mode, max_new_tokens
        self.lm = None

    def setup(self, ctx) -> None:
        self.lm = get_model(self.model, ctx.device)
        self._reset()

    def _reset(self) -> None:
        self.groups, self.frames, self.cache, self.done, self.video_done = [], 0, None, 0, 0
        self.meta = None

    def _layout(self, request: Request, frames: int):
        prompt = request.prompt if request and request.prompt else DEFAULT_PROMPT
        return self.lm.layout(prompt, frames, self.meta["frame_hw"], self.meta["fps"])

    def __call__(self, ctx, tokens: VisualTokens, request: Request):
        self.meta = self.meta or tokens.meta
        self.frames += tokens.meta["frames"]
        if self.mode == "one_shot":
            self.groups.append(tokens.embeds)
            return {}
        # groups: the prefix text (first time) and this group, at their positions in the full prompt
        layout = self._layout(request, self.frames)
        self._check_context(layout)
        if self.cache is None:
            self.cache = self.lm.new_cache()
        n = tokens.embeds.shape[0]
        stop = layout.video_start + self.video_done + n
        offset = layout.video_start + self.video_done - self.done     # where this group's rows start in the span
        embeds = self.lm.embed(layout.ids[self.done:stop], tokens.embeds, offset)
        self.lm.prefill(self.cache, embeds, layout.positions[:, self.done:stop], logits="none")
        self.video_done, self.done = self.video_done + n, stop
        return {}

    def finish(self, ctx):
        request = ctx.request
        layout = self._layout(request, self.frames)
        self._check_context(layout)
        if self.mode == "one_shot":
            video = torch.cat(self.groups)
            self.cache = self.lm.new_cache()
            logits = self.lm.prefill(self.cache, self.lm.embed(layout.ids, video, layout.video_start), layout.positions)
        else:
            logits = self.lm.prefill(self.cache, self.lm.embed(layout.ids[self.done:]), layout.positions[:, self.done:])
        kv = KV(self.cache, layout.length, {"layout": layout, "logits": logits, "model": self.lm.name,
                                            "n_video_tokens": layout.n_video, "frames": self.frames})
        self._reset()
        return {"kv": kv}

    def _check_context(self, layout) -> None:
        limit = getattr(self.lm.text_config, "max_position_embeddings", None)
        # tokens held (what memory and attention pay) and positions used (MRoPE compresses them)
        need = max(layout.length, int(layout.positions.max()) + 1) + self.max_new_tokens
        if limit and need > limit:
            raise ContextTooLong(
                f"the prompt needs a context of {need} ({layout.n_video} visual tokens from {self.frames} frames "
                f"+ {self.max_new_tokens} new tokens), beyond {self.lm.name}'s context of {limit}: sample fewer frames "
                "(graph.nodes.decode.stage.fps=..., or num_frames=...) or prefill in groups with KV pruning "
                "(QuickPrefill)")
