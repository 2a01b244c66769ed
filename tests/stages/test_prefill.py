"""QuickPrefill on the executor and alone: group prefill without pruning is token-identical to
one-shot prefill and to generate(); pruning keeps ⌈ρ·n⌉ entries per group and layer; a pruned
cache keeps the kept tokens' positions and decodes at the logical positions; overlapped and
sequential runs agree; a decoder failing mid-stream cancels the prefill and leaves nothing
behind."""

from __future__ import annotations

import math

import pytest
import torch

from graph.context import StageContext
from graph.executor import Executor, StageFailed
from models.registry import release_all
from zoo.videos import make_video
from zoo.shapes import FPS
from stages.decode import QuickCodec, read_video
from stages.prefill import Prefill
from stages.prune import key_norm_scores, layer_ratios, top_k_indices
from stages.types import Request, VisualTokens
from tests.helpers import make
from tests.models.test_adapters import ARCHS, random_checkpoint
from tests.stages.test_generate import ar_nodes, reference_ids, run_graph

PROMPT = "what happened after the red circle appeared ?"


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    path = random_checkpoint(d / "model", "qwen-target", seed=1)
    video = d / "toy.mp4"
    make_video(21, 12, 2, 84, video)        # 24 frames at 2 fps: 12 temporal steps of 9 tokens
    yield {"path": str(path), "fps": 2, "size": 84, "name": "qwen"}, str(video)
    release_all()


def quickvideo_nodes(model, *, group_frames=4, prune=None, max_new_tokens=20):
    nodes = ar_nodes(model, mode="groups", max_new_tokens=max_new_tokens, group_frames=group_frames)
    nodes["prefill"]["stage"].update(group_frames=group_frames, prune=prune)
    return nodes


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("group_frames", [4, 5])
def test_group_prefill_with_ratio_one_is_token_identical_to_one_shot_and_generate(tmp_path, arch, group_frames):
    """5 frames a group is rounded up to 6 for Qwen2.5-VL (temporal patch of 2); the decoder's
    own groups (4 frames) differ from the prefill's, so the prefill re-cuts what arrives."""
    path = random_checkpoint(tmp_path / "model", ARCHS[arch], seed=1)
    video = tmp_path / "toy.mp4"
    make_video(21, 12, 2, 84, video)
    model = {"path": str(path), "fps": FPS[arch], "size": 84, "name": arch}
    try:
        one_shot = run_graph(ar_nodes(model), Request("v", str(video), PROMPT)).outputs["generate.tokens"]
        nodes = quickvideo_nodes(model, group_frames=group_frames, prune={"keep": 1.0})
        nodes["decode"]["stage"]["group_frames"] = 4
        grouped = run_graph(nodes, Request("v", str(video), PROMPT)).outputs["generate.tokens"]
        ref = reference_ids(model, str(video), PROMPT, 20)
    finally:
        release_all()
    assert len(set(ref)) > 3
    assert one_shot.ids == grouped.ids == ref
    stats = grouped.meta["prefill"]
    frames = 12 * FPS[arch]
    step = 2 if arch == "qwen2_5_vl" else 1
    size = math.ceil(group_frames / step) * step
    assert stats["groups"] == math.ceil(frames / size)
    assert stats["retention"] == 1.0


@pytest.mark.parametrize("importance", ["key_norm", "value_change"])
def test_each_group_keeps_ceil_ratio_of_its_entries_in_every_layer(qwen, importance):
    model, video = qwen
    prune = {"importance": importance, "keep": 0.3, "start_layer": 1, "decay": 0.8}
    tokens = run_graph(quickvideo_nodes(model, group_frames=10, prune=prune), Request("v", video, PROMPT)).outputs["generate.tokens"]
    stats = tokens.meta["prefill"]
    groups = [45, 45, 18]                         # 24 frames in groups of 10, 10, 4: 5, 5, 2 steps of 9 tokens
    expected = [sum(math.ceil(round(rho * n, 9)) for n in groups) for rho in layer_ratios(6, 0.3, 1, 0.8)]
    assert stats["groups"] == 3 and stats["video_tokens"] == sum(groups)
    assert stats["video_tokens_kept"] == expected
    assert expected[0] == sum(groups) and expected[1] == 14 + 14 + 6 and expected[-1] < expected[1]
    assert tokens.meta["prompt_tokens"] == stats["logical_length"]       # decoding counts pruned tokens


def _Ctx(item, request, sink: dict | None = None) -> StageContext:
    """The context the executor gives the prefill stage on a call; what it emits lands in `sink`."""
    return StageContext("prefill", item, torch.device("cpu"), request,
                        emit=lambda port, value: sink.__setitem__(port, value) if sink is not None else None,
                        end=lambda port: None, cancelled=lambda: False)


def test_a_pruned_cache_keeps_positions_and_decodes_at_the_logical_length(tmp_path):
    """With one decoder layer a token's key and value depend only on its embedding and position,
    so group prefill + key-norm pruning must equal a one-shot cache of every token with the same
    entries dropped afterwards; decoding continues at the logical length (counting the pruned
    tokens), and giving the next token the cache's length as position instead changes the logits."""
    path = random_checkpoint(tmp_path / "model", "qwen-target", seed=2, layer_types=["full_attention"],
                             num_hidden_layers=1)
    video = tmp_path / "toy.mp4"
    make_video(21, 12, 2, 84, video)
    model = {"path": str(path), "fps": 2, "size": 84}
    request = Request("v", str(video), PROMPT)
    try:
        stage = Prefill(model, mode="groups", group_frames=8, prune={"importance": "key_norm", "keep": 0.4})
        stage.setup(_Ctx(0, request))
        lm = stage.lm
        frames, _ = read_video(str(video), fps=2, size=84)
        for i, start in enumerate(range(0, 24, 8)):
            chunk = frames[start:start + 8]
            meta = {"frames": 8, "frame_hw": (84, 84), "fps": 2.0}
            stage(_Ctx(i, request), VisualTokens(i, lm.encode(chunk, last=start + 8 == 24), meta, last=start + 8 == 24),
                  request)
        kv = stage.finish(_Ctx(3, request))["kv"]
        layout = kv.layout

        embeds = lm.embed(layout.ids, lm.encode(frames), layout.video_start)
        full = lm.new_cache()
        lm.prefill(full, embeds, layout.positions)
        keys = lm.layer_kv(full, 0)[0]
        kept = list(range(layout.video_start))
        for g in range(3):                           # 4 steps x 9 tokens a group
            lo = layout.video_start + 36 * g
            kept += (lo + top_k_indices(key_norm_scores(keys[:, lo:lo + 36]), math.ceil(0.4 * 36))).tolist()
        kept += list(range(layout.video_start + layout.n_video, layout.length))
        lm.keep(full, torch.tensor(kept))

        assert lm.layer_lengths(kv.cache) == [len(kept)] and kv.logical_length == layout.length > len(kept)
        torch.testing.assert_close(lm.layer_kv(kv.cache, 0), lm.layer_kv(full, 0), rtol=1e-5, atol=1e-5)
        token = torch.tensor([int(kv.logits.argmax())])
        at_logical = lm.score(kv.cache, token, kv.logical_length, layout)
        lm.drop_last(kv.cache, 1)
        torch.testing.assert_close(at_logical, lm.score(full, token, layout.length, layout), rtol=1e-5, atol=1e-5)
        at_cache_length = lm.score(kv.cache, token, len(kept), layout)
        assert not torch.allclose(at_logical, at_cache_length, atol=1e-3)
    finally:
        release_all()


def test_overlapped_and_sequential_runs_give_the_same_tokens(qwen):
    model, video = qwen
    nodes = quickvideo_nodes(model, group_frames=6, prune={"importance": "key_norm", "keep": 0.5})
    out = {}
    for runner in ("threaded", "sequential"):
        spec, plan = make(nodes, runner=runner)
        with Executor(spec, plan, progress=False) as ex:
            out[runner] = ex.run(Request("v", video, PROMPT)).outputs["generate.tokens"].ids
    assert out["threaded"] == out["sequential"]
    assert len(out["threaded"]) == 20


def test_the_prefill_counts_the_arithmetic_of_its_prompt_whether_in_groups_or_at_once(qwen):
    """Unpruned groups attend to what came before and causally within themselves: together the
    very arithmetic of one causal forward over the prompt, so the two counts are equal; pruning
    shortens what later groups attend to. The encoder's count is the tower's over all frames."""
    from models.registry import get_model

    model, video = qwen
    cases = {"one_shot": ar_nodes(model, max_new_tokens=4),
             "groups": quickvideo_nodes(model, group_frames=6, prune={"keep": 1.0}, max_new_tokens=4),
             "pruned": quickvideo_nodes(model, group_frames=6, prune={"keep": 0.5}, max_new_tokens=4)}
    counts = {}
    for case, nodes in cases.items():
        result = run_graph(nodes, Request("v", video, PROMPT))
        counts[case] = {node: sum(c.counts.get("flops", 0) for c in result.calls if c.node == node)
                        for node in ("encode", "prefill")}
    lm = get_model(model)
    assert counts["one_shot"]["prefill"] == counts["groups"]["prefill"] > counts["pruned"]["prefill"] > 0
    assert {c["encode"] for c in counts.values()} == {lm.encode_flops(24, (84, 84))}


class FailingQuickCodec(QuickCodec):
    """QuickCodec whose first run fails after emitting `fail_after` groups (a decode error in the
    middle of a stream, with the prefill already under way)."""

    def __init__(self, fail_after: int = 2, **kwargs):
        super().__init__(**kwargs)
        self.fail_after, self.failed = fail_after, False

    def __call__(self, ctx, request):
        if self.failed:
            return super().__call__(ctx, request)
        outer = self

        class Failing:
            emitted = 0

            def __getattr__(self, name):
                return getattr(ctx, name)

            def emit(self, port, item):
                if port == "group" and self.emitted == outer.fail_after:
                    outer.failed = True
                    raise RuntimeError("corrupt packet in the middle of the video")
                self.emitted += port == "group"
                ctx.emit(port, item)

        return super().__call__(Failing(), request)


def test_a_decode_failure_mid_stream_cancels_the_prefill_cleanly(qwen, no_leftovers):
    """The decoder fails after two groups, with encode and prefill already working on them: the
    run raises naming the decoder, and no thread, process or shared memory is left behind."""
    model, video = qwen
    nodes = quickvideo_nodes(model, group_frames=4, prune={"keep": 0.5})
    nodes["decode"]["stage"]["_target_"] = f"{__name__}.FailingQuickCodec"
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False) as ex:
        with pytest.raises(StageFailed, match="decode.*corrupt packet"):
            ex.run(Request("v", video, PROMPT))


@pytest.mark.parametrize("keep", [1.0, 0.3])
def test_fastv_drops_visual_tokens_after_layer_k_only(tmp_path, keep):
    """FastV inside the forward: layers ≤ K cache every token, later layers only the kept ones;
    keeping every token is exactly the unpruned forward (the drop machinery changes nothing else),
    and decoding from a FastV cache continues at the logical positions."""
    path = random_checkpoint(tmp_path / "model", "qwen-target", seed=4)
    video = tmp_path / "toy.mp4"
    make_video(21, 12, 2, 84, video)
    request = Request("v", str(video), PROMPT)
    model = {"path": str(path), "fps": 2, "size": 84, "attn_implementation": "reelflow"}
    try:
        out = {}
        for name, extra in (("plain", {}), ("fastv", {"fastv": {"layer": 2, "keep": keep}})):
            stage = Prefill(model, **extra)
            stage.setup(_Ctx(0, request))
            frames, _ = read_video(str(video), fps=2, size=84)
            stage(_Ctx(0, request), VisualTokens(0, stage.lm.encode(frames), {"frames": 24, "frame_hw": (84, 84), "fps": 2.0},
                                                 last=True), request)
            out[name] = stage.finish(_Ctx(1, request))["kv"]
        lm, layout = stage.lm, out["plain"].layout
        lengths = lm.layer_lengths(out["fastv"].cache)
        kept = math.ceil(keep * layout.n_video)
        text = layout.length - layout.n_video
        assert lengths == [layout.length] * 2 + [text + kept] * 4
        token = torch.tensor([int(out["plain"].logits.argmax())])
        a = lm.score(out["plain"].cache, token, layout.length, layout)
        b = lm.score(out["fastv"].cache, token, layout.length, layout)
        if keep == 1.0:
            torch.testing.assert_close(out["fastv"].logits, out["plain"].logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        else:
            assert not torch.allclose(a, b, atol=1e-3)
    finally:
        release_all()




def test_group_prefill_publishes_taps_of_every_row_as_one_shot_does(qwen):
    """A draft reading the target's states (Sparrow's head, UV-Prune) behind QuickPrefill: groups mode
    publishes the chosen layers' states of every prompt row, and with nothing pruned they are the
    one-shot prefill's (fp32; the groups only split the attention's sums differently, so the
    difference is rounding: ~1e-6 of the layer's largest value here, 1e-5 of it leaves room for
    other CPUs' kernels)."""
    model, video = qwen
    request = Request("v", video, PROMPT)
    frames, _ = read_video(video, fps=2, size=84)
    published = {}
    for mode in ("one_shot", "groups"):
        stage = Prefill(model, mode=mode, group_frames=8, taps=[0, 3, 6])
        stage.setup(_Ctx(0, request))
        sink = published[mode] = {}
        for i, start in enumerate(range(0, 24, 8)):
            last = start + 8 == 24
            meta = {"frames": 8, "frame_hw": (84, 84), "fps": 2.0}
            stage(_Ctx(i, request, sink), VisualTokens(i, stage.lm.encode(frames[start:start + 8], last=last), meta,
                                                         last=last), request)
        assert "taps" not in sink                                     # not before the text after the video
        stage.finish(_Ctx(3, request, sink))
    one_shot, grouped = published["one_shot"]["taps"], published["groups"]["taps"]
    assert sorted(grouped.layers) == [0, 3, 6] and grouped.layout.length == one_shot.layout.length
    for layer in (0, 3, 6):
        assert grouped.layers[layer].shape == (one_shot.layout.length, stage.lm.text_config.hidden_size)
        scale = float(one_shot.layers[layer].abs().max())            # the random model's residual stream reaches ~1e3
        torch.testing.assert_close(grouped.layers[layer], one_shot.layers[layer], rtol=1e-4, atol=1e-5 * scale)
