"""A draft head trained from the user's own videos (zoo.train.user_data, zoo.train.sparrow with a
data source): clips and their held-out split, the example cache (built once, resumable, a bad clip
costs only itself), the prompts, training that stops on Ctrl-C and resumes to the uninterrupted
run's weights, the card, and bad input refused with a clear message."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from graph.spec import ConfigError
from stages.source import load_requests
from stages.types import Request
from tests.zoo.train.conftest import cache_stamps
from zoo.train.sparrow import train
from zoo.train.user_data import ExampleCache, load_prompts, plan_clips

TARGET = "zoo/weights/qwen-target"
ROOT = Path(__file__).resolve().parents[3]


def short_run(folder, out, cache, **keys) -> dict:
    settings = dict(target=TARGET, max_new_tokens=8, steps=6, batch_examples=2, loader_workers=0, eval_every=3,
                    log_every=1, warmup=2, clip_seconds=(2.0, 4.0), clips_per_video=2, heldout=0.25, eval_clips=1,
                    out=str(out), cache=str(cache), checkpoint_every=0)
    return train(progress=False, data={"folder": str(folder), "prompt": "describe the video ."}, **settings | keys)


# ------------------------------------------------------------------------------ clips and prompts

def test_clips_are_drawn_per_video_and_whole_videos_are_held_out(folder):
    requests = load_requests({"folder": str(folder), "prompt": "describe the video ."})
    clips, skipped = plan_clips(requests, clip_seconds=(2, 5), clips_per_video=3, heldout=0.25, seed=0,
                                prompts=["describe the video ."], default_prompt="describe the video .")
    again, _ = plan_clips(requests, clip_seconds=(2, 5), clips_per_video=3, heldout=0.25, seed=0,
                          prompts=["describe the video ."], default_prompt="describe the video .")
    assert clips == again and not skipped and len(clips) == 12
    assert all(2 <= c.seconds <= 5 and 0 <= c.start <= 12 - c.seconds for c in clips)
    held = {c.video for c in clips if c.heldout}
    assert len(held) == 1 and all(c.heldout == (c.video in held) for c in clips)   # by video, never by clip
    other, _ = plan_clips(requests, clip_seconds=(2, 5), clips_per_video=3, heldout=0.25, seed=1,
                          prompts=["describe the video ."], default_prompt="describe the video .")
    assert other != clips


def test_with_one_video_its_last_clips_are_held_out_and_the_log_says_the_check_reads_high(folder, caplog):
    one = load_requests({"folder": str(folder), "prompt": "p"})[:1]
    with caplog.at_level(logging.WARNING, logger="reelflow.train"):
        clips, _ = plan_clips(one, clip_seconds=(2, 5), clips_per_video=4, heldout=0.25, seed=0, prompts=["p"])
    assert [c.heldout for c in clips] == [False, False, False, True]
    assert "the agreement check reads high" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="reelflow.train"):
        plan_clips(load_requests({"folder": str(folder), "prompt": "p"}), clip_seconds=(2, 5), clips_per_video=1,
                   heldout=0.25, seed=0, prompts=["p"])
    assert "reads high" not in caplog.text


def test_a_manifest_rows_prompt_wins_and_others_take_the_prompt_set_in_turn(folder):
    videos = sorted(folder.iterdir())
    requests = [Request(id="a", video=str(videos[0]), prompt="what happens ?"),
                Request(id="b", video=str(videos[1]), prompt="describe the video ."),
                Request(id="c", video=str(videos[2]), prompt="describe the video .")]
    clips, _ = plan_clips(requests, clip_seconds=(2, 2), clips_per_video=2, heldout=0.0, seed=0,
                          prompts=["p1", "p2", "p3"], default_prompt="describe the video .")
    assert [c.prompt for c in clips] == ["what happens ?", "what happens ?", "p1", "p2", "p3", "p1"]


def test_an_unreadable_video_is_skipped_with_its_reason(folder, tmp_path):
    bad = tmp_path / "broken.mp4"
    bad.write_bytes(b"not a video at all")
    requests = load_requests({"folder": str(folder)}) + [Request(id="x", video=str(bad))]
    clips, skipped = plan_clips(requests, clip_seconds=(2, 3), clips_per_video=1, heldout=0.0, seed=0, prompts=["p"])
    assert list(skipped) == [str(bad)] and "broken.mp4" in skipped[str(bad)] and len(clips) == 4
    with pytest.raises(ValueError, match="none of the videos can be read"):
        plan_clips([Request(id="x", video=str(bad))], clip_seconds=(2, 3), clips_per_video=1, heldout=0.0,
                   seed=0, prompts=["p"])


def test_prompts_from_a_list_a_text_file_or_json_and_a_bad_file_is_named(tmp_path):
    assert load_prompts(["a", " ", "b"]) == ["a", "b"]
    (tmp_path / "p.txt").write_text("# my prompts\nwhat happens ?\n\ndescribe the video .\n")
    assert load_prompts(str(tmp_path / "p.txt")) == ["what happens ?", "describe the video ."]
    (tmp_path / "p.json").write_text('["one", "two"]')
    assert load_prompts(str(tmp_path / "p.json")) == ["one", "two"]
    (tmp_path / "bad.json").write_text('["one", "two"')
    with pytest.raises(ValueError, match=r"bad.json: not valid JSON"):
        load_prompts(str(tmp_path / "bad.json"))
    (tmp_path / "dict.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="a list of strings"):
        load_prompts(str(tmp_path / "dict.json"))
    with pytest.raises(ValueError, match="no such file"):
        load_prompts(str(tmp_path / "missing.txt"))


def test_some_clips_can_be_sampled_at_a_multiple_of_the_frame_rate_without_moving_the_others(folder):
    requests = load_requests({"folder": str(folder)})
    plain, _ = plan_clips(requests, clip_seconds=(2, 5), clips_per_video=8, heldout=0.0, seed=0, prompts=["p"])
    scaled, _ = plan_clips(requests, clip_seconds=(2, 5), clips_per_video=8, heldout=0.0, seed=0, prompts=["p"],
                           rate_scale=(2, 4), rate_share=0.5)
    assert [(c.video, c.start, c.seconds) for c in plain] == [(c.video, c.start, c.seconds) for c in scaled]
    assert {c.rate for c in plain} == {1} and {c.rate for c in scaled} <= {1, 2, 3, 4}
    assert 8 <= sum(c.rate > 1 for c in scaled) <= 24          # about half of the 32, drawn


# ------------------------------------------------------------------------------ the example cache

def test_the_cache_builds_once_resumes_after_an_interruption_and_a_bad_clip_costs_only_itself(folder, tmp_path):
    requests = load_requests({"folder": str(folder)})
    clips, _ = plan_clips(requests, clip_seconds=(2, 2), clips_per_video=2, heldout=0.0, seed=0, prompts=["p"])
    made = []

    def make(clip):
        made.append(clip)
        if clip == clips[5]:
            raise ValueError("this clip cannot be decoded")
        if len(made) == 4 and not (tmp_path / "interrupted").exists():
            (tmp_path / "interrupted").touch()
            raise KeyboardInterrupt             # Ctrl-C in the middle of the build
        return {"x": torch.tensor([clips.index(clip)])}

    cache = ExampleCache(tmp_path / "cache", {"what": "test", "clips": len(clips)})
    with pytest.raises(KeyboardInterrupt):
        cache.build(clips, make, progress=False)
    assert sorted(p.name for p in cache.dir.glob("clip-*.pt")) == ["clip-00000.pt", "clip-00001.pt", "clip-00002.pt"]
    assert not list(cache.dir.glob("*.partial"))
    made.clear()
    paths = cache.build(clips, make, progress=False)
    assert made == clips[3:]                                  # only what was missing
    assert paths[5] is None and all(p is not None for i, p in enumerate(paths) if i != 5)
    assert "cannot be decoded" in cache.skipped()["clip-00005"]
    assert torch.load(paths[7])["x"].item() == 7
    made.clear()
    assert ExampleCache(tmp_path / "cache", {"what": "test", "clips": len(clips)}).build(clips, make) == paths
    assert made == []                                          # built: never made again, the skip remembered
    assert ExampleCache(tmp_path / "cache", {"what": "other"}).dir != cache.dir


# ------------------------------------------------------------------------------ training

def test_a_head_trained_on_a_folder_saves_with_its_card_and_agreement(folder, tmp_path):
    result = short_run(folder, tmp_path / "head", tmp_path / "cache")
    out = tmp_path / "head"
    assert {"head.safetensors", "sparrow.json", "training.json", "README.md"} <= {p.name for p in out.iterdir()}
    assert not (out / "training-state.pt").exists()
    assert result["trained_on"]["videos"] == 4 and result["trained_on"]["clips"] == 6
    assert 0 <= result["top1_heldout"] <= 1 and result["accepted_length_heldout"] >= 1.0
    assert any("accepted_length_heldout" in row for row in result["history"])       # checked during training
    card = (out / "README.md").read_text()
    assert str(folder) in card and "accepted_length_heldout" in card and "model.sparrow=" in card
    # the cache is reused: a second run builds nothing
    stamps = cache_stamps(result)
    short_run(folder, tmp_path / "head2", tmp_path / "cache", steps=2, eval_every=0)
    assert cache_stamps(result) == stamps


def test_ctrl_c_then_resume_gives_the_uninterrupted_runs_weights(folder, tmp_path, ctrl_c):
    from zoo.train import sparrow

    whole = short_run(folder, tmp_path / "whole", tmp_path / "cache", steps=8, eval_every=0)
    ctrl_c(sparrow.SparrowRecipe, 6)
    with pytest.raises(KeyboardInterrupt):
        short_run(folder, tmp_path / "split", tmp_path / "cache", steps=8, eval_every=0)
    assert (tmp_path / "split" / "training-state.pt").exists() and not (tmp_path / "split" / "head.safetensors").exists()
    ctrl_c.undo()
    with pytest.raises(ConfigError, match="other settings: lr"):
        short_run(folder, tmp_path / "split", tmp_path / "cache", steps=8, eval_every=0, resume=True, lr=1e-2)
    resumed = short_run(folder, tmp_path / "split", tmp_path / "cache", steps=8, eval_every=0, resume=True)
    assert resumed["resumed_at"] == 5 and resumed["steps"] == 8 and whole["resumed_at"] is None
    a, b = load_file(tmp_path / "whole" / "head.safetensors"), load_file(tmp_path / "split" / "head.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in whole["history"]]


def test_resume_without_a_saved_state_says_so(folder, tmp_path):
    with pytest.raises(ConfigError, match="no saved training state"):
        short_run(folder, tmp_path / "none", tmp_path / "cache", resume=True)


def test_bad_input_is_refused_with_a_clear_message(folder, tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no video files"):
        short_run(empty, tmp_path / "h", tmp_path / "cache")
    (tmp_path / "bad.json").write_text("[not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        short_run(folder, tmp_path / "h", tmp_path / "cache", prompts=str(tmp_path / "bad.json"))
    from zoo.train import memory

    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 ** 20)
    with pytest.raises(ConfigError, match=r"needs about \d+ MiB .* has 1 MiB free"):
        short_run(folder, tmp_path / "h", tmp_path / "cache")


def test_an_unreadable_video_among_good_ones_is_skipped_and_on_the_card(folder, tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(folder, mixed)
    (mixed / "zz-truncated.mp4").write_bytes((folder / "clip4000.mp4").read_bytes()[:300])
    result = short_run(mixed, tmp_path / "head", tmp_path / "cache", steps=2, eval_every=0)
    assert list(result["trained_on"]["videos_skipped"]) == [str(mixed / "zz-truncated.mp4")]
    assert "could not be read" in (tmp_path / "head" / "README.md").read_text()


def test_the_trained_head_runs_in_the_sparrow_graph_and_is_lossless(folder, tmp_path):
    short_run(folder, tmp_path / "head", tmp_path / "cache", steps=2, eval_every=0)
    video = sorted(folder.iterdir())[0]
    answers = {}
    for experiment in ("ar", "sparrow"):
        run_dir = tmp_path / experiment
        subprocess.run([sys.executable, "-m", "run", f"+experiment={experiment}", f"data.path={video}",
                        f"model.sparrow={tmp_path / 'head'}", "graph.max_new_tokens=24", f"hydra.run.dir={run_dir}"],
                       cwd=ROOT, check=True, capture_output=True)
        answers[experiment] = json.loads((run_dir / "metrics.json").read_text())["output_ids"]
    assert answers["sparrow"] == answers["ar"] and len(answers["ar"]) > 0
