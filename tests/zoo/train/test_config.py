"""zoo.train.config: the flat `train:` keys become the loop's and the toy recipe's dataclasses, and
everything wrong is one ConfigError, naming each problem, before anything is built."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from graph.spec import ConfigError
from zoo.train.config import LoopConfig, ToyConfig, check_keys, flat, parse
from zoo.train.toy import train

ROOT = Path(__file__).resolve().parents[3]


def test_the_experiments_keys_parse_into_the_loop_and_the_recipe_and_back():
    keys = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "experiment" / "train_toy.yaml")["train"])
    loop, toy = parse(keys)
    assert (loop.steps, loop.lr, loop.precision) == (keys["steps"], keys["lr"], keys["precision"])
    assert toy.model == keys["model"] and toy.data.seconds == tuple(keys["seconds"])
    assert toy.losses.ground_weight == keys["ground_weight"] and toy.data.warm_seconds == tuple(keys["warm_seconds"])
    back = flat(loop) | flat(toy)
    assert set(back) == set(keys)
    assert all(back[k] == (tuple(v) if isinstance(v, list) else v) for k, v in keys.items())


def test_numbers_keep_the_type_they_were_written_with():
    """An int where a float is asked stays an int (what the recipe then computes with, and records)."""
    loop, toy = parse({"model": "qwen-draft", "lr": 1, "seconds": [4, 6], "dense_gap": [1.5, 3]})
    assert type(loop.lr) is int and toy.data.seconds == (4, 6) and type(toy.data.dense_gap[1]) is int


def test_a_misspelt_key_names_the_closest_valid_ones():
    with pytest.raises(ConfigError) as e:
        parse({"model": "qwen-draft", "stepz": 5})
    assert e.value.problems == ["train.stepz: no such key; did you mean train.steps?"]
    with pytest.raises(ConfigError, match="train.frobnicate: no such key; the keys are steps, lr, .*distill_weight"):
        check_keys(["frobnicate"], LoopConfig, ToyConfig)
    check_keys(["steps", "fps_share", "ground_layer"], LoopConfig, ToyConfig)       # leaves of every group


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        parse({"model": "qwen-drat", "steps": 0, "precision": "fp16", "seconds": [4], "codec": "yes",
               "dense_share": 2, "lr": "fast"})
    problems = "\n".join(e.value.problems)
    for expected in ("train.seconds=[4]: a list of 2", "train.codec='yes': true or false", "train.lr='fast': a number",
                     "train.steps=0: >= 1", "train.precision='fp16': bf16 (autocast, fp32 master weights) or fp32",
                     "train.dense_share=2: the fraction", "train.model='qwen-drat': not a zoo model; the zoo has qwen-draft"):
        assert expected in problems
    assert len(e.value.problems) == 7


def test_the_model_is_required_and_checkpoints_must_fit_it():
    with pytest.raises(ConfigError, match="train.model: required"):
        parse({"steps": 3})
    with pytest.raises(ConfigError, match="init=/nonexistent: no checkpoint there"):
        parse({"model": "qwen-draft", "init": "/nonexistent"})
    with pytest.raises(ConfigError, match="is not a qwen-target checkpoint .*2 layers of 128"):
        parse({"model": "qwen-target", "init": "zoo/weights/qwen-draft"})
    with pytest.raises(ConfigError, match="teacher=zoo/weights/llava-target is a llava_onevision model"):
        parse({"model": "qwen-draft", "teacher": "zoo/weights/llava-target"})
    with pytest.raises(ConfigError, match="ground_layer=2: qwen-draft has layers 0..1"):
        parse({"model": "qwen-draft", "ground_weight": 1.0, "ground_layer": 2})
    parse({"model": "qwen-draft", "ground_weight": 0.0, "ground_layer": 2})          # off: its layer is not used


def test_an_unknown_precision_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="bf16 .* or fp32"):
        train(model="qwen-draft", steps=1, precision="fp16", progress=False)


def test_the_distillation_and_dropout_keys_are_checked_like_the_others():
    loop, toy = parse({"model": "qwen-draft", "teacher": "zoo/weights/qwen-target", "label_weight": 0,
                       "visual_drop": 0.5, "visual_keep": [0.1, 0.9], "visual_uv_share": 0.5, "uv_layers": [0, 2]})
    assert toy.losses.label_weight == 0 and toy.drop.visual_keep == (0.1, 0.9) and toy.drop.uv_layers == (0, 2)
    with pytest.raises(ConfigError) as e:
        parse({"model": "qwen-draft", "visual_dorp": 0.5})
    assert e.value.problems[0].startswith("train.visual_dorp: no such key; did you mean train.visual_drop")
    with pytest.raises(ConfigError) as e:
        parse({"model": "qwen-draft", "teacher": "zoo/weights/qwen-target", "visual_drop": 1.5,
               "visual_keep": [0.0, 0.5], "visual_uv_share": -0.1, "uv_layers": [2, 1], "label_weight": -1})
    problems = "\n".join(e.value.problems)
    for expected in ("visual_drop=1.5: a share of the examples, in [0, 1]",
                     "visual_uv_share=-0.1: a share", "visual_keep=[0.0, 0.5]: [low, high] fractions",
                     "uv_layers=[2, 1]: [l_0, L]", "label_weight=-1: a weight, >= 0"):
        assert expected in problems
    with pytest.raises(ConfigError, match="visual_uv_share > 0 chooses tokens from a teacher's hidden states"):
        parse({"model": "qwen-draft", "visual_drop": 0.5, "visual_uv_share": 0.5})
    parse({"model": "qwen-draft", "visual_drop": 0.5})                    # random subsets need no teacher
    with pytest.raises(ConfigError, match="label_weight=0 needs a teacher"):
        parse({"model": "qwen-draft", "label_weight": 0})
    with pytest.raises(ConfigError, match=r"uv_layers=\[0, 7\]: the teacher has layers 0..6"):
        parse({"model": "qwen-draft", "teacher": "zoo/weights/qwen-target", "visual_drop": 0.5,
               "visual_uv_share": 1.0, "uv_layers": [0, 7]})
