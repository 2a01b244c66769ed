"""How far a draft head's trees get with its target: speculative decoding run for real (the drafter
and verifier every Sparrow graph uses, `speculative.reference`'s loop), on clips the head never
trained on. The figure is M, the tokens committed per verification round; greedy, so the committed
tokens are the target's own answer, and a mismatch is an error, not a low score.

    m = head_accepted_length(lm, head, frames, fps, prompt, max_new_tokens=48)   # (committed, rounds)
"""

from __future__ import annotations

import torch

from models.decoding import greedy
from models.sampling import Sampling
from speculative.head_draft import HeadDrafter
from speculative.reference import speculative_decode
from speculative.verifier import TargetVerifier

__all__ = ["head_accepted_length", "DEFAULT_TREE"]

DEFAULT_TREE = (10, 6, 2)      # total, depth, top-k: the CPU default (conf/resources/cpu.yaml sparrow_tree)


@torch.inference_mode()
def head_accepted_length(lm, head, frames: torch.Tensor, fps: float, prompt: str, *, max_new_tokens: int,
                         tree: tuple[int, int, int] = DEFAULT_TREE, check: bool = False) -> tuple[int, int]:
    """(tokens committed, verification rounds) of Sparrow's greedy decoding of `prompt` about
    uint8 `frames` [n, 3, H, W]: the head drafts a `tree` (total, depth, top-k) with VATA, the
    target verifies it. check=True also decodes plainly and raises if the tokens differ."""
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
    cache, states = lm.new_cache(), {}
    logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions,
                        taps=(lm.n_layers,), on_tap=lambda layer, h: states.__setitem__(layer, h))
    total, depth, topk = tree
    verifier = TargetVerifier(lm, cache, layout.length, layout, logits, sampling=Sampling(),
                              max_new_tokens=max_new_tokens, vocab=lm.vocabulary)
    drafter = HeadDrafter(lm, head, states[lm.n_layers], layout, total=total, depth=depth, topk=topk,
                          max_new_tokens=max_new_tokens)
    tokens = speculative_decode(verifier, drafter)
    if check:
        cache, plain = lm.new_cache(), None
        logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions)
        plain = greedy(lm, cache, logits, layout.length, layout, max_new_tokens)
        if plain != tokens:
            raise AssertionError(f"speculative decoding gave other tokens than greedy decoding: {tokens} != {plain}")
    return len(tokens), verifier.rounds.rounds
