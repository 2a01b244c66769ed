"""QuickPrefill's pruning math (stages/prune.py) on hand-made tensors: the rounding, the per-layer
ratios, what each importance keeps (value_change across groups too), and that each layer keeps its
own set."""

from __future__ import annotations

import pytest
import torch

from stages.prune import (GroupKVPrune, attention_entry_scores, keep_count, key_norm_scores, layer_ratios,
                          top_k_indices, value_change_scores, value_norm_scores)


@pytest.mark.parametrize("n, ratio, k", [(10, 0.5, 5), (7, 0.5, 4), (30, 0.1, 3), (1, 0.1, 1), (27, 1.0, 27),
                                         (27, 0.2, 6), (100, 0.3, 30)])
def test_keep_count_is_the_ceiling_of_ratio_times_n(n, ratio, k):
    assert keep_count(n, ratio) == k


@pytest.mark.parametrize("ratio", [0, -0.5, 1.5])
def test_keep_count_refuses_ratios_outside_zero_one(ratio):
    with pytest.raises(ValueError, match="retention ratio"):
        keep_count(10, ratio)


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


def _cache(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, n, 4, generator=g), torch.randn(2, n, 4, generator=g)) for n in lengths]


@pytest.mark.parametrize("importance", ["key_norm", "value_norm", "random"])
def test_select_keeps_earlier_entries_and_ceil_of_the_group_in_every_layer(importance):
    lengths, n_group = [40, 31, 25], 12       # layers already pruned to different lengths
    layers = _cache(lengths)
    keep = GroupKVPrune(importance, ratio=0.3).select(lambda i: layers[i], lengths, n_group)
    for n, idx in zip(lengths, keep):
        start = n - n_group
        assert idx[:start].tolist() == list(range(start))                  # nothing before the group is touched
        chosen = idx[start:]
        assert len(chosen) == keep_count(n_group, 0.3) == 4
        assert chosen.tolist() == sorted(set(chosen.tolist())) and chosen.min() >= start and chosen.max() < n
    if importance == "key_norm":
        keys = layers[0][0][:, lengths[0] - n_group:]
        expected = (lengths[0] - n_group + keys.square().sum((0, 2)).argsort()[:4]).sort().values
        assert keep[0][lengths[0] - n_group:].tolist() == expected.tolist()


def test_each_layer_chooses_its_own_set():
    lengths = [20, 20]
    layers = _cache(lengths, seed=3)
    keep = GroupKVPrune("key_norm", ratio=0.5).select(lambda i: layers[i], lengths, 10)
    assert keep[0].tolist() != keep[1].tolist()


def test_select_with_attention_reads_the_group_columns_of_each_layer():
    lengths, n_group = [8, 6], 4
    attention = {1: torch.tensor([[0, 0, 0, 0, 0.1, 0.9, 0.2, 0.8, 0.5]]),      # + one query column
                 2: torch.tensor([[0, 0, 0.7, 0.1, 0.6, 0.2, 0.4]])}
    keep = GroupKVPrune("attention", ratio=0.5).select(lambda i: None, lengths, n_group, attention)
    assert keep[0].tolist() == [0, 1, 2, 3, 5, 7]
    assert keep[1].tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="attention"):
        GroupKVPrune("attention", ratio=0.5).select(lambda i: None, lengths, n_group, None)


def test_start_layer_and_ratio_one_keep_everything():
    lengths = [16, 16, 16]
    layers = _cache(lengths)
    assert GroupKVPrune(ratio=1.0).select(lambda i: layers[i], lengths, 8) is None
    keep = GroupKVPrune(ratio=0.5, start_layer=2).select(lambda i: layers[i], lengths, 8)
    assert [len(k) for k in keep] == [16, 16, 12]


def test_random_importance_is_reproducible_from_its_seed():
    lengths = [30]
    layers = _cache(lengths)
    a = GroupKVPrune("random", 0.4, seed=5).select(lambda i: layers[i], lengths, 20)
    b = GroupKVPrune("random", 0.4, seed=5).select(lambda i: layers[i], lengths, 20)
    c = GroupKVPrune("random", 0.4, seed=6).select(lambda i: layers[i], lengths, 20)
    assert a[0].tolist() == b[0].tolist() != c[0].tolist()


@pytest.mark.parametrize("kwargs, match", [({"importance": "l1"}, "importance must be one of"),
                                           ({"ratio": 0.0}, "retention ratio"),
                                           ({"start_layer": -1}, "start_layer"),
                                           ({"decay": 1.5}, "decay")])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupKVPrune(**kwargs)


# ------------------------------------------------------------------------------ UV-Prune

def test_uv_scores_as_written_telescope_to_last_minus_first_layer():
    from stages.prune import uv_scores

    g = torch.Generator().manual_seed(0)
    hidden = {layer: torch.randn(20, 16, generator=g) for layer in (0, 1, 2, 4)}
    video, text = slice(3, 15), torch.arange(15, 20)
    written = uv_scores(hidden, video, text, [0, 1, 2, 4], "as_written")
    torch.testing.assert_close(written, uv_scores(hidden, video, text, [0, 1, 2, 4], "telescoped"), rtol=1e-5, atol=1e-5)
    absolute = uv_scores(hidden, video, text, [0, 1, 2, 4], "absolute")
    assert (absolute >= written.abs() - 1e-5).all() and not torch.allclose(absolute, written)


def test_uv_prune_keeps_the_tokens_whose_text_similarity_grows():
    """Video token 1 turns towards the text between layers 0 and 2, token 3 away from it."""
    from stages.prune import keep_fraction, uv_scores

    text = torch.tensor([[1.0, 0.0, 0.0]])
    before = torch.tensor([[0.0, 1.0, 0.0]] * 4)
    after = before.clone()
    after[1] = torch.tensor([1.0, 0.2, 0.0])
    after[3] = torch.tensor([-1.0, 0.2, 0.0])
    hidden = {0: torch.cat([before, text]), 2: torch.cat([after, text])}
    scores = uv_scores(hidden, slice(0, 4), torch.tensor([4]), [0, 2])
    assert scores.argmax() == 1 and scores.argmin() == 3
    assert keep_fraction(scores, 0.75).tolist() == [1]
    assert keep_fraction(scores, 0.5).tolist() in ([0, 1], [1, 2])


@pytest.mark.parametrize("alpha, m, k", [(0.9, 270, 27), (0.5, 9, 5), (0.0, 10, 10), (0.99, 50, 1)])
def test_keep_fraction_keeps_ceil_one_minus_alpha(alpha, m, k):
    from stages.prune import keep_fraction

    kept = keep_fraction(torch.randn(m), alpha)
    assert len(kept) == k and kept.tolist() == sorted(kept.tolist())


@pytest.mark.parametrize("kwargs, match", [({"alpha": 1.0}, "alpha"), ({"layers": [2]}, "two or more"),
                                           ({"variant": "sum"}, "variant"), ({"text": "none"}, "text")])
def test_uv_prune_bad_settings_are_clear_errors(kwargs, match):
    from stages.prune import UVPrune

    with pytest.raises(ValueError, match=match):
        UVPrune(**kwargs)


# ------------------------------------------------------------------------------ SpecVLM

def test_attention_guided_keep_takes_the_top_mass_then_spreads_the_rest():
    from stages.prune import attention_guided_keep

    attention = torch.full((20,), 0.01)
    attention[[3, 17]] = torch.tensor([0.5, 0.3])      # two tokens hold most of the attention
    # half the mass: token 3 alone (0.51 of it), then 5 tokens spread evenly over the other 19
    assert attention_guided_keep(attention, budget=6, mass=0.5).tolist() == [0, 3, 5, 10, 15, 19]
    # 70 %: tokens 3 and 17, then 4 spread evenly over the other 18
    assert attention_guided_keep(attention, budget=6, mass=0.7).tolist() == [0, 3, 7, 12, 17, 19]
    assert attention_guided_keep(attention, budget=2, mass=0.99).tolist() == [3, 17]


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


def test_value_change_prune_remembers_the_last_step_across_groups_and_keeps_the_changes():
    step = torch.zeros(1, 9, 4)
    group = torch.cat([step] * 4, dim=1)                          # 4 steps of a still 3x3 board
    group[:, 9 * 2 + 4] = 1.0                                     # the centre cell changes in step 2 ...
    group[:, 9 * 3 + 4] = 1.0                                     # ... and stays (step 3 repeats it)
    pruner = GroupKVPrune("value_change", ratio=0.5)              # keep 18 of 36
    kept = pruner.select(lambda i: (group, group), [36], 36, step_tokens=9)[0].tolist()
    assert kept[:9] == list(range(9))                             # the video's first step has no past: kept
    assert 9 * 2 + 4 in kept and len(kept) == 18
    second = torch.cat([step] * 4, dim=1)                         # the next group: the centre is empty again
    cache = torch.cat([group[:, kept], second], dim=1)
    kept2 = pruner.select(lambda i: (cache, cache), [cache.shape[1]], 36, step_tokens=9)[0]
    assert 18 + 4 in kept2.tolist()                               # compared with the last group's last step
    with pytest.raises(ValueError, match="tokens per temporal step"):
        GroupKVPrune("value_change").select(lambda i: (group, group), [36], 36)


@pytest.mark.parametrize("every, expect", [(0, [[0], [], []]), (3, [[0, 3], [2], [1]]), (4, [[0], [0], [0]])])
def test_value_change_keyframes_follow_the_videos_step_count_across_groups(every, expect):
    pruner = GroupKVPrune("value_change", ratio=0.5, keyframe_every=every)
    group = torch.zeros(1, 4 * 9, 4)                              # groups of 4 steps of a still 3x3 board
    seen = []
    for _ in range(3):
        seen.append(list(pruner._keyframes(36, 9)))
        kept = pruner.select(lambda i: (group, group), [36], 36, step_tokens=9)[0].tolist()
        for step in seen[-1]:                                     # a keyframe is kept whole
            assert set(range(9 * step, 9 * step + 9)) <= set(kept)
    assert seen == expect
    with pytest.raises(ValueError, match="keyframe_every must be ≥ 0"):
        GroupKVPrune("value_change", keyframe_every=-1)
