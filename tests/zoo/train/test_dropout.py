"""zoo.train.dropout: the training step's visual-token dropout shows the model what a draft's
SelectedPrefill shows it at inference: the kept visual tokens at their own positions."""

import numpy as np
import pytest
import torch

from models.load import adapt
from zoo.shapes import zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train.data import Batches, example, model_inputs, shifted_positions
from zoo.train.dropout import answer_starts, keep_mask, uv_token_scores
from zoo.train.toy import preprocessor_config


def test_keep_mask_keeps_the_text_and_the_highest_scored_share_of_each_rows_video():
    is_video = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0],
                             [0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    scores = torch.arange(13.0).flip(0).expand(2, 13)         # earlier tokens score higher
    keep = keep_mask(is_video, scores, torch.tensor([0.3, 1.0]))
    assert keep[0].tolist() == [True, True, True, True] + [False] * 7 + [True, True]   # ⌈0.3·10⌉ = 3, not 4
    assert keep[1].all()                                       # fraction 1: everything
    keep = keep_mask(is_video, scores, torch.tensor([0.01, 0.1]))
    assert keep[0, 1:11].sum() == 1 and keep[1, 2:6].sum() == 1  # at least one token


def test_batches_draw_the_dropped_share_and_its_fractions_and_leave_other_batches_as_they_were():
    plain = next(iter(Batches("qwen-draft", 4, (3, 3), 0)))
    dropping = next(iter(Batches("qwen-draft", 64, (3, 3), 0, visual_drop=0.5, visual_keep=(0.2, 0.4),
                                 visual_uv_share=0.5)))
    assert "keep_fraction" not in plain
    f, uv = dropping["keep_fraction"], dropping["keep_by_uv"]
    assert 10 < int((f < 1).sum()) < 54 and bool(((f == 1) | ((f >= 0.2) & (f <= 0.4))).all())
    assert not bool(uv[f == 1].any()) and bool(uv.any())
    assert dropping["keep_noise"].shape == dropping["input_ids"].shape


@pytest.mark.parametrize("name", ["qwen-draft", "llava-draft"])
def test_a_masked_training_forward_is_the_selected_prefill_of_the_kept_tokens_at_their_positions(name):
    """The step drops tokens from the attention mask and keeps the whole prompt's positions; the
    answer's logits must be those of the adapter's prefill of only the kept tokens at their own
    positions (what SelectedPrefill runs) followed by the answer."""
    torch.manual_seed(0)
    config = zoo_config(name)
    tok = build_tokenizer(config.model_type)
    from transformers import AutoModelForImageTextToText

    net = AutoModelForImageTextToText.from_config(config).eval()
    ex = example(1_000_005, 4, 2.0 if config.model_type == "qwen2_5_vl" else 1.0, np.random.default_rng(0))
    batch = model_inputs(config, tok, [ex], with_answers=True)
    batch = {k: v for k, v in batch.items() if k not in ("cell_labels", "event_labels", "ground_mask", "chain_mask")}
    video_id = config.video_token_id if config.model_type == "qwen2_5_vl" else config.video_token_index
    is_video = batch["input_ids"] == video_id
    keep = keep_mask(is_video, torch.rand(is_video.shape), torch.tensor([0.3]))
    positions = shifted_positions(net, batch, torch.zeros_like(batch["input_ids"]))
    with torch.no_grad():
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask")}
        masked = net(**inputs, position_ids=positions, attention_mask=batch["attention_mask"] * keep).logits[0]
        lm = adapt(net, tok, preprocessor_config(config.model_type))
        layout = lm.layout(ex.prompt, ex.frames.shape[0], tuple(ex.frames.shape[-2:]), ex.fps)
        kept = keep[0, layout.video].nonzero()[:, 0]
        rows = torch.cat([torch.arange(layout.video_start), layout.video_start + kept,
                          torch.arange(layout.video_start + layout.n_video, layout.length)])
        embeds = lm.embed(layout.ids, lm.encode(ex.frames), layout.video_start)
        first = lm.prefill(lm.new_cache(), embeds[rows], layout.positions[:, rows])
        cache = lm.new_cache()
        lm.prefill(cache, embeds[rows], layout.positions[:, rows], logits="none")
        answer = batch["input_ids"][0, layout.length:]
        rest = lm.score(cache, answer[:-1], layout.length, layout)
    selected = torch.cat([first[None], rest])
    assert torch.allclose(masked[layout.length - 1:-1], selected, atol=1e-4)
    whole = net(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    assert not torch.allclose(whole[layout.length - 1:-1], selected, atol=1e-3)    # the dropout did something


def test_uv_token_scores_are_uv_prunes_on_each_rows_video_and_query():
    from stages.prune import uv_scores

    torch.manual_seed(0)
    hidden = [torch.randn(2, 12, 8) for _ in range(3)]
    is_video = torch.zeros(2, 12, dtype=torch.bool)
    is_video[0, 2:7] = True
    is_video[1, 1:4] = True
    labels = torch.full((2, 12), -100)
    labels[0, 9:] = 1
    labels[1, 6:11] = 1
    assert answer_starts(labels).tolist() == [9, 6]
    found = uv_token_scores(hidden, is_video, answer_starts(labels), (0, 2))
    expected = uv_scores({i: h[0] for i, h in enumerate(hidden)}, slice(2, 7), torch.arange(7, 9), [0, 1, 2])
    assert torch.allclose(found[0, 2:7], expected, atol=1e-5) and found[0, :2].eq(0).all()
    expected = uv_scores({i: h[1] for i, h in enumerate(hidden)}, slice(1, 4), torch.arange(4, 6), [0, 1, 2])
    assert torch.allclose(found[1, 1:4], expected, atol=1e-5)
