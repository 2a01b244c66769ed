"""Sparrow's dynamic tree in fixed shapes (speculative.expansion.grow_tree, eager and compiled) is
EAGLE-2's expansion as written node by node: the same tokens, parents and depth, for the shipped
head and random states, for the shapes the configs use and degenerate ones. The node-by-node
version below is the reference: a plain transcription of the algorithm with Python lists, float64
scores and the head's cached forward with a full mask.

The two compute the head's attention in another order (split in two and merged by log-sum-exp,
against one softmax), so their log-probabilities differ by float32 rounding (~1e-7). A tree could
only differ where two candidates' scores tie to that precision; the random states here give none,
and a tie would break on every machine the same way in both (stable sorts, float64 sums)."""

from __future__ import annotations

import pytest
import torch

from models.compiling import warming
from models.load import load_model
from models.sparrow import HeadCache, SparrowHead
from speculative.expansion import grow_tree
from speculative.head_draft import CompiledHeadStep, draft_tree, grower, head_shape


def eagle2_node_by_node(head, lm, cache, top, position, *, total, depth, topk, vocab, draft=None):
    def path_to(parents, node):
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def log_probs(x):       # over the first `vocab` tokens, or over a draft vocabulary's (token ids: draft.ids)
        return torch.log_softmax(lm.logits(x)[..., :vocab] if draft is None else draft.logits(x), -1)

    def token(i):
        return i if draft is None else int(draft.ids[i])

    width = vocab if draft is None else draft.size
    base = cache.length
    first = log_probs(top).topk(min(topk, width))
    tokens, scores = [token(i) for i in first.indices.tolist()], first.values.tolist()
    parents, depths = [-1] * len(tokens), [1] * len(tokens)
    state, slot, frontier = {}, {}, list(range(len(tokens)))
    for level in range(1, depth):
        expand = sorted(frontier, key=lambda i: -scores[i])[:topk]
        feats = torch.stack([top if parents[i] < 0 else state[parents[i]] for i in expand])
        z = head.fuse(lm.embed(torch.tensor([tokens[i] for i in expand])), feats)
        n_cached = cache.length
        mask = torch.zeros(len(expand), n_cached + len(expand), dtype=torch.bool)
        mask[:, :base] = True
        for row, i in enumerate(expand):
            mask[row, [n_cached + row] + [slot[a] for a in path_to(parents, parents[i])]] = True
        out = head(cache, z, torch.full((len(expand),), position + level - 1), mask)
        frontier = []
        best = log_probs(out).topk(min(topk, width), -1)
        for row, i in enumerate(expand):
            state[i], slot[i] = out[row], n_cached + row
            for lp, t in zip(best.values[row].tolist(), best.indices[row].tolist()):
                tokens.append(token(t))
                parents.append(i)
                scores.append(scores[i] + lp)
                depths.append(level + 1)
                frontier.append(len(tokens) - 1)
    cache.crop(base)
    keep = set(sorted(range(len(parents)), key=lambda i: -scores[i])[:total])
    for i in list(keep):
        keep.update(path_to(parents, i))
    order = sorted(keep, key=lambda i: (depths[i], i))
    index = {node: j for j, node in enumerate(order)}
    return ([tokens[i] for i in order], [index.get(parents[i], -1) for i in order], max(depths[i] for i in order))


@pytest.fixture(scope="module")
def head_and_target():
    lm = load_model("zoo/weights/qwen-target")
    return SparrowHead.load("zoo/weights/qwen-sparrow", lm), lm


SHAPES = [(10, 6, 2), (30, 4, 8), (48, 5, 10), (60, 6, 10), (1, 1, 1), (5, 3, 64), (200, 4, 4)]   # total-depth-topk


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.inference_mode()
def test_the_tensor_tree_is_eagle2_node_by_node(head_and_target, shape, seed):
    check_against_reference(head_and_target, shape, seed, grow_tree)


@torch.inference_mode()
def test_the_compiled_tree_is_eagle2_node_by_node_without_recompiling(head_and_target):
    """The CPU default tree (10-6-2) compiled once, as the head drafts with it (grower: only the
    cache length and the position symbolic), serves every cache length and position."""
    compiled = grower("default", "cpu", head_shape(*head_and_target))
    with warming():                # the compile, with the cache length marked as warm-up marks it
        check_against_reference(head_and_target, (10, 6, 2), 0, compiled)
    with torch.compiler.set_stance("fail_on_recompile"):
        check_against_reference(head_and_target, (10, 6, 2), 1, compiled, length=33)
        check_against_reference(head_and_target, (10, 6, 2), 2, compiled, length=57)


def test_the_compiled_tree_is_one_function_at_every_thread_count():
    """An elastic pool moves a worker between thread counts from round to round: the head must keep
    drafting with the tree compiled at load, not start a new compile (which no recompile check
    sees, being a first compile of a new function) in the middle of a request."""
    now = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        at_one = grower("default")
        torch.set_num_threads(2)
        assert grower("default") is at_one
    finally:
        torch.set_num_threads(now)
    assert grower("off") is grow_tree


def check_against_reference(head_and_target, shape, seed, grow, length=20, draft=None):
    head, lm = head_and_target
    total, depth, topk = shape
    torch.manual_seed(seed)
    cache = HeadCache.empty(head)
    top = head(cache, torch.randn(length, lm.hidden_size).to(lm.device), torch.arange(length))[-1]
    tokens, parents, facts = draft_tree(head, lm, cache, top, length, total=total, depth=depth, topk=topk, vocab=64,
                                        grow=grow, draft=draft)
    assert cache.length == length
    want_tokens, want_parents, want_depth = eagle2_node_by_node(head, lm, cache, top, length, total=total, depth=depth,
                                                                topk=topk, vocab=64, draft=draft)
    assert tokens.tolist() == want_tokens and parents.tolist() == want_parents
    assert facts == {"nodes": len(want_tokens), "depth": want_depth}



@torch.inference_mode()
def test_the_compiled_catch_up_is_the_heads_forward_without_recompiling(head_and_target):
    """A round's catch-up compiled (CompiledHeadStep, what compiled targets use) gives the head's
    cached forward's outputs and cache for 1..7 rows over caches of any length, after one warm-up.
    Tolerance: the two compute attention in another order (split and merged by log-sum-exp against
    one softmax over the whole cache), float32 rounding of a one-layer head: ~1e-6 relative."""
    head, lm = head_and_target
    step = CompiledHeadStep(head, lm, "default")
    step.warm(rows=7)
    torch.manual_seed(0)
    with torch.compiler.set_stance("fail_on_recompile"):
        for length, rows in [(9, 1), (20, 3), (33, 7), (57, 2), (58, 5)]:
            eager, compiled = HeadCache.empty(head), HeadCache.empty(head)
            prefix = torch.randn(length, lm.hidden_size)
            head(eager, prefix, torch.arange(length))
            head(compiled, prefix, torch.arange(length))
            ids, features = torch.randint(0, 64, (rows,)), torch.randn(rows, lm.hidden_size)
            want = head(eager, head.fuse(lm.embed(ids), features), torch.arange(length, length + rows))
            got = step(compiled, ids, features, length)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled.keys, eager.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(compiled.values, eager.values, rtol=1e-5, atol=1e-5)
