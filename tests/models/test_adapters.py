"""The VideoLM protocol against the unmodified transformers models: our prefill + scoring loop is
token-identical to `generate(do_sample=False)` for both architectures, one-shot and group-wise;
positions are 3-D where they must be and survive pruning; crop, keep and taps do what they say;
bad checkpoints are clear errors. Checkpoints are random-weight zoo shapes saved and loaded the
way real ones are (weights scaled up so that greedy outputs are not one repeated token)."""

from __future__ import annotations

import json

import pytest
import torch

from models.load import ModelError, load_model, shared_vocabulary
from models.prompt import PromptError
from zoo.tokenizer import build_tokenizer
from zoo.train.data import example
from zoo.train.toy import save
from zoo.shapes import FPS, zoo_config

ARCHS = {"qwen2_5_vl": "qwen-draft", "llava_onevision": "llava-draft"}


def random_checkpoint(path, zoo_name: str, seed: int = 0, never_stops: bool = False, **text_overrides):
    """A randomly initialised zoo model saved like a trained one. `never_stops`: the end-of-turn
    token's (tied) embedding row is zeroed, so its logit is 0 among large random ones and greedy
    generation runs to its token budget: tests that count rounds need every token."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = zoo_config(zoo_name)
    config.text_config.initializer_range = 0.3
    for k, v in text_overrides.items():
        setattr(config.text_config, k, v)
    model = AutoModelForImageTextToText.from_config(config)
    if never_stops:
        with torch.no_grad():
            for table in (model.get_input_embeddings(), model.get_output_embeddings()):
                table.weight[config.text_config.eos_token_id] = 0.0
    save(model, build_tokenizer(config.model_type), path)
    return path


@pytest.fixture(scope="module", params=list(ARCHS))
def lm(request, tmp_path_factory):
    path = random_checkpoint(tmp_path_factory.mktemp(request.param), ARCHS[request.param])
    return load_model(str(path))


@pytest.fixture(scope="module")
def video(lm):
    fps = FPS[lm.arch]
    # 25 s: an odd frame count at 1 fps; at 2 fps the video's temporal positions (25 steps) reach
    # beyond the text after it, where decoding must go on from the last prompt position
    ex = example(11, 25, fps)
    return ex.frames, fps


def reference(lm, layout, frames, fps, n):
    inputs = lm.generate_inputs(layout, frames, fps)
    out = lm.model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, layout.length:].tolist()


def our_greedy(lm, layout, frames, n, groups=None, cuts=None):
    """Encode in frame groups, prefill in chunks at `cuts`, then one token a step."""
    groups = groups or [(0, frames.shape[0])]
    video = torch.cat([lm.encode(frames[a:b], last=b == frames.shape[0]) for a, b in groups])
    embeds = lm.embed(layout.ids, video, layout.video_start)
    cuts = cuts or [0, layout.length]
    cache = lm.new_cache()
    for a, b in zip(cuts, cuts[1:]):
        logits = lm.prefill(cache, embeds[a:b], layout.positions[:, a:b])
    out, pos = [], layout.length
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = lm.score(cache, torch.tensor(out[-1:]), pos, layout)[-1]
        pos += 1
    return out


def test_one_shot_prefill_is_token_identical_to_generate(lm, video):
    frames, fps = video
    layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
    ref = reference(lm, layout, frames, fps, 24)
    assert len(set(ref)) > 3, "the reference must not be one repeated token, or the test proves little"
    assert our_greedy(lm, layout, frames, 24) == ref


def test_group_prefill_is_token_identical_to_generate(lm, video):
    frames, fps = video
    n = frames.shape[0]
    layout = lm.layout("what color is the star at the end ?", n, tuple(frames.shape[-2:]), fps)
    ref = reference(lm, layout, frames, fps, 24)
    step = 2 if lm.arch == "qwen2_5_vl" else 1
    groups = [(0, 2 * step), (2 * step, 6 * step if 6 * step < n else n), (min(6 * step, n), n)]
    groups = [(a, b) for a, b in groups if b > a]
    v = layout.video_start
    cuts = [0, v + 5, v + layout.n_video // 2, v + layout.n_video, layout.length]
    assert our_greedy(lm, layout, frames, 24, groups=groups, cuts=cuts) == ref


def test_qwen_positions_are_3d_mrope_and_decode_continues_at_length_plus_rope_delta(tmp_path):
    lm = load_model(str(random_checkpoint(tmp_path / "q", "qwen-draft")))
    layout = lm.layout("describe the video .", 8, (84, 84), 2.0)
    assert layout.positions.shape == (3, layout.length)
    video = layout.positions[:, layout.video]
    assert not torch.equal(video[0], video[1]) and not torch.equal(video[1], video[2])   # never 1-D
    assert video[0].unique().numel() == 4                    # 8 frames -> 4 temporal patches
    assert layout.rope_delta < 0                             # 9 tokens share a temporal position
    assert layout.decode_positions(layout.length, 2).tolist() == [[layout.length + layout.rope_delta,
                                                                   layout.length + layout.rope_delta + 1]] * 3


def test_keep_preserves_positions_so_a_pruned_cache_equals_prefilling_only_the_kept_tokens(lm, video):
    """Prune the last video tokens right after they are cached (so no kept entry has attended to
    them), then prefill the text after the video at its unpruned positions: the same as never
    having had the pruned tokens, and different from giving the text shifted-down positions."""
    frames, fps = video
    layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
    embeds = lm.embed(layout.ids, lm.encode(frames), layout.video_start)
    end = layout.video_start + layout.n_video
    kept = torch.arange(end - 7)
    full = lm.new_cache()
    lm.prefill(full, embeds[:end], layout.positions[:, :end])
    lm.keep(full, kept)
    assert lm.cached_length(full) == end - 7
    a = lm.prefill(full, embeds[end:], layout.positions[:, end:])
    only = lm.new_cache()
    lm.prefill(only, embeds[kept], layout.positions[:, kept])
    b = lm.prefill(only, embeds[end:], layout.positions[:, end:])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    shifted = lm.new_cache()
    lm.prefill(shifted, embeds[kept], layout.positions[:, kept])
    c = lm.prefill(shifted, embeds[end:], layout.positions[:, end:] - 7)
    assert not torch.allclose(a, c, atol=1e-3)


def test_crop_rolls_back_scored_tokens(lm, video):
    frames, fps = video
    layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
    cache = lm.new_cache()
    lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions)
    first = lm.score(cache, torch.tensor([7, 8, 9]), layout.length, layout)
    lm.crop(cache, layout.length)
    assert lm.cached_length(cache) == layout.length
    # What a rollback must give: the cache exactly as before the scored tokens. The same 3 tokens
    # scored again run the same shapes through the same kernels over the same cache, so the logits
    # are bit-identical on any machine; a shorter forward may pick other kernels and sum in another
    # order (docs/design.md, pitfall 4), so against it only the prediction is compared.
    again = lm.score(cache, torch.tensor([7, 8, 9]), layout.length, layout)
    assert torch.equal(again, first)
    lm.crop(cache, layout.length)
    shorter = lm.score(cache, torch.tensor([7, 8]), layout.length, layout)
    assert torch.equal(shorter.argmax(-1), first[:2].argmax(-1))
    with pytest.raises(ValueError, match="cannot crop"):
        lm.crop(cache, layout.length + 10)


def test_taps_publish_each_layers_hidden_states_mid_forward(lm, video):
    frames, fps = video
    layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
    seen = {}
    embeds = lm.embed(layout.ids, lm.encode(frames), layout.video_start)
    lm.prefill(lm.new_cache(), embeds, layout.positions, taps=(0, 1, lm.n_layers), on_tap=lambda l, h: seen.setdefault(l, h.clone()))
    with torch.inference_mode():
        ref = lm.model(**lm.generate_inputs(layout, frames, fps), output_hidden_states=True).hidden_states
    assert sorted(seen) == [0, 1, lm.n_layers]
    torch.testing.assert_close(seen[0], ref[0][0])
    torch.testing.assert_close(seen[1], ref[1][0], rtol=1e-4, atol=1e-4)


def test_prompt_without_the_video_placeholder_is_a_clear_error(lm):
    with pytest.raises(PromptError, match="video placeholders"):
        lm.layout("<|im_start|> user describe the video . <|im_end|> <|im_start|> assistant", 4, (84, 84), 2.0)


def test_unknown_path_and_unsupported_architecture_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="no usable checkpoint"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelError, match="reelflow adapts qwen2_5_vl, llava_onevision"):
        load_model(str(tmp_path / "gpt"))
    with pytest.raises(ModelError, match="dtype"):
        load_model(str(tmp_path / "gpt"), dtype="int3")


def test_a_misspelt_local_path_is_refused_at_once_with_the_close_checkpoints(tmp_path, monkeypatch):
    """`ckpts/qwen-target` where ckpts/ is a directory here is a local path with a typo, not a hub
    id: refused before the hub is asked (its retries take half a minute offline), naming the
    checkpoints of a close name up to three levels under ckpts/."""
    import transformers

    for name in ("qwen-target", "llava-draft"):
        (tmp_path / "ckpts" / "weights" / name).mkdir(parents=True)
        (tmp_path / "ckpts" / "weights" / name / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)

    def hub(*args, **kwargs):
        raise AssertionError("the hub was asked")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", hub)
    with pytest.raises(ModelError, match=r"ckpts/ is a directory here.*close name: ckpts/weights/qwen-target$"):
        load_model("ckpts/qwen-target")
    with pytest.raises(ModelError, match=r"no such directory; ckpts/weights/ is a directory here, so this is read "
                                         r"as a local path, not a hub id\)$"):
        load_model("ckpts/weights/gpt-j")


def test_draft_and_target_with_different_tokenizers_are_refused(tmp_path, lm):
    other = load_model(str(random_checkpoint(tmp_path / "o", ARCHS[lm.arch])))
    assert shared_vocabulary(lm, other) == len(lm.tokenizer)
    vocab = json.loads((tmp_path / "o" / "tokenizer.json").read_text())
    table = vocab["model"]["vocab"]
    table["circle"], table["square"] = table["square"], table["circle"]
    (tmp_path / "o" / "tokenizer.json").write_text(json.dumps(vocab))
    swapped = load_model(str(tmp_path / "o"))
    with pytest.raises(ModelError, match="different tokenizers"):
        shared_vocabulary(lm, swapped)


def test_padded_lm_head_is_sliced_to_the_shared_vocabulary(tmp_path, lm):
    padded = load_model(str(random_checkpoint(tmp_path / "p", ARCHS[lm.arch], vocab_size=72)))
    assert padded.vocab_size == 72 and shared_vocabulary(lm, padded) == len(lm.tokenizer) == 64


def test_attention_scores_of_a_span_match_the_models_own_attentions(lm, video):
    frames, fps = video
    layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
    embeds = lm.embed(layout.ids, lm.encode(frames), layout.video_start)
    end = layout.video_start + layout.n_video
    cache = lm.new_cache()
    lm.prefill(cache, embeds[:end], layout.positions[:, :end])
    scores = lm.attention_scores(cache, embeds[end:], layout.positions[:, end:], layers=(1, lm.n_layers))
    assert lm.cached_length(cache) == layout.length and lm.text_config._attn_implementation == "sdpa"
    impl = lm.text_config._attn_implementation
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            ref = lm.model(**lm.generate_inputs(layout, frames, fps), output_attentions=True).attentions
    finally:
        lm.model.set_attn_implementation(impl)
    for layer in (1, lm.n_layers):
        want = ref[layer - 1][0].mean(0)[end:]                   # [n_span, L]
        torch.testing.assert_close(scores[layer], want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(scores[layer].sum(-1), torch.ones(layout.length - end))


@pytest.mark.parametrize("pack", [True, False])
def test_a_loaded_model_saves_as_transformers_saves_it_and_loads_back_the_same(tmp_path, pack):
    """save_pretrained works on a loaded model, its weights packed or not (safetensors refuses
    non-contiguous tensors, and views of one storage read as tied weights), and the saved
    checkpoint loads back equal."""
    lm = load_model("zoo/weights/qwen-draft", compile="off", pack=pack)
    lm.model.save_pretrained(tmp_path)
    again = load_model(str(tmp_path))
    for (name, mine), (_, theirs) in zip(lm.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(mine, theirs), name
