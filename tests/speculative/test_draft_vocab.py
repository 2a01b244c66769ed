"""A draft vocabulary (speculative.draft_vocab): the head proposes only its tokens, scoring them
with their own LM head rows. Checked against the node-by-node EAGLE-2 reference restricted to the
same tokens (eager, compiled and the captured tree's body), against the full tree when the set is
every token, and for its checks on bad lists. Losslessness with a draft vocabulary is the sparrow
graph's test (tests/stages/test_sparrow.py)."""

from __future__ import annotations

import json

import pytest
import torch

from models.compiling import warming
from models.load import load_model
from models.sparrow import HeadCache, SparrowHead
from speculative.captured_head import CapturedTree
from speculative.draft_vocab import DraftVocabulary
from speculative.expansion import grow_tree
from speculative.head_draft import grower, head_shape
from tests.speculative.test_head_draft import check_against_reference

TARGET = "zoo/weights/qwen-target"


@pytest.fixture(scope="module")
def head_and_target():
    lm = load_model(TARGET)
    return SparrowHead.load("zoo/weights/qwen-sparrow", lm), lm


def some_ids(lm, n=24, seed=0):
    """n token ids of lm's vocabulary, in a shuffled order (the order a list is in must not matter
    to which tokens win, only to where their rows sit)."""
    g = torch.Generator().manual_seed(seed)
    return [i for i in torch.randperm(lm.vocabulary, generator=g).tolist() if i not in lm.eos_ids][:n]


def test_the_rows_are_the_lm_heads_and_the_end_token_is_always_kept(head_and_target):
    _, lm = head_and_target
    ids = some_ids(lm)
    vocab = DraftVocabulary.of(lm, ids)
    assert vocab.ids.tolist() == ids + sorted(lm.eos_ids) and vocab.size == len(ids) + len(lm.eos_ids)
    x = torch.randn(3, lm.hidden_size)
    torch.testing.assert_close(vocab.logits(x), lm.logits(x)[:, vocab.ids], rtol=0, atol=0)
    with_end = DraftVocabulary.of(lm, [*lm.eos_ids, 5])
    assert with_end.ids.tolist() == [*lm.eos_ids, 5]              # listed already: not added twice


def test_bad_lists_are_refused_with_what_is_wrong(head_and_target, tmp_path, monkeypatch):
    _, lm = head_and_target
    with pytest.raises(ValueError, match="outside the target's vocabulary of 64"):
        DraftVocabulary.of(lm, [1, 64])
    with pytest.raises(ValueError, match="listed twice"):
        DraftVocabulary.of(lm, [5, 5])
    with pytest.raises(FileNotFoundError, match="tools.draft_vocab"):
        DraftVocabulary.load(tmp_path / "none.json", lm)
    (tmp_path / "bad.json").write_text(json.dumps({"ids": ["a"]}))
    with pytest.raises(ValueError, match="a list of token ids"):
        DraftVocabulary.load(tmp_path / "bad.json", lm)
    (tmp_path / "list.json").write_text(json.dumps([7, 9]))
    (tmp_path / "dict.json").write_text(json.dumps({"ids": [7, 9], "covered": 0.5}))
    assert DraftVocabulary.load(tmp_path / "list.json", lm).ids.tolist() == \
        DraftVocabulary.load(tmp_path / "dict.json", lm).ids.tolist() == [7, 9, *sorted(lm.eos_ids)]
    monkeypatch.setattr("speculative.draft_vocab.ROOT", tmp_path)      # a path relative to the project root
    assert DraftVocabulary.load("list.json", lm).ids.tolist() == [7, 9, *sorted(lm.eos_ids)]


@pytest.mark.parametrize("shape", [(10, 6, 2), (30, 4, 8), (5, 3, 64)])
@torch.inference_mode()
def test_the_tree_over_a_draft_vocabulary_is_eagle2_over_those_tokens(head_and_target, shape):
    """(5, 3, 64): a top-k wider than the set, which then takes the whole set each level."""
    _, lm = head_and_target
    vocab = DraftVocabulary.of(lm, some_ids(lm, 20, seed=shape[0]))
    for seed in (0, 1):
        check_against_reference(head_and_target, shape, seed, grow_tree, draft=vocab)


@torch.inference_mode()
def test_every_token_in_order_drafts_the_full_tree(head_and_target):
    head, lm = head_and_target
    every = DraftVocabulary.of(lm, range(lm.vocabulary))
    torch.manual_seed(3)
    cache = HeadCache.empty(head)
    top = head(cache, torch.randn(12, lm.hidden_size), torch.arange(12))[-1]
    full = grow_tree(head, lm, cache.keys, cache.values, top, 12, depth=4, topk=8, vocab=lm.vocabulary)
    restricted = grow_tree(head, lm, cache.keys, cache.values, top, 12, depth=4, topk=8, vocab=lm.vocabulary,
                           draft=every)
    assert torch.equal(full[0], restricted[0]) and torch.equal(full[1], restricted[1])
    torch.testing.assert_close(full[2], restricted[2], rtol=0, atol=1e-6)    # the same products, another order


@torch.inference_mode()
def test_the_compiled_and_the_captured_trees_take_a_draft_vocabulary(head_and_target):
    """Compiled once with the set (as warm_tree does at setup), then no recompile at other cache
    lengths; the captured tree's body (run uncaptured here) is the reference too."""
    head, lm = head_and_target
    vocab = DraftVocabulary.of(lm, some_ids(lm, 30, seed=4))
    compiled = grower("default", "cpu", head_shape(head, lm))
    with warming():
        check_against_reference(head_and_target, (10, 6, 2), 0, compiled, draft=vocab)
    with torch.compiler.set_stance("fail_on_recompile"):
        check_against_reference(head_and_target, (10, 6, 2), 1, compiled, length=33, draft=vocab)
    check_against_reference(head_and_target, (30, 4, 8), 2, CapturedTree(head, lm, capture=False), draft=vocab)
