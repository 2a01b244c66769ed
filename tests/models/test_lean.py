"""The lean decode path (models.lean) against the model's own forward: the same logits and the same
cache entries for a decode step and a k-token verification, over a whole and a layer-wise pruned
cache, for both architectures; a tree of candidates scores every node as its own chain would;
lean=False keeps the model's forward. Token identity with `generate()` through the
lean path is tested where decoding is (tests/stages/test_generate.py, test_speculative.py).

Tolerance: the lean path runs the layers' operations in the same order on the same tensors, so
its results are bit-identical on the machines we have seen; ATOL leaves room for a BLAS that
blocks a [k, d] product differently when called outside the module (single float32 roundings on
logits of size ~10, i.e. ~1e-6 relative)."""

from __future__ import annotations

import pytest
import torch

from models.load import load_model
from tests.models.test_adapters import ARCHS, random_checkpoint
from zoo.shapes import FPS
from speculative.tree import tree_depths, tree_mask
from zoo.train.data import example

ATOL = 1e-4


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """The same random checkpoint loaded twice: the lean path and the model's own forward."""
    path = str(random_checkpoint(tmp_path_factory.mktemp(request.param), ARCHS[request.param]))
    return load_model(path), load_model(path, lean=False)


def prefilled(lm, seconds: int = 12):
    fps = FPS[lm.arch]
    ex = example(3, seconds, fps)
    layout = lm.layout(ex.prompt, n_frames=ex.frames.shape[0], frame_hw=tuple(ex.frames.shape[-2:]), fps=fps)
    cache = lm.new_cache()
    logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(ex.frames), layout.video_start), layout.positions)
    return layout, cache, logits


def test_lean_is_used_and_can_be_turned_off(pair):
    lean, plain = pair
    assert lean.lean is not None and plain.lean is None


@pytest.mark.parametrize("k", [1, 4, 16])
def test_lean_scores_like_the_models_forward(pair, k):
    lean, plain = pair
    layout, cache, _ = prefilled(lean)
    _, plain_cache, _ = prefilled(plain)
    ids = torch.arange(10, 10 + k) % lean.vocab_size
    for step in range(3):           # several steps: the cache grows through the lean path itself
        got = lean.score(cache, ids, layout.length + step * k, layout)
        want = plain.score(plain_cache, ids, layout.length + step * k, layout)
        assert got.shape == want.shape == (k, lean.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    for layer in range(lean.n_layers):       # the entries it appended are the model's
        for a, b in zip(lean.layer_kv(cache, layer), plain.layer_kv(plain_cache, layer)):
            torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_lean_scores_over_a_layer_wise_pruned_cache(pair):
    """QuickPrefill leaves layers of different lengths; each layer attends to its own entries."""
    lean, plain = pair
    caches = []
    for lm in pair:
        layout, cache, _ = prefilled(lm)
        n = lm.cached_length(cache)
        lm.keep(cache, [torch.arange(0, n, 1 + i % 3) for i in range(lm.n_layers)])
        caches.append(cache)
    ids = torch.tensor([12, 5])
    got = lean.score(caches[0], ids, layout.length, layout)
    want = plain.score(caches[1], ids, layout.length, layout)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("path", ["lean", "model"])
def test_a_tree_scores_each_node_as_its_own_chain_would(pair, path):
    lean = pair[0] if path == "lean" else pair[1]
    #        0 ─ 1 ─ 3
    #        │   └── 4
    # root ─ ┤
    #        2 ─ 5
    parents = torch.tensor([-1, 0, -1, 1, 1, 2])
    ids = torch.tensor([11, 12, 13, 14, 15, 16])
    layout, cache, _ = prefilled(lean)
    n = lean.cached_length(cache)
    tree = lean.score_tree(cache, ids, tree_mask(parents), tree_depths(parents), layout.length, layout)
    assert tree.shape == (6, lean.vocab_size) and lean.cached_length(cache) == n + 6
    for leaf_path in ([0, 1, 3], [0, 1, 4], [2, 5]):
        lean.crop(cache, n)
        chain = lean.score(cache, ids[leaf_path], layout.length, layout)
        torch.testing.assert_close(tree[leaf_path], chain, atol=ATOL, rtol=0)
