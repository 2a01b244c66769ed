"""The growing KV cache: the same keys and values as transformers' DynamicCache through appends,
rollbacks and pruning, without copying the cache on every append."""

import torch

from models.cache import GrowingLayer, growing_cache
from zoo.shapes import zoo_config


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)


def test_appends_rollbacks_and_pruning_match_a_dynamic_layer():
    from transformers.cache_utils import DynamicLayer

    ours, theirs = GrowingLayer(), DynamicLayer()
    steps = [("add", 100), ("add", 1), ("crop", 3), ("add", 5), ("keep", None), ("add", 4), ("crop", 1), ("add", 200)]
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
