"""speculative.captured_head: the Sparrow head's catch-up step and tree as CUDA graphs. On the CPU
the graphs' bodies run directly (the same operations on the same buffers) and are checked against
EAGLE-2 node by node and the eager head; on CUDA the replays are."""

from __future__ import annotations

import pytest
import torch

from models.load import load_model
from models.sparrow import HeadCache, SparrowHead
from speculative.captured_head import ROOM, CapturedHeadStep, CapturedTree
from tests.speculative.test_head_draft import check_against_reference


@pytest.fixture(scope="module")
def head_and_target():
    lm = load_model("zoo/weights/qwen-target")
    return SparrowHead.load("zoo/weights/qwen-sparrow", lm), lm


@pytest.mark.parametrize("shape", [(10, 6, 2), (30, 4, 8), (1, 1, 1)])
@torch.inference_mode()
def test_the_trees_body_is_eagle2_node_by_node(head_and_target, shape):
    """The head's cache copied into a fixed buffer, the held length marking it: the same trees at
    cache lengths that fit the buffer, need a larger one, and shrink back (a rollback)."""
    head, lm = head_and_target
    tree = CapturedTree(head, lm, capture=False)
    for seed, length in enumerate((20, ROOM + 5, 33)):
        check_against_reference(head_and_target, shape, seed, tree, length=length)
    assert tree._keys.shape[1] == 2 * ROOM            # grown once, kept when the cache got shorter


@pytest.mark.parametrize("rows", [1, 3, 7])
@torch.inference_mode()
def test_the_steps_body_is_the_eager_head(head_and_target, rows):
    """A catch-up of `rows` tokens: the same outputs and cache as the eager head's forward, up to
    float32 rounding (one softmax there, two merged by log-sum-exp here: ~1e-7 relative)."""
    head, lm = head_and_target
    step = CapturedHeadStep(head, lm, capture=False)
    g = torch.Generator().manual_seed(rows)
    prompt = torch.randn(15, lm.hidden_size, generator=g)
    ids, features = torch.randint(0, 64, (rows,), generator=g), torch.randn(rows, lm.hidden_size, generator=g)
    eager, captured = HeadCache.empty(head), HeadCache.empty(head)
    for cache in (eager, captured):
        head(cache, prompt, torch.arange(15))
    want = head(eager, head.fuse(lm.embed(ids), features), torch.arange(15, 15 + rows))
    got = step(captured, ids, features, 15)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert captured.length == eager.length == 15 + rows
    torch.testing.assert_close(captured.keys, eager.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(captured.values, eager.values, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_warming_the_step_leaves_the_callers_cache_alone(head_and_target):
    head, lm = head_and_target
    step = CapturedHeadStep(head, lm, capture=False)
    cache = HeadCache.empty(head)
    head(cache, torch.randn(9, lm.hidden_size), torch.arange(9))
    keys = cache.keys.clone()
    step.warm(rows=3)
    out = step(cache, torch.tensor([4]), torch.randn(1, lm.hidden_size), 9)
    assert out.shape == (1, lm.hidden_size) and cache.length == 10 and torch.equal(cache.keys[:, :9], keys)


def test_a_captured_head_refuses_a_cpu_device_and_another_head(head_and_target):
    head, lm = head_and_target
    with pytest.raises(ValueError, match="CUDA"):
        CapturedTree(head, lm, capture=True)
    tree = CapturedTree(head, lm, capture=False)
    prefix = torch.zeros(head.config.kv_heads, 3, head.config.head_dim)
    with pytest.raises(ValueError, match="made for"):
        tree(SparrowHead(head.config), lm, prefix, prefix, torch.zeros(lm.hidden_size), 3, depth=2, topk=2, vocab=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs are captured on a CUDA device")
@torch.inference_mode()
def test_the_tree_and_the_step_replay_on_cuda():
    lm = load_model("zoo/weights/qwen-target", device="cuda")
    head = SparrowHead.load("zoo/weights/qwen-sparrow", lm)
    tree = CapturedTree(head, lm)
    tree.warm(depth=4, topk=8, vocab=64)
    for seed, length in enumerate((20, 41, 27)):           # one graph replayed for every length
        check_against_reference((head, lm), (30, 4, 8), seed, tree, length=length)
    assert tree.captures == 1
    step = CapturedHeadStep(head, lm)
    step.warm(rows=4)                                       # what warm_tree does at load (depth 3 + 1)
    assert step.captures == 4
    eager, captured = HeadCache.empty(head), HeadCache.empty(head)
    prompt = torch.randn(15, lm.hidden_size, device="cuda")
    for cache in (eager, captured):
        head(cache, prompt, torch.arange(15))
    for i, rows in enumerate((1, 3, 1)):                    # a graph per row count, replayed
        ids, features = torch.randint(0, 64, (rows,)), torch.randn(rows, lm.hidden_size, device="cuda")
        position = eager.length
        want = head(eager, head.fuse(lm.embed(ids), features), torch.arange(position, position + rows))
        got = step(captured, ids, features, position)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)    # float32 on the GPU (TF32 off by default)
    assert step.captures == 4                              # the warmed graphs, replayed
