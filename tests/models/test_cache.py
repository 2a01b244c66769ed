"""The growing KV cache: the same keys and values as transformers' DynamicCache through appends,
rollbacks and pruning, without copying the cache on every append."""

import pytest
import torch

from models.cache import GrowingLayer, growing_cache
from zoo.shapes import zoo_config


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def test_appends_rollbacks_and_pruning_match_a_dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    ours, theirs = GrowingLayer(), DynamicLayer()
    steps = [("add", 100), ("add", 1), ("crop", 3), ("crop", 0), ("add", 5), ("keep", None), ("add", 4), ("crop", 1),
             ("add", 200), ("crop", 10_000), ("add", 3)]
    for i, (op, n) in enumerate(steps):
        if op == "add":
            k, v = kv(n, i)
            a, b = ours.update(k, v), theirs.update(k, v)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        elif op == "crop":
            ours.crop(-n)
            theirs.crop(-n)
        else:                                  # pruning assigns a new tensor, as VideoLM.keep does
            idx = torch.arange(0, ours.get_seq_length(), 2)
            for layer in (ours, theirs):
                layer.keys, layer.values = layer.keys.index_select(-2, idx), layer.values.index_select(-2, idx)
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_a_positive_crop_is_refused_as_transformers_refuses_it():
    layer = GrowingLayer()
    layer.update(*kv(4, 0))
    with pytest.raises(ValueError, match="negative"):
        layer.crop(2)
    assert layer.held() == layer.get_seq_length() == 4


def test_a_decode_step_writes_into_spare_room_instead_of_copying():
    layer = GrowingLayer()
    layer.update(*kv(1000, 0))
    buffer = layer.keys.data_ptr()
    assert layer.capacity() >= 1000 + 64
    for step in range(50):                     # one token a step, with a rollback now and then
        layer.update(*kv(1, step + 1))
        if step % 10 == 9:
            layer.crop(-1)
    assert layer.keys.data_ptr() == buffer and layer.get_seq_length() == 1045


def test_growing_cache_replaces_every_full_attention_layer():
    cache = growing_cache(zoo_config("qwen-target").text_config)
    assert len(cache.layers) == 6 and all(isinstance(layer, GrowingLayer) for layer in cache.layers)


def test_reserve_and_advance_let_a_writer_fill_the_spare_room_in_place():
    """What a CUDA graph does (models.graphed): reserve room, write past the filled part into the
    buffers it was given, then count the entries as held; the spare room reads as zeros."""
    layer = GrowingLayer()
    with pytest.raises(ValueError, match="prefill first"):
        layer.reserve(1)
    k, v = kv(10, 0)
    layer.update(k, v)
    keys, values = layer.buffers()
    assert keys.shape[2] == layer.capacity() > 10 and torch.equal(keys[:, :, 10:], torch.zeros_like(keys[:, :, 10:]))
    layer.reserve(5)
    assert layer.buffers()[0].data_ptr() == keys.data_ptr() and layer.get_seq_length() == 10     # room: no move
    new_k, new_v = kv(5, 1)
    keys[:, :, 10:15], values[:, :, 10:15] = new_k, new_v
    layer.advance(5)
    assert torch.equal(layer.keys, torch.cat([k, new_k], 2)) and torch.equal(layer.values, torch.cat([v, new_v], 2))
    layer.reserve(layer.capacity())                            # more than is left: grows, keeps what it held
    assert layer.capacity() >= 30 and torch.equal(layer.keys, torch.cat([k, new_k], 2))
    with pytest.raises(ValueError, match="slots left"):
        layer.advance(layer.capacity())


@pytest.mark.parametrize("rows", [[1, 3, 4], [0, 1], [], [2]])
def test_keeping_a_trees_path_moves_its_entries_behind_the_committed_ones(rows):
    """VideoLM.keep_path on growing layers and transformers' own: the path's entries (node order)
    right after the entries before the tree, the rest dropped; a path of the first nodes in order
    stays where it is; nothing before the tree moves."""
    from transformers.cache_utils import DynamicLayer

    from models.adapter import VideoLM

    class Cache:                   # what keep_path reads of a cache: its layers
        def __init__(self, layers):
            self.layers = layers

    before, tree = kv(7, 0), kv(5, 1)
    for make in (GrowingLayer, DynamicLayer):
        layers = [make(), make()]
        for layer in layers:
            layer.update(*before)
            layer.update(*tree)
        VideoLM.keep_path(Cache(layers), 5, rows)
        for layer in layers:
            assert layer.get_seq_length() == 7 + len(rows)
            for held, (old, new) in zip((layer.keys, layer.values), zip(before, tree)):
                assert torch.equal(held[..., :7, :], old)
                assert torch.equal(held[..., 7:, :], new[..., rows, :])
    with pytest.raises(ValueError, match="not among the last 5"):
        VideoLM.keep_path(Cache(layers), 5, [5])
