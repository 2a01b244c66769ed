"""The one autoregressive loop over the VideoLM protocol: after a prefill, one target step per
token until an end-of-turn token or the token budget. The Generate stage (greedy or sampled), the
model card and the trainer's check all decode through it, so they give the same answer for the
same prompt and frames; greedy is token-identical to transformers' `generate(do_sample=False)`
(tests/models/test_adapters.py, tests/stages/test_generate.py).

    cache, layout, logits = prefill_video(lm, frames, fps, "describe the video .")
    ids = greedy(lm, cache, logits, layout.length, layout, max_new_tokens=64)
    for token in decode(lm, cache, logits, layout.length, layout, 64, pick):   # one at a time
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch


def most_likely(logits: torch.Tensor) -> int:
    """logits [vocab] -> the greedy token (the first on ties, as argmax)."""
    return int(logits.argmax())


def decode(lm, cache, logits: torch.Tensor, start: int, layout, max_new_tokens: int,
           pick: Callable[[torch.Tensor], int] = most_likely) -> Iterator[int]:
    """Yields the answer's tokens one by one. `logits` [vocab]: the prefill's last; `start`: the
    logical index of the first new token (the prompt's logical length: pruned tokens count);
    `pick(logits) -> token`. Stops after a token in `lm.eos_ids` (which is yielded) or after
    `max_new_tokens`. Each token is yielded before the step that scores it, so a consumer can
    publish the first one the moment it is known; the cache grows by one entry per step but the last."""
    position = start
    for n in range(1, max_new_tokens + 1):
        token = pick(logits)
        yield token
        if token in lm.eos_ids or n == max_new_tokens:
            return
        logits = lm.score(cache, torch.tensor([token]), position, layout)[-1]
        position += 1


def greedy(lm, cache, logits: torch.Tensor, start: int, layout, max_new_tokens: int) -> list[int]:
    """The greedy answer after a prefill (see decode)."""
    return list(decode(lm, cache, logits, start, layout, max_new_tokens))


def prefill_video(lm, frames: torch.Tensor, fps: float, prompt: str):
    """(cache, layout, last logits [vocab]) of `prompt` about uint8 `frames` [n, 3, H, W] at `fps`,
    the whole video encoded and prefilled in one shot."""
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
    cache = lm.new_cache()
    logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions)
    return cache, layout, logits


def greedy_answer(lm, frames: torch.Tensor, fps: float, prompt: str, max_new_tokens: int) -> list[int]:
    """The greedy answer's token ids (its end-of-turn token included when it stops on one)."""
    cache, layout, logits = prefill_video(lm, frames, fps, prompt)
    return greedy(lm, cache, logits, layout.length, layout, max_new_tokens)
