"""How far a draft head's trees, or a draft model's chains, get with their target: speculative
decoding run for real (the drafters and verifier the Sparrow and vanilla_sd graphs use,
`speculative.reference`'s loop), on clips the draft never trained on. The figure is M, the tokens
committed per verification round; greedy, so the committed tokens are the target's own answer, and
a mismatch is an error, not a low score.

    m = head_accepted_length(lm, head, frames, fps, prompt, max_new_tokens=48)   # (committed, rounds)
    m = draft_accepted_length(lm, draft, frames, fps, prompt, max_new_tokens=48, window=4)
"""

from __future__ import annotations

import torch

from models.decoding import greedy, prefill_video
from models.sampling import Sampling
from speculative.head_draft import HeadDrafter
from speculative.model_draft import ModelDrafter
from speculative.reference import speculative_decode
from speculative.verifier import TargetVerifier

__all__ = ["head_accepted_length", "draft_accepted_length", "DEFAULT_TREE"]

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
        _check_greedy(lm, frames, fps, prompt, max_new_tokens, tokens)
    return len(tokens), verifier.rounds.rounds


@torch.inference_mode()
def draft_accepted_length(lm, draft, frames: torch.Tensor, fps: float, prompt: str, *, max_new_tokens: int,
                          window: int = 4, check: bool = False) -> tuple[int, int]:
    """(tokens committed, verification rounds) of vanilla SD's greedy decoding of `prompt` about
    uint8 `frames` [n, 3, H, W]: `draft` (a VideoLM of the target's family, the whole video in
    its own cache) drafts `window` tokens a round, the target verifies them. check=True also
    decodes plainly and raises if the tokens differ."""
    from models.load import shared_vocabulary

    cache, layout, logits = prefill_video(lm, frames, fps, prompt)
    d_cache, d_layout, d_logits = prefill_video(draft, frames, fps, prompt)
    vocab = shared_vocabulary(lm, draft)
    verifier = TargetVerifier(lm, cache, layout.length, layout, logits, sampling=Sampling(),
                              max_new_tokens=max_new_tokens, vocab=vocab)
    drafter = ModelDrafter(draft, d_cache, d_layout.length, d_layout, d_logits, window=window, sampling=Sampling(),
                           vocab=vocab, max_new_tokens=max_new_tokens)
    tokens = speculative_decode(verifier, drafter)
    if check:
        _check_greedy(lm, frames, fps, prompt, max_new_tokens, tokens)
    return len(tokens), verifier.rounds.rounds


def _check_greedy(lm, frames: torch.Tensor, fps: float, prompt: str, max_new_tokens: int, tokens: list[int]) -> None:
    cache, layout, logits = prefill_video(lm, frames, fps, prompt)
    plain = greedy(lm, cache, logits, layout.length, layout, max_new_tokens)
    if plain != tokens:
        raise AssertionError(f"speculative decoding gave other tokens than greedy decoding: {tokens} != {plain}")
