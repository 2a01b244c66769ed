"""The captured lean step (models.captured_step): the step over the cache's whole buffers with the
held length as data, tokens padded to a bucket, new keys and values written inside the step.

On the CPU its body runs uncaptured (capture=False): the same operations a CUDA graph replays.
There it must decode the eager lean path's tokens over 64 greedy steps and score trees and chains
of every bucket, padded or above the largest, as the eager path does, whatever the spare room
holds. Where CUDA is present the graphs themselves are checked in bfloat16 against the eager
path, for the toy target and a random 7B-shaped model.

Tolerances: in float32 the split sums the same terms in another order (1e-4 on logits of size
~10, as tests/models/test_compiled_step.py). In bfloat16 two paths that round differently can
be held to logits within LOGIT_TOL of each other, and to the same greedy token wherever the
reference's top two logits are more than twice that apart (a logit moved by at most LOGIT_TOL
cannot overtake one that leads by more than 2 LOGIT_TOL): see _assert_same_greedy."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from models.captured_step import BUCKETS, CapturedStep, bucket_of
from models.decoding import greedy, prefill_video
from models.load import ModelError, load_model
from models.packing import packed_layers
from speculative.tree import bushy_tree, tree_depths, tree_mask
from zoo.train.data import example

TARGET = "zoo/weights/qwen-target"
CUDA = torch.cuda.is_available()
# bf16 keeps 8 significant bits; the eager path's one-token attention keeps its scores in float32
# (sdpa's flash kernel) where the captured one rounds them to bf16 before the softmax, in every
# layer. Measured on an H100: at most 0.09-0.13 (toy target, logits ~10), 0.28 (7B shape); 0.5
# leaves room for another card's kernels.
LOGIT_TOL = 0.5


def _prefilled(lm, ex):
    cache, layout, logits = prefill_video(lm, ex.frames, 2, ex.prompt)
    return cache, logits, layout.length, layout


def _scores(lm, ex, trees, chains):
    """Each tree's and each chain's logits over the prefilled cache, rolled back after each."""
    cache, _, start, layout = _prefilled(lm, ex)
    ids = torch.arange(80) % (lm.vocabulary - 3) + 3
    out = []
    for parents in trees:
        n = parents.shape[0]
        out.append(lm.score_tree(cache, ids[:n], tree_mask(parents), tree_depths(parents), start, layout))
        lm.drop_last(cache, n)
    for k in chains:
        out.append(lm.score(cache, ids[:k], start, layout))
        lm.drop_last(cache, k)
    return out


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 5, 30, 32, 33)] == [1, 2, 4, 8, 32, 32, None]
    assert BUCKETS == tuple(sorted(BUCKETS))


@pytest.mark.parametrize("garbage, packed", [(False, False), (True, False), (False, True)])
def test_the_buffered_body_decodes_the_eager_paths_tokens(garbage, packed):
    """64 greedy steps, then trees and chains padded to buckets (12 → 16, 30 → 32, 5 → 8),
    equal the eager lean path's; with garbage in the spare room (finite
    values a rollback leaves) as with zeros; with the packed weights' fused products (q, k, v in
    one product, gate and up in one: the same terms summed in another blocking, float32 rounding)."""
    ex = example(7, 30, 2)
    lm = load_model(TARGET)
    trees, chains = [bushy_tree(n) for n in (12, 30)], (1, 5, 8)
    want_tokens = greedy(lm, *_prefilled(lm, ex), 64)
    want_scores = _scores(lm, ex, trees, chains)

    step = CapturedStep(lm.lean, "cudagraph", capture=False, packed=packed_layers(lm.text) if packed else False)
    assert (step.packed is not None) == packed
    lm.lean.step = step
    cache, logits, start, layout = _prefilled(lm, ex)
    if garbage:
        for layer in cache.layers:
            layer.reserve(200)
            for buf in layer.buffers():
                buf[..., layer.get_seq_length():, :] = 1e4 * torch.randn_like(buf[..., layer.get_seq_length():, :])
    assert greedy(lm, cache, logits, start, layout, 64) == want_tokens
    for got, want in zip(_scores(lm, ex, trees, chains), want_scores):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert set(step._buckets) == {1, 8, 16, 32}


def test_the_graphs_kept_are_the_most_recently_replayed_whatever_their_bucket():
    """Over MAX_GRAPHS the least recently replayed graph goes, never the one just captured: a new
    bucket's first graph over a full set used to be dropped at once (its bucket had the fewest),
    and the replay that followed failed on the missing key. Bookkeeping only: no capture here."""
    from models.captured_step import MAX_GRAPHS

    lm = load_model(TARGET)
    step = CapturedStep(lm.lean, "cudagraph", capture=False)
    one, eight = step._bucket(1, torch.zeros(1, lm.hidden_size)), step._bucket(8, torch.zeros(8, lm.hidden_size))
    for key in range(MAX_GRAPHS):
        step._remember(one, key, ("graph", key))
    step._touch(one, 0)                                   # replayed again: now the most recent
    step._remember(eight, "first", ("graph", "first"))    # one over the limit
    assert "first" in eight.graphs and len(one.graphs) == MAX_GRAPHS - 1
    assert 0 in one.graphs and 1 not in one.graphs        # the least recently replayed went
    assert next(reversed(one.graphs)) == 0                # latest_graph's pick in its bucket


def test_more_tokens_than_the_largest_bucket_run_uncaptured():
    lm = load_model(TARGET)
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(40 + BUCKETS[-1] + 8, lm.hidden_size, generator=g)
    prefix, new = embeds[:40], embeds[40:]
    positions = torch.arange(embeds.shape[0])
    caches = []
    for step in (None, CapturedStep(lm.lean, "cudagraph", capture=False)):
        cache = lm.new_cache()
        lm.lean.forward_eager(cache, prefix, positions[:40])
        lm.lean.step = step
        caches.append((lm.lean.forward(cache, new, positions[40:]), cache))
    (want, eager), (got, captured) = caches
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert captured.get_seq_length() == eager.get_seq_length() == embeds.shape[0]


def test_one_compiled_layer_serves_every_layer_and_length_without_recompiling():
    """reduce-overhead compiles buffered_layer once (and once more for one token), whatever the
    layer, the cache length or the bucket: a recompile raises. Uncaptured here, as on the CPU."""
    ex = example(5, 30, 2)
    lm = load_model(TARGET)
    want_tokens = greedy(lm, *_prefilled(lm, ex), 32)
    want_scores = _scores(lm, ex, [bushy_tree(20)], (4,))
    torch._dynamo.reset()
    counters.clear()
    step = CapturedStep(lm.lean, "reduce-overhead", capture=False)
    step.warm(lm.device, lm.dtype)
    assert not counters["graph_break"], dict(counters["graph_break"])      # the layer is one graph
    lm.lean.step = step
    with torch.compiler.set_stance("fail_on_recompile"):
        assert greedy(lm, *_prefilled(lm, ex), 32) == want_tokens
        for got, want in zip(_scores(lm, ex, [bushy_tree(20)], (4,)), want_scores):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_layers_of_different_lengths_after_pruning():
    """A cache whose layers were pruned to different lengths (FastV keeps all tokens below its
    layer): each layer attends to its own held entries."""
    ex = example(3, 30, 2)
    lm = load_model(TARGET)

    def run():
        cache, logits, start, layout = _prefilled(lm, ex)
        n = cache.get_seq_length()
        keep = [torch.arange(n) if i < 2 else torch.arange(0, n, 3) for i in range(len(cache.layers))]
        lm.keep(cache, keep)
        return greedy(lm, cache, logits, start, layout, 16)

    want = run()
    lm.lean.step = CapturedStep(lm.lean, "cudagraph", capture=False)
    assert run() == want


def test_capture_needs_cuda():
    if CUDA:
        pytest.skip("this machine has CUDA: the refusal is for CPU-only machines")
    with pytest.raises(ModelError, match="needs a CUDA device"):
        load_model(TARGET, compile="cudagraph")
    lm = load_model(TARGET)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CapturedStep(lm.lean, "reduce-overhead", capture=True)


# ----------------------------------------------------------------------------- on a GPU

def _assert_same_greedy(lm, steps: int, build, variants=(("cudagraph", False), ("reduce-overhead", False))):
    """Teacher-forced on the eager path's greedy tokens, each captured variant's (mode, packed:
    the fused products of models.packing) logits stay within
    LOGIT_TOL of the eager path's, and it picks the same token at every step where the eager
    logits' top two are more than 2 LOGIT_TOL apart; trees and a chain in padded buckets score
    within LOGIT_TOL too. Prints the near ties and the largest
    difference (the GPU session's log keeps them)."""
    def run(step):
        lm.lean.step = step
        cache, logits, start, layout = build()
        tokens, rows = [], [logits]
        for i in range(steps):
            token = int(rows[-1].argmax()) if step is None else eager_tokens[i]
            tokens.append(token)
            rows.append(lm.score(cache, torch.tensor([token]), start + i, layout)[-1])
        return tokens, torch.stack(rows).float()

    def several(step):
        """trees of 12 and 30 nodes and a 5-token chain (buckets 16, 32, 8: padded replays)"""
        lm.lean.step = step
        cache, _, start, layout = build()
        ids = torch.tensor((eager_tokens * 30)[:30])
        out = []
        for parents in (bushy_tree(12), bushy_tree(30)):
            n = parents.shape[0]
            out.append(lm.score_tree(cache, ids[:n], tree_mask(parents), tree_depths(parents), start, layout).float())
            lm.drop_last(cache, n)
        out.append(lm.score(cache, ids[:5], start, layout).float())
        return out

    eager_tokens, want = run(None)
    want_several = several(None)
    top2 = want.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_TOL
    for mode, packed in variants:
        step = CapturedStep(lm.lean, mode, packed=packed_layers(lm.text) if packed else False)
        step.warm(lm.device, lm.dtype)
        mode = f"{mode}, packed" if packed else mode
        with torch.compiler.set_stance("fail_on_recompile"):
            _, got = run(step)
        assert step.captures >= len(BUCKETS) + 1          # the warm-up's buckets, then this cache's one-token graph
        worst = float((got - want).abs().max())
        same = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        print(f"{lm.name} {mode}: {steps} steps, {int((~decided).sum())} within 2 × {LOGIT_TOL} of a tie, "
              f"max |Δ logit| {worst:.3f}, same token at {same:.0%} of the steps")
        assert worst <= LOGIT_TOL, mode
        for got_n, want_n in zip(several(step), want_several):
            torch.testing.assert_close(got_n, want_n, rtol=0, atol=LOGIT_TOL)
        assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided]), mode
    lm.lean.step = None


@pytest.mark.skipif(not CUDA, reason="CUDA graphs are captured on a CUDA device")
def test_captured_graphs_decode_the_eager_paths_tokens_on_the_toy_target():
    lm = load_model(TARGET, dtype="bfloat16", device="cuda")
    ex = example(7, 30, 2)
    _assert_same_greedy(lm, 64, lambda: _prefilled(lm, ex),
                        [(mode, packed) for mode in ("cudagraph", "reduce-overhead") for packed in (False, True)])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs are captured on a CUDA device")
def test_captured_graphs_decode_the_eager_paths_tokens_at_7b_shape():
    lm = load_model("random:qwen2.5-vl-7b", dtype="bfloat16", device="cuda")
    frames = torch.randint(0, 256, (8, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    # the packed variants run on the toy target above: the same operations, and another 7B compile
    # would cost a minute of a card's scarce time
    _assert_same_greedy(lm, 64, lambda: _prefilled_frames(lm, frames))


def _prefilled_frames(lm, frames):
    cache, layout, logits = prefill_video(lm, frames, 2, "describe the video .")
    return cache, logits, layout.length, layout


def test_a_packed_models_step_runs_its_fused_products():
    """load_model(pack=True) packs the layers in place (the model's weights become views of the
    packed tensors, a layer at a time); a captured step built on it then multiplies by the packed
    tensors (lean.packed), and still decodes the as-loaded model's tokens."""
    ex = example(4, 30, 2)
    plain = load_model(TARGET, pack=False)
    want = greedy(plain, *_prefilled(plain, ex), 32)
    lm = load_model(TARGET, pack=True)
    assert lm.lean.packed is not None
    assert lm.lean.layers[0].q.data_ptr() == lm.lean.packed[0].qkv.data_ptr()     # a view, not a copy
    step = CapturedStep(lm.lean, "cudagraph", capture=False)
    assert step.packed is lm.lean.packed
    lm.lean.step = step
    assert greedy(lm, *_prefilled(lm, ex), 32) == want
    torch._dynamo.reset()
    counters.clear()
    lm.lean.step = CapturedStep(lm.lean, "reduce-overhead", capture=False)
    lm.lean.step.warm(lm.device, lm.dtype)
    assert not counters["graph_break"], dict(counters["graph_break"])      # the packed layer too
    assert greedy(lm, *_prefilled(lm, ex), 32) == want
    with pytest.raises(ValueError, match="packed layers for a decoder"):
        CapturedStep(lm.lean, "cudagraph", capture=False, packed=lm.lean.packed[:2])


@pytest.mark.skipif(not CUDA, reason="times CUDA graphs' replays")
def test_pack_auto_measures_the_products_as_cuda_graphs_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU, pack=auto with captured steps times as-loaded and fused products as CUDA graphs
    (models.packing._timer) and keeps its choice; the step then runs what was chosen."""
    from models import packing

    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    timed = {}
    real = packing.products_ms

    def spy(*args, **kwargs):
        timed.update(real(*args, **kwargs))
        return timed
    monkeypatch.setattr(packing, "products_ms", spy)
    lm = load_model(TARGET, dtype="bfloat16", device="cuda", compile="cudagraph", pack="auto")
    assert set(timed) == {"as_loaded", "packed"} and all(ms > 0 for ms in timed.values())
    print(f"toy target's products on {torch.cuda.get_device_name()}: {timed}")
    assert (lm.lean.step.packed is not None) == (min(timed, key=timed.get) == "packed")
