"""The compiled lean step (models.compiled_step): split attention (the cached prefix without a
mask, the new tokens with theirs, merged by log-sum-exp) is attention over the whole; a model
loaded with compile decodes the eager lean path's tokens over 64 greedy steps, verifies a tree as
the eager path does, and does not recompile from one step to the next.

Tolerances: the split sums the same float32 terms in another order, so results agree to a few
float32 roundings of values of size ~1 (attention outputs) or ~10 (logits): 1e-5 and 1e-4."""

from __future__ import annotations

import pytest
import torch

from models import cpu_attention
from models.compiled_step import split_attention
from models.compiling import compile_records
from models.decoding import greedy, prefill_video
from models.load import ModelError, load_model
from speculative.tree import bushy_tree, tree_depths, tree_mask
from tests.models.test_attention import reference
from zoo.train.data import example

TARGET = "zoo/weights/qwen-target"
DRAFT = "zoo/weights/qwen-draft"


@pytest.mark.parametrize("n, cached, heads, kv_heads, tree", [(1, 50, 4, 2, False), (5, 300, 4, 2, False),
                                                             (16, 40, 8, 1, False), (30, 200, 4, 2, True)])
@pytest.mark.parametrize("kernel", [False, True])
def test_split_attention_is_attention_over_prefix_and_new_tokens(n, cached, heads, kv_heads, tree, kernel):
    """By torch's products, and with the prefix's part by the CPU kernel (models.cpu_attention)."""
    assert not kernel or cpu_attention.serves(16, torch.float32, "cpu")
    g = torch.Generator().manual_seed(n + cached)
    q = torch.randn(heads, n, 16, generator=g)
    k, v = torch.randn(kv_heads, n, 16, generator=g), torch.randn(kv_heads, n, 16, generator=g)
    keys, values = torch.randn(kv_heads, cached, 16, generator=g), torch.randn(kv_heads, cached, 16, generator=g)
    among = tree_mask(bushy_tree(n)) if tree else torch.ones(n, n, dtype=torch.bool).tril()
    whole = torch.ones(n, cached + n, dtype=torch.bool)
    whole[:, cached:] = among
    want = reference(q[None], torch.cat([keys, k], 1)[None], torch.cat([values, v], 1)[None], whole[None, None], 0.25)
    got = split_attention(q, k, v, keys, values, among, 0.25, kernel=kernel)
    torch.testing.assert_close(got, want.reshape(n, heads * 16), rtol=1e-5, atol=1e-5)


def test_a_compiled_model_decodes_the_eager_lean_paths_tokens_without_recompiling():
    """Loading compiles and warms every shape a run takes: from then on, steps over caches of any
    length, k-token verifications and trees of any size run without a compile (a recompile raises)."""
    ex = example(7, 30, 2)
    eager = load_model(TARGET)
    torch._dynamo.reset()
    compiled = load_model(TARGET, compile="default")
    assert compiled.compile == "default" and "lean step" in compile_records()[-1]["what"]
    assert compiled.lean.prefix_kernel          # the prefix's attention by the CPU kernel
    trees = [bushy_tree(n) for n in (12, 20)]
    ids = torch.arange(20) + 3

    def score_trees(lm):
        cache, _, start, layout = _prefilled(lm, ex)
        out = []
        for parents in trees:
            n = parents.shape[0]
            out.append(lm.score_tree(cache, ids[:n], tree_mask(parents), tree_depths(parents), start, layout))
            lm.drop_last(cache, n)
        return out

    want = greedy(eager, *_prefilled(eager, ex), 64)
    with torch.compiler.set_stance("fail_on_recompile"):
        assert greedy(compiled, *_prefilled(compiled, ex), 64) == want
        got = score_trees(compiled)
    for g, r in zip(got, score_trees(eager)):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-4)


def test_each_compiled_model_keeps_graphs_of_its_own(monkeypatch):
    """torch.compile keeps at most 8 graphs per code object and runs anything past them eagerly,
    without a word: a target and a draft of two shapes, each warmed at two thread counts and two
    token counts, fill a shared list, and a third shape (a third model, a thread count more) ran
    eagerly. Each model's step has a code object of its own, and compiles its own graphs."""
    from torch._dynamo.utils import counters

    import models.compiled_step

    monkeypatch.setattr(models.compiled_step, "thread_counts", lambda device: (1, 2))
    before = counters["stats"]["unique_graphs"]
    lms = [load_model(path, compile="default") for path in (DRAFT, DRAFT, "zoo/weights/llava-draft")]
    assert counters["stats"]["unique_graphs"] - before == 4 * len(lms)
    assert len({id(lm.lean.step._fn._torchdynamo_orig_callable.__code__) for lm in lms}) == len(lms)


def _prefilled(lm, ex):
    cache, layout, logits = prefill_video(lm, ex.frames, 2, ex.prompt)
    return cache, logits, layout.length, layout


def test_compile_settings_are_checked():
    with pytest.raises(ModelError, match="compile='fast'"):
        load_model(TARGET, compile="fast")
    with pytest.raises(ModelError, match="lean"):
        load_model(TARGET, compile="default", lean=False)
    with pytest.raises(ModelError, match="auto"):
        load_model(TARGET, compile="fastest")


def test_auto_measures_once_then_reads_its_choice(tmp_path, monkeypatch):
    """`compile: auto` times both paths on this machine, keeps the faster, and remembers it: a
    second load reads the choice and measures nothing."""
    import json

    from models import compile_auto

    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    lm = load_model(DRAFT, compile="auto")          # the small model of the pair: its compile is the short one
    (key, choice), = json.loads((tmp_path / compile_auto.CHOICES_FILE).read_text()).items()
    assert "qwen-draft" in key and set(choice["ms"]) == {"off", "default"}
    assert lm.compile == choice["mode"] == min(choice["ms"], key=choice["ms"].get)
    assert (lm.lean.step is None) == (lm.compile == "off")

    def measured_again(*a, **k):
        raise AssertionError("auto measured a second time")

    monkeypatch.setattr(compile_auto, "measure_modes", measured_again)
    assert load_model(DRAFT, compile="auto").compile == choice["mode"]
