"""The Sparrow head's recipe (zoo.train.sparrow): the target's states it learns from line up (the
feature before each text position, the video's mid-layer states), a short run saves a head that
loads beside its target and records what it was, and bad keys are refused before anything is built."""

from __future__ import annotations

import json

import pytest
import torch

from graph.spec import ConfigError
from models.load import load_model
from models.sparrow import SparrowHead
from zoo.train.data import example
from zoo.train.recipes import check, recipe_of
from zoo.train.sparrow import head_inputs, target_states, train

TARGET = "zoo/weights/qwen-target"


def test_the_states_line_up_with_the_sequence():
    lm = load_model(TARGET)
    ex = example(5, 6, 2.0)
    item = target_states(lm, ex.frames, 2.0, ex.prompt, 8, 3)
    n = item["ids"].shape[0]
    assert item["final"].shape == (n, lm.text_config.hidden_size)
    assert item["video"].shape[0] == int((~item["is_text"]).sum()) > 0
    inputs = head_inputs(item)
    text = item["is_text"].nonzero().squeeze(1)
    text = text[text > 0]
    assert torch.equal(inputs["ids"], item["ids"][text])
    assert torch.equal(inputs["prev"], item["final"][text - 1]) and torch.equal(inputs["want"], item["final"][text])
    # the first text token after the video follows a video position
    assert not bool(inputs["prev_is_text"].all()) and bool(inputs["prev_is_text"][-1])


def test_a_short_run_saves_a_head_that_loads(tmp_path):
    result = train(progress=False, target=TARGET, examples=3, seconds=(2.0, 4.0), max_new_tokens=6, steps=3,
                   batch_examples=2, ivsb_drop=0.5, loader_workers=0, eval_every=0, log_every=1, out=str(tmp_path / "h"))
    assert result["steps"] == 3 and result["recipe"] == "sparrow" and 0 <= result["top1_4x"] <= 1
    saved = json.loads((tmp_path / "h" / "training.json").read_text())
    assert saved["ivsb_drop"] == 0.5 and saved["tap_layer"] == 3
    head = SparrowHead.load(tmp_path / "h", load_model(TARGET))
    assert head.config.tap_layer == 3 and head.config.vata


def test_bad_keys_are_refused_together():
    with pytest.raises(ConfigError) as e:
        check(*recipe_of({"recipe": "sparrow", "examples": 1, "ivsb_drop": 2.0, "exampels": 3}))
    text = str(e.value)
    assert "examples=1" in text and "ivsb_drop=2.0" in text and "exampels" in text
    with pytest.raises(ConfigError, match="train.recipe"):
        recipe_of({"recipe": "nope"})


def test_a_head_for_a_target_outside_the_zoo_needs_its_own_place(tmp_path):
    # without train.out the head would land in zoo/weights, over the toy target's head: refused first
    with pytest.raises(ConfigError, match="train.out: required for a target outside the toy zoo"):
        train(progress=False, target=str(tmp_path / "my-target"), steps=1)
