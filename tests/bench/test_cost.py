"""The forward-cost stage behind bench_step: its shapes and tree, the bytes a step reads, and one
run through the executor that records a timer per shape and per copy, leaving the cache as it was."""

from __future__ import annotations

import pytest
import torch

from bench.cost import parse_shape, step_bytes
from graph.executor import Executor
from models.load import load_model
from models.registry import release_all
from stages.types import Request
from tests.helpers import make, node
from tests.models.test_adapters import random_checkpoint
from zoo.shapes import FPS
from zoo.videos import make_video


def test_shapes_parse_and_bad_ones_are_refused():
    assert parse_shape(1) == ("chain", 1) and parse_shape("k8") == ("chain", 8)
    assert parse_shape("tree30") == ("tree", 30)
    for bad in ("k0", "tree", "x3", -2):
        with pytest.raises(ValueError, match="shape"):
            parse_shape(bad)


def test_step_bytes_count_layers_norm_head_and_cached_entries(tmp_path):
    lm = load_model(str(random_checkpoint(tmp_path / "m", "qwen-draft")))
    cache = lm.new_cache()
    x = torch.randn(10, lm.text_config.hidden_size)
    lm.prefill(cache, x, torch.arange(10).expand(3, 10))
    params = [*lm.text.layers.parameters(), *lm.text.norm.parameters(), lm.lm_head.weight]
    with torch.no_grad():           # float32 values no bfloat16 holds (norms start at 1, biases at 0: both would)
        for p in params:
            p.copy_(torch.rand_like(p) + 1 + 2.0 ** -20)
    sizes = step_bytes(lm, cache)
    assert sizes["weight_bytes"] == sum(p.numel() for p in params) * 4
    assert sizes["cache_bytes"] == lm.cache_bytes(cache) == 2 * 2 * 1 * 64 * 10 * 4   # k, v x layers x kv heads x dim
    with torch.no_grad():           # a bfloat16 checkpoint loaded in float32: every weight counts 2 bytes
        for p in params:
            p.copy_(p.bfloat16().float())
    assert step_bytes(lm, cache)["weight_bytes"] == sum(p.numel() for p in params) * 2


def test_step_cost_times_every_shape_and_leaves_the_cache_as_it_was(tmp_path):
    target = {"path": str(random_checkpoint(tmp_path / "t", "qwen-draft")), "fps": FPS["qwen2_5_vl"], "size": 84}
    video = tmp_path / "v.mp4"
    make_video(3, 6, 2, 84, video)
    nodes = {
        "source": node("stages.source.Source"),
        "decode": node("stages.decode.QuickCodec", inputs={"request": "source.request"}, fps=2, size=84,
                       group_frames=8, workers=1),
        "encode": node("stages.encode.VisionEncoder", on="target", inputs={"group": "decode.group"}, model=target,
                       fps=2),
        "prefill": node("stages.prefill.Prefill", on="target", inputs={"tokens": "encode.tokens",
                                                                     "request": "source.request"},
                        model=target, max_new_tokens=40),
        "probe": node("bench.cost.StepCost", on="target", inputs={"kv": "prefill.kv"}, model=target,
                      shapes=[1, "k4", "tree6"], repeats=3),
    }
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False, record=("prefill.kv",)) as ex:
        result = ex.run(Request("v", str(video), "describe the video ."))
    release_all()
    probe = next(c for c in result.calls if c.node == "probe" and c.phase == "call")
    counts = {}
    for name, t0, t1 in probe.parts:
        assert t1 >= t0
        counts[name] = counts.get(name, 0) + 1
    assert counts == {"k1": 3, "k4": 3, "tree6": 3, "matmul": 3, "copy": 3}     # the warm-ups are not timed
    # interleaved, a round of every shape at a time: drift over the run falls on every shape alike;
    # the copy last, so that each round's first forward reads its weights from memory
    assert [name for name, _, _ in probe.parts] == ["k1", "k4", "tree6", "matmul", "copy"] * 3
    meta = result.outputs["probe.tokens"].meta
    kv = result.outputs["prefill.kv"]
    assert meta["cache_entries"] == kv.layout.length                     # every forward rolled back
    assert meta["step_bytes"] == meta["weight_bytes"] + meta["cache_bytes"] and meta["lean"] is True
    assert meta["copy_bytes"] == 2 * 4 * (meta["step_bytes"] // 4)
    assert meta["matmul_flops"] == 2 * 1024**3                            # the CPU's probe: 1,024 a side
    entries = meta["cache_entries"]
    lm = load_model(target["path"])
    assert (meta["flops_k1"], meta["flops_k4"], meta["flops_tree6"]) == tuple(
        lm.forward_flops(n, entries) for n in (1, 4, 6))


def test_forward_flops_count_every_weight_matrix_and_attention_over_each_key(tmp_path):
    # 3 layers, 4 query heads of 32, 1 KV head: a formula that drops the layers, counts KV heads
    # for query heads or takes the hidden size for the head size gives another number
    lm = load_model(str(random_checkpoint(tmp_path / "m", "qwen-draft", num_hidden_layers=3, num_attention_heads=4,
                                          layer_types=["full_attention"] * 3)))
    c = lm.text_config
    assert (c.hidden_size, c.intermediate_size, c.num_key_value_heads) == (128, 384, 1)
    per_layer = 128 * 128 + 2 * 128 * 32 + 128 * 128 + 3 * 128 * 384          # q, k, v, o; gate, up, down
    weights = 3 * per_layer + c.vocab_size * 128                               # and the LM head
    assert weights == sum(p.numel() for p in [*lm.text.layers.parameters(), lm.lm_head.weight] if p.dim() == 2)
    # a token over 10 cached entries and itself: in each of 3 layers, 4 heads score 11 keys and sum
    # 11 values of 32, a multiply-add (2 FLOPs) an element
    assert lm.forward_flops(1, 10) == 2 * (weights + 3 * 4 * 2 * 32 * 11)
    assert lm.forward_flops(4, 10) == 4 * 2 * (weights + 3 * 4 * 2 * 32 * 14)
