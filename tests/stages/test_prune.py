"""The pruning stages (stages/prune.py) on hand-made tensors: what QuickPrefill's GroupKVPrune keeps
with each importance (value_change across groups too), that each layer keeps its own set, UV-Prune's
and SpecVLM's share, and that a bad or renamed setting is a clear error. The math alone:
tests/models/test_pruning.py."""

from __future__ import annotations

import pytest
import torch

from models.adapter import Layout
from models.pruning import keep_count
from stages.prefill import Prefill
from stages.prune import AttentionPrune, GroupKVPrune, UVPrune
from stages.types import Taps


def _cache(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, n, 4, generator=g), torch.randn(2, n, 4, generator=g)) for n in lengths]


@pytest.mark.parametrize("importance", ["key_norm", "value_norm", "random"])
def test_select_keeps_earlier_entries_and_ceil_of_the_group_in_every_layer(importance):
    lengths, n_group = [40, 31, 25], 12       # layers already pruned to different lengths
    layers = _cache(lengths)
    keep = GroupKVPrune(importance, keep=0.3).select(lambda i: layers[i], lengths, n_group)
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
    keep = GroupKVPrune("key_norm", keep=0.5).select(lambda i: layers[i], lengths, 10)
    assert keep[0].tolist() != keep[1].tolist()


def test_select_with_attention_reads_the_group_columns_of_each_layer():
    lengths, n_group = [8, 6], 4
    attention = {1: torch.tensor([[0, 0, 0, 0, 0.1, 0.9, 0.2, 0.8, 0.5]]),      # + one query column
                 2: torch.tensor([[0, 0, 0.7, 0.1, 0.6, 0.2, 0.4]])}
    keep = GroupKVPrune("attention", keep=0.5).select(lambda i: None, lengths, n_group, attention)
    assert keep[0].tolist() == [0, 1, 2, 3, 5, 7]
    assert keep[1].tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="attention"):
        GroupKVPrune("attention", keep=0.5).select(lambda i: None, lengths, n_group, None)


def test_start_layer_and_keep_one_keep_everything():
    lengths = [16, 16, 16]
    layers = _cache(lengths)
    assert GroupKVPrune(keep=1.0).select(lambda i: layers[i], lengths, 8) is None
    keep = GroupKVPrune(keep=0.5, start_layer=2).select(lambda i: layers[i], lengths, 8)
    assert [len(k) for k in keep] == [16, 16, 12]


def test_random_importance_is_reproducible_from_its_seed():
    lengths = [30]
    layers = _cache(lengths)
    a = GroupKVPrune("random", 0.4, seed=5).select(lambda i: layers[i], lengths, 20)
    b = GroupKVPrune("random", 0.4, seed=5).select(lambda i: layers[i], lengths, 20)
    c = GroupKVPrune("random", 0.4, seed=6).select(lambda i: layers[i], lengths, 20)
    assert a[0].tolist() == b[0].tolist() != c[0].tolist()


@pytest.mark.parametrize("kwargs, match", [({"importance": "l1"}, "importance must be one of"),
                                           ({"keep": 0.0}, r"keep \(the share kept\)"),
                                           ({"start_layer": -1}, "start_layer"),
                                           ({"decay": 1.5}, "decay")])
def test_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GroupKVPrune(**kwargs)


def test_the_group_prefill_refuses_the_old_ratio_key_and_names_keep_before_any_model_loads():
    with pytest.raises(ValueError, match=r"unknown keys \['ratio'\]; known: importance, keep"):
        Prefill({"path": "no/such/model"}, mode="groups", prune={"ratio": 0.2})


# ------------------------------------------------------------------------------ UV-Prune and SpecVLM

@pytest.mark.parametrize("kwargs, match", [({"keep": 0.0}, r"keep \(the share kept\)"), ({"keep": 1.5}, "keep"), ({"layers": [2]}, "two or more"),
                                           ({"variant": "sum"}, "variant"), ({"text": "none"}, "text")])
def test_uv_prune_bad_settings_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UVPrune(**kwargs)


def _taps(n_video: int, layers=(0, 1, 2), n_text: int = 3, seed: int = 0) -> Taps:
    """Taps over a prompt of 2 text tokens, `n_video` video tokens and `n_text` question tokens."""
    length = 2 + n_video + n_text
    g = torch.Generator().manual_seed(seed)
    layout = Layout(torch.zeros(length, dtype=torch.long), 2, n_video, torch.arange(length)[None], 0)
    return Taps({layer: torch.randn(length, 8, generator=g) for layer in layers}, layout=layout)


@pytest.mark.parametrize("keep, n_video, k", [(0.1, 270, 27), (0.1, 1080, 108), (0.5, 9, 5), (1.0, 12, 12), (0.01, 50, 1)])
def test_uv_prune_and_attention_prune_keep_the_share_they_are_given(keep, n_video, k):
    chosen = UVPrune(keep=keep)(None, _taps(n_video))["selection"]
    assert chosen.keep.numel() == k and chosen.total == n_video
    layout = _taps(n_video).layout
    probs = torch.rand(3, layout.length, generator=torch.Generator().manual_seed(1)).softmax(-1)   # [n_query, seq]
    chosen = AttentionPrune(keep=keep)(None, Taps({2: probs}, layout=layout))["selection"]
    assert chosen.keep.numel() == k and bool((chosen.keep.diff() > 0).all())


# ------------------------------------------------------------------------------ value_change across groups

def test_value_change_prune_remembers_the_last_step_across_groups_and_keeps_the_changes():
    step = torch.zeros(1, 9, 4)
    group = torch.cat([step] * 4, dim=1)                          # 4 steps of a still 3x3 board
    group[:, 9 * 2 + 4] = 1.0                                     # the centre cell changes in step 2 ...
    group[:, 9 * 3 + 4] = 1.0                                     # ... and stays (step 3 repeats it)
    pruner = GroupKVPrune("value_change", keep=0.5)              # keep 18 of 36
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
    pruner = GroupKVPrune("value_change", keep=0.5, keyframe_every=every)
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
