"""zoo.card's agreement with a pruned draft: UV-Prune's choice is the UVPrune stage's, and a draft
shown every visual token through the selected path agrees exactly as with the whole prompt."""

import numpy as np
import torch

from models.decoding import greedy_answer
from models.load import load_model
from stages.prune import UVPrune
from stages.types import Taps
from zoo import WEIGHTS
from zoo.card import PROMPT, agreement, uv_keep
from zoo.train.data import example


def test_uv_keep_is_the_uvprune_stages_choice_and_the_selected_path_matches_the_whole_prompt():
    target = load_model(str(WEIGHTS / "qwen-draft"))          # small and fast: any model of the family will do
    draft = load_model(str(WEIGHTS / "qwen-draft"))
    ex = example(5, 6, 2.0, np.random.default_rng(0))
    layout = target.layout(PROMPT, ex.frames.shape[0], (84, 84), 2.0)
    keep = uv_keep(target, ex.frames, 2.0, 0.9)
    assert keep.numel() == int(np.ceil(0.1 * layout.n_video)) and bool((keep.diff() > 0).all())
    taps = {}
    target.prefill(target.new_cache(), target.embed(layout.ids, target.encode(ex.frames), layout.video_start),
                   layout.positions, taps=[0, 1, 2], on_tap=lambda layer, h: taps.__setitem__(layer, h), logits="none")
    stage = UVPrune(keep=0.1)(None, Taps(taps, layout=layout, model=target.name))["selection"]
    assert torch.equal(stage.keep, keep)
    answer = greedy_answer(target, ex.frames, 2.0, PROMPT, 24)
    whole = agreement(draft, ex.frames, 2.0, answer)
    assert whole == (len(answer), len(answer))                  # the same model agrees with itself everywhere
    assert agreement(draft, ex.frames, 2.0, answer, torch.arange(layout.n_video)) == whole
    pruned = agreement(draft, ex.frames, 2.0, answer, keep)
    assert pruned[1] == len(answer) and pruned[0] <= len(answer)
