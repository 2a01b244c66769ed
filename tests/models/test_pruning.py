"""The pruning math (models/pruning.py) on hand-made tensors: how many entries a share keeps, the
per-layer shares, what each score ranks high, UV-Prune's variation and SpecVLM's spread."""

from __future__ import annotations

import pytest
import torch

from models.pruning import (attention_entry_scores, attention_guided_keep, keep_count, keep_top, key_norm_scores,
                            layer_ratios, top_k_indices, uv_scores, value_change_scores, value_norm_scores)


@pytest.mark.parametrize("n, keep, k", [(10, 0.5, 5), (7, 0.5, 4), (30, 0.1, 3), (1, 0.1, 1), (27, 1.0, 27),
                                        (27, 0.2, 6), (100, 0.3, 30), (50, 0.01, 1), (10, 1e-12, 1), (0, 0.5, 0)])
def test_keep_count_is_the_ceiling_of_keep_times_n_and_at_least_one(n, keep, k):
    assert keep_count(n, keep) == k


@pytest.mark.parametrize("keep", [0, -0.5, 1.5])
def test_keep_count_refuses_shares_outside_zero_one(keep):
    with pytest.raises(ValueError, match=r"keep \(the share kept\) must be in \(0, 1\]"):
        keep_count(10, keep)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.7, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("m", [9, 10, 30, 270, 1080, 8100])
def test_a_share_kept_counts_as_the_papers_one_minus_the_share_dropped(alpha, m):
    """ParallelVLM's α (dropped) and keep = 1 − α give the same count: 1 − 0.9 is 0.0999…98."""
    assert keep_count(m, 1 - alpha) == keep_count(m, round(1 - alpha, 6))


def test_layer_ratios_leave_layers_below_start_unpruned_and_decay_above():
    assert layer_ratios(5, 0.5, start_layer=2, decay=0.5) == [1.0, 1.0, 0.5, 0.25, 0.125]
    assert layer_ratios(3, 0.4) == [0.4, 0.4, 0.4]


def _kv(norms_by_head):
    """keys [heads, n, 2] whose per-token L2 norm over all heads is set by `norms_by_head`."""
    t = torch.tensor(norms_by_head, dtype=torch.float32)      # [heads, n]
    return torch.stack([t, torch.zeros_like(t)], dim=-1)


def test_key_norm_keeps_the_smallest_keys_over_all_heads_value_norm_the_largest_values():
    keys = _kv([[3.0, 1.0, 2.0, 0.5], [0.0, 1.0, 2.0, 0.5]])     # norms over heads: 3, 1.41, 2.83, 0.71
    assert torch.allclose(key_norm_scores(keys), -torch.tensor([3.0, 2 ** 0.5, 8 ** 0.5, 0.5 ** 0.5]))
    assert top_k_indices(key_norm_scores(keys), 2).tolist() == [1, 3]
    assert top_k_indices(value_norm_scores(keys), 2).tolist() == [0, 2]


def test_attention_scores_average_the_query_rows():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.1, 0.4]])
    assert torch.allclose(attention_entry_scores(probs), torch.tensor([0.3, 0.35, 0.35]))


@pytest.mark.parametrize("keep, m, k", [(0.1, 270, 27), (0.5, 9, 5), (1.0, 10, 10), (0.01, 50, 1)])
def test_keep_top_keeps_the_ceiling_of_the_share_in_cache_order(keep, m, k):
    scores = torch.randn(m, generator=torch.Generator().manual_seed(m))
    kept = keep_top(scores, keep)
    assert len(kept) == k and kept.tolist() == sorted(kept.tolist())
    assert scores[kept].min() >= scores.topk(k).values.min()


def test_value_change_scores_a_token_by_how_much_it_differs_from_its_place_one_step_earlier():
    still = torch.ones(1, 3, 2)                                   # one step of 3 tokens
    first = torch.tensor([[[1.0, 1.0], [1.0, 1.0], [4.0, 5.0]]])   # the video's first step: one cell stands out
    values = torch.cat([first, first, first + torch.tensor([[[0.0, 0.0], [3.0, 4.0], [0.0, 0.0]]])], dim=1)
    scores = value_change_scores(values, None, 3)
    assert scores[3:].tolist() == [0.0, 0.0, 0.0, 0.0, 5.0, 0.0]
    # the first step is a keyframe: above every change, its odd cell first (‖(3, 4)‖ from the median)
    assert scores[:3].tolist() == [6.0, 6.0, 11.0]
    with_previous = value_change_scores(values, still * 2, 3)     # the step before, from the last group
    assert torch.allclose(with_previous[:3], torch.tensor([2 ** 0.5, 2 ** 0.5, 13 ** 0.5]))
    keyframed = value_change_scores(values, still * 2, 3, keyframes=(1,))   # a later keyframe
    assert keyframed[3:6].tolist() == [6.0, 6.0, 11.0] and keyframed[7] == 5.0
    newline = value_change_scores(torch.cat([values, still[:, :1]], dim=1), None, 3)
    assert torch.isinf(newline[-1])                               # past the last whole step: kept
    with pytest.raises(ValueError, match="first step has nothing before it"):
        value_change_scores(values, None, 3, keyframes=())


# ------------------------------------------------------------------------------ UV-Prune

def test_uv_scores_as_written_telescope_to_last_minus_first_layer():
    g = torch.Generator().manual_seed(0)
    hidden = {layer: torch.randn(20, 16, generator=g) for layer in (0, 1, 2, 4)}
    video, text = slice(3, 15), torch.arange(15, 20)
    written = uv_scores(hidden, video, text, [0, 1, 2, 4], "as_written")
    torch.testing.assert_close(written, uv_scores(hidden, video, text, [0, 1, 2, 4], "telescoped"), rtol=1e-5, atol=1e-5)
    absolute = uv_scores(hidden, video, text, [0, 1, 2, 4], "absolute")
    assert (absolute >= written.abs() - 1e-5).all() and not torch.allclose(absolute, written)


def test_uv_scores_rank_first_the_tokens_whose_text_similarity_grows():
    """Video token 1 turns towards the text between layers 0 and 2, token 3 away from it."""
    text = torch.tensor([[1.0, 0.0, 0.0]])
    before = torch.tensor([[0.0, 1.0, 0.0]] * 4)
    after = before.clone()
    after[1] = torch.tensor([1.0, 0.2, 0.0])
    after[3] = torch.tensor([-1.0, 0.2, 0.0])
    hidden = {0: torch.cat([before, text]), 2: torch.cat([after, text])}
    scores = uv_scores(hidden, slice(0, 4), torch.tensor([4]), [0, 2])
    assert scores.argmax() == 1 and scores.argmin() == 3
    assert keep_top(scores, 0.25).tolist() == [1]
    assert keep_top(scores, 0.5).tolist() in ([0, 1], [1, 2])


@pytest.mark.parametrize("layers, variant, match", [([0], "as_written", "at least two layers"),
                                                    ([0, 1], "sum", "variant must be one of")])
def test_uv_scores_bad_settings_are_clear_errors(layers, variant, match):
    hidden = {layer: torch.zeros(4, 2) for layer in (0, 1)}
    with pytest.raises(ValueError, match=match):
        uv_scores(hidden, slice(0, 3), torch.tensor([3]), layers, variant)


# ------------------------------------------------------------------------------ SpecVLM

def test_attention_guided_keep_takes_the_top_mass_then_spreads_the_rest():
    attention = torch.full((20,), 0.01)
    attention[[3, 17]] = torch.tensor([0.5, 0.3])      # two tokens hold most of the attention
    # half the mass: token 3 alone (0.51 of it), then 5 tokens spread evenly over the other 19
    assert attention_guided_keep(attention, budget=6, mass=0.5).tolist() == [0, 3, 5, 10, 15, 19]
    # 70 %: tokens 3 and 17, then 4 spread evenly over the other 18
    assert attention_guided_keep(attention, budget=6, mass=0.7).tolist() == [0, 3, 7, 12, 17, 19]
    assert attention_guided_keep(attention, budget=2, mass=0.99).tolist() == [3, 17]
