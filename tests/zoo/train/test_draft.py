"""A draft distilled from its target on the user's own videos (zoo.train.draft): the loss's math,
the target's answers with its top-k, a short run from a folder (saved where `model.draft.path`
loads it, with its card and agreement; the example cache reused), Ctrl-C then resume to the
uninterrupted run's weights, the result in the vanilla_sd graph token-identical to `ar`, and bad
settings refused with a clear message."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from graph.spec import ConfigError
from tests.zoo.train.conftest import cache_stamps
from zoo.train.draft import distill_terms, target_answer, train

TARGET = "zoo/weights/qwen-target"
ROOT = Path(__file__).resolve().parents[3]


def short_run(folder, out, cache, **keys) -> dict:
    settings = dict(target=TARGET, init=None, shape="qwen-draft", max_new_tokens=8, topk=4, steps=6, batch_examples=2,
                    loader_workers=0, eval_every=3, log_every=1, warmup=2, clip_seconds=(2.0, 4.0), clips_per_video=2,
                    heldout=0.25, eval_clips=1, out=str(out), cache=str(cache), checkpoint_every=0)
    return train(progress=False, data={"folder": str(folder), "prompt": "describe the video ."}, **settings | keys)


# ------------------------------------------------------------------------------ the loss

def test_the_kl_is_zero_when_the_draft_has_the_targets_top_k_and_the_ce_is_the_answers():
    torch.manual_seed(0)
    target = torch.randn(5, 11).log_softmax(-1)                     # [N, V]
    top = target.topk(3)
    answer = top.indices[:, 0]
    # a draft whose distribution is the target's top-3, renormalised, and nothing else
    draft = torch.full((5, 11), -1e9).scatter(1, top.indices, top.values)
    ce, kl = distill_terms(draft, answer, top.indices, top.values)
    assert kl.abs() < 1e-6
    assert torch.allclose(ce, F.cross_entropy(draft, answer))
    # by hand for one position: p the renormalised top-k, q the draft's softmax
    other = torch.randn(1, 11)
    _, kl = distill_terms(other, answer[:1], top.indices[:1], top.values[:1])
    p = top.values[0].softmax(-1)
    q = other[0].log_softmax(-1)[top.indices[0]]
    assert torch.allclose(kl, (p * (p.log() - q)).sum(), atol=1e-6)


def test_the_targets_answer_is_its_greedy_answer_and_its_top_k_comes_with_it():
    from models.decoding import greedy_answer
    from models.load import load_model
    from zoo.train.data import example

    lm = load_model(TARGET)
    ex = example(7, 6.0, 2.0)
    made = target_answer(lm, ex.frames, 2.0, ex.prompt, max_new_tokens=12, topk=5)
    assert made["answer"].tolist() == greedy_answer(lm, ex.frames, 2.0, ex.prompt, 12)
    assert made["top_ids"].shape == made["top_logp"].shape == (len(made["answer"]), 5)
    assert torch.equal(made["top_ids"][:, 0], made["answer"])              # greedy: the most likely token
    assert (made["top_logp"].diff(dim=-1) <= 0).all() and (made["top_logp"].logsumexp(-1) <= 1e-5).all()


# ------------------------------------------------------------------------------ training

def test_a_draft_distilled_on_a_folder_saves_loadable_with_its_card_and_agreement(folder, tmp_path):
    from models.load import load_model

    result = short_run(folder, tmp_path / "draft", tmp_path / "cache")
    out = tmp_path / "draft"
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "training.json", "README.md"} <= \
        {p.name for p in out.iterdir()}
    assert result["trained_on"]["videos"] == 4 and result["trained_on"]["clips"] == 6
    assert 0 <= result["top1_heldout"] <= 1 and result["accepted_length_heldout"] >= 1.0
    assert any("accepted_length_heldout" in row for row in result["history"])       # checked during training
    card = (out / "README.md").read_text()
    assert str(folder) in card and "model.draft.path=" in card and "accepted_length_heldout" in card
    draft = load_model(str(out))
    assert draft.arch == "qwen2_5_vl" and draft.fps == 2.0
    # the cache is reused: a second run builds nothing
    stamps = cache_stamps(result)
    short_run(folder, tmp_path / "draft2", tmp_path / "cache", steps=2, eval_every=0)
    assert cache_stamps(result) == stamps


def test_ctrl_c_then_resume_gives_the_uninterrupted_runs_weights(folder, tmp_path, ctrl_c):
    from zoo.train import draft

    whole = short_run(folder, tmp_path / "whole", tmp_path / "cache", steps=8, eval_every=0)
    ctrl_c(draft.DraftRecipe, 6)
    with pytest.raises(KeyboardInterrupt):
        short_run(folder, tmp_path / "split", tmp_path / "cache", steps=8, eval_every=0)
    assert (tmp_path / "split" / "training-state.pt").exists()
    ctrl_c.undo()
    resumed = short_run(folder, tmp_path / "split", tmp_path / "cache", steps=8, eval_every=0, resume=True)
    assert resumed["resumed_at"] == 5 and resumed["steps"] == 8 and whole["resumed_at"] is None
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "split" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_distilled_draft_runs_in_vanilla_sd_and_is_lossless(folder, tmp_path):
    short_run(folder, tmp_path / "draft", tmp_path / "cache", steps=2, eval_every=0)
    video = sorted(folder.iterdir())[0]
    answers = {}
    for experiment in ("ar", "vanilla_sd"):
        run_dir = tmp_path / experiment
        subprocess.run([sys.executable, "-m", "run", f"+experiment={experiment}", f"data.path={video}",
                        f"model.draft.path={tmp_path / 'draft'}", "graph.max_new_tokens=24",
                        f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        answers[experiment] = json.loads((run_dir / "metrics.json").read_text())["output_ids"]
    assert answers["vanilla_sd"] == answers["ar"] and len(answers["ar"]) > 0


def test_bad_settings_are_refused_with_a_clear_message(folder, tmp_path):
    with pytest.raises(ConfigError, match="init: give the draft to start from"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", shape=None)
    with pytest.raises(ConfigError, match="shape='qwen-huge': one of"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", shape="qwen-huge")
    with pytest.raises(ConfigError, match="different tokenizers|family"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", init="zoo/weights/llava-draft")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no video files"):
        short_run(empty, tmp_path / "d", tmp_path / "cache")


def test_random_shapes_train_from_the_toy_world_for_timing(tmp_path):
    """`random:` paths (real shapes, random weights; here shrunk) for the target and the draft, whose
    lm_heads differ in size as Qwen2.5-VL-7B's and 3B's do; no data source: toy-world videos."""
    tiny = ("hidden_size=64,intermediate_size=128,num_attention_heads=2,num_key_value_heads=1,vision.depth=1,"
            "vision.hidden_size=32,vision.intermediate_size=64,vision.num_heads=2")
    result = train(progress=False, target=f"random:qwen2.5-vl-7b,num_hidden_layers=2,{tiny}",
                   init=f"random:qwen2.5-vl-3b,num_hidden_layers=1,{tiny}", examples=4, seconds=(2.0, 4.0),
                   max_new_tokens=6, steps=3, batch_examples=2, loader_workers=0, eval_every=0, log_every=1, warmup=1,
                   out=str(tmp_path / "draft"), checkpoint_every=0)
    assert result["trained_on"]["data"] == "the toy world" and result["steps"] == 3
    assert (tmp_path / "draft" / "model.safetensors").exists() and result["accepted_length_heldout"] >= 1.0


def test_clips_at_a_multiple_of_the_frame_rate_are_answered_at_that_rate(folder, tmp_path):
    result = short_run(folder, tmp_path / "draft", tmp_path / "cache", steps=1, eval_every=0, rate_scale=(2, 2),
                       rate_share=1.0)
    clips = json.loads((Path(result["trained_on"]["example_cache"]) / "clips.json").read_text())
    example = torch.load(Path(result["trained_on"]["example_cache"]) / "clip-00000.pt")
    assert {c["rate"] for c in clips} == {2} and example["fps"] == 4.0
    assert example["frames"].shape[0] == round(clips[0]["seconds"] * 4.0)


def test_a_llava_draft_trains_on_videos_of_different_lengths_in_one_step(tmp_path):
    """LLaVA-OneVision's forward stacks its videos: a step's examples go in one batch per frame count."""
    result = train(progress=False, target="zoo/weights/llava-target", init=None, shape="llava-draft", examples=6,
                   seconds=(2.0, 5.0), max_new_tokens=6, steps=2, batch_examples=3, loader_workers=0, eval_every=0,
                   log_every=1, warmup=1, out=str(tmp_path / "draft"), checkpoint_every=0)
    assert result["steps"] == 2 and result["accepted_length_heldout"] >= 1.0
    assert (tmp_path / "draft" / "model.safetensors").exists()


# ------------------------------------------------------------------------------ visual-token dropout

def dropping_recipe(target: str, init: str, uv_layers: tuple[int, ...]):
    """A built recipe with visual-token dropout on, from two toy-world examples."""
    from zoo.train.config import parse_flat
    from zoo.train.draft import DraftRecipe, DraftTrainConfig
    from zoo.train.loop import LoopConfig
    from zoo.train.user_data import UserDataConfig

    _, videos, config = parse_flat(dict(target=target, init=init, examples=2, seconds=(2.0, 3.0), max_new_tokens=6,
                                        visual_drop=1.0, uv_layers=uv_layers), LoopConfig, UserDataConfig,
                                   DraftTrainConfig)
    recipe = DraftRecipe(config, videos, None, False)
    recipe.build(torch.device("cpu"))
    return recipe


@pytest.mark.parametrize("family, uv_layers", [("qwen", (1, 2, 3)), ("llava", (0, 1, 2))])
def test_a_dropped_example_shows_the_draft_what_parallelvlms_draft_sees(family, uv_layers):
    """With UV-Prune's share kept, the training forward's logits along the answer are those of the
    draft prefilled with only the tokens the UVPrune stage keeps, at their own positions (what
    SelectedPrefill runs), then the answer; the scores cached with the example are the stage's."""
    from models.load import adapted
    from models.pruning import keep_top
    from stages.prune import UVPrune
    from stages.types import Taps

    recipe = dropping_recipe(f"zoo/weights/{family}-target", f"zoo/weights/{family}-draft", uv_layers)
    lm, item = recipe.lm, recipe.data[0]
    frames, fps, prompt = item["frames"], item["fps"], item["prompt"]
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
    hidden = {}
    lm.prefill(lm.new_cache(), lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions,
               taps=uv_layers, on_tap=lambda layer, h: hidden.__setitem__(layer, h), logits="none")
    chosen = UVPrune(keep=0.1, layers=list(uv_layers))(None, Taps(hidden, layout))["selection"].keep
    assert item["uv_scores"].shape == (layout.n_video,)
    assert torch.equal(keep_top(item["uv_scores"], 0.1), chosen)

    recipe.net.eval()
    with torch.no_grad():
        masked, answer, _, _ = recipe._forward(recipe.inputs([item], [(0.1, True)]))
        whole, _, _, _ = recipe._forward(recipe.inputs([item]))
        with adapted(recipe.net, lm.tokenizer, {"image_mean": list(lm.mean), "image_std": list(lm.std),
                                                "fps": fps}) as draft:
            d_layout = draft.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
            rows = torch.cat([torch.arange(d_layout.video_start), d_layout.video_start + chosen,
                              torch.arange(d_layout.video_start + d_layout.n_video, d_layout.length)])
            embeds = draft.embed(d_layout.ids, draft.encode(frames), d_layout.video_start)
            cache = draft.new_cache()
            first = draft.prefill(cache, embeds[rows], d_layout.positions[:, rows])
            rest = draft.score(cache, answer[:-1], d_layout.length, d_layout)
    selected = torch.cat([first[None], rest])[:, :masked.shape[-1]]
    # float32 both ways; the two paths order their sums differently (one masked attention over the
    # whole prompt, one over the kept rows), a few ulps of logits ~10: 1e-4 as the toy's dropout test
    assert torch.allclose(masked, selected, atol=1e-4)
    assert not torch.allclose(whole, selected, atol=1e-3)           # the dropout did something


def test_a_random_subset_keeps_its_share_of_the_video_at_the_whole_prompts_positions():
    from zoo.train.data import shifted_positions

    recipe = dropping_recipe(TARGET, "zoo/weights/qwen-draft", (1, 2, 3))
    item = recipe.data[0]
    (plain,), (dropped,) = recipe.inputs([item]), recipe.inputs([item], [(0.3, False)], seed=1)
    is_video = plain["input_ids"] == recipe.net.config.video_token_id
    m = int(is_video.sum())
    seen = dropped["attention_mask"].bool() & is_video
    assert int(seen.sum()) == -(-3 * m // 10)                       # ⌈0.3 m⌉
    assert torch.equal(dropped["attention_mask"].bool() | is_video, plain["attention_mask"].bool())
    assert torch.equal(dropped["position_ids"], shifted_positions(recipe.net, plain, torch.zeros_like(
        plain["input_ids"])))
    (again,) = recipe.inputs([item], [(0.3, False)], seed=1)
    (other,) = recipe.inputs([item], [(0.3, False)], seed=2)
    assert torch.equal(again["attention_mask"], dropped["attention_mask"])
    assert not torch.equal(other["attention_mask"], dropped["attention_mask"])
    drops = recipe.draw_drops(400, random.Random(0))
    shares = torch.tensor([s for s, _ in drops])
    assert bool(((shares >= 0.05) & (shares <= 0.5)).all())        # visual_drop 1: every example drops
    assert 0.7 < sum(uv for _, uv in drops) / 400 < 0.9             # visual_uv_share 0.8


def test_a_draft_trained_with_dropout_reports_its_pruned_agreement(folder, tmp_path):
    result = short_run(folder, tmp_path / "draft", tmp_path / "cache", steps=2, eval_every=0, visual_drop=0.5,
                       init="zoo/weights/qwen-draft", shape=None, uv_layers=(1, 2, 3))
    assert 0 <= result["top1_heldout_pruned"] <= 1 and result["top1_heldout_pruned"] != result["top1_heldout"]
    card = (tmp_path / "draft" / "README.md").read_text()
    assert "| top1_heldout_pruned |" in card and "UV-Prune keeps on the target's layers [1, 2, 3]" in card
    example = torch.load(Path(result["trained_on"]["example_cache"]) / "clip-00000.pt")
    assert example["uv_scores"].dtype == torch.float32 and example["uv_scores"].numel() > 0
    with pytest.raises(ConfigError, match=r"visual_keep=\[0.5, 0.2\]"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", visual_drop=0.5, visual_keep=(0.5, 0.2))
    with pytest.raises(ConfigError, match=r"uv_layers=\[2\]"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", visual_drop=0.5, uv_layers=(2,))
    with pytest.raises(ConfigError, match=r"uv_layers=\[0, 9\]: the target has layers 0..6"):
        short_run(folder, tmp_path / "d", tmp_path / "cache", visual_drop=0.5, uv_layers=(0, 9))
