"""zoo.train.loop: the device and loader workers are resolved before any work, batches move to the
device whole, a time budget stops a run early and still saves it."""

import json

import numpy as np
import pytest
import torch

from graph.spec import ConfigError
from zoo.train.toy import train


def test_a_bad_device_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="device='bogus'"):
        train(model="qwen-draft", steps=1, device="bogus", progress=False)


def test_to_device_moves_every_tensor_of_a_nested_batch_and_keeps_dtypes():
    from collections import namedtuple

    from zoo.train.loop import to_device

    Pair = namedtuple("Pair", "a b")
    batch = {"ids": torch.zeros(2, 3, dtype=torch.int64), "more": [torch.ones(2, dtype=torch.bfloat16),
             (torch.zeros(1, dtype=torch.bool), "text")], "pair": Pair(torch.zeros(1), 3), "n": 7}
    moved = to_device(batch, torch.device("meta"))
    assert moved["ids"].device.type == "meta" and moved["ids"].dtype == torch.int64 and moved["ids"].shape == (2, 3)
    assert moved["more"][0].dtype == torch.bfloat16 and moved["more"][0].device.type == "meta"
    inner = moved["more"][1]
    assert isinstance(inner, tuple) and inner[0].device.type == "meta" and inner[1] == "text"
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device.type == "meta" and moved["pair"].b == 3
    assert moved["n"] == 7 and batch["ids"].device.type == "cpu"          # the input is left as it was
    same = to_device(batch, torch.device("cpu"))
    assert same["ids"] is batch["ids"] and same["more"][0] is batch["more"][0]     # already there: no copy


def test_training_on_the_cpu_in_process_records_its_device(tmp_path):
    threads = torch.get_num_threads()
    result = train(model="qwen-draft", steps=1, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
                   eval_videos=1, log_every=1, device="cpu", loader_workers=0, out=str(tmp_path / "ck"), progress=False)
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert (saved["device"], saved["device_name"], saved["loader_workers"]) == ("cpu", None, 0)
    assert result["device"] == "cpu" and np.isfinite(result["history"][0]["loss"])
    assert torch.get_num_threads() == threads        # batches made in process leave training its threads


def test_a_time_budget_stops_training_early_and_saves_what_is_there(tmp_path):
    """max_minutes: a run that would outlast its budget (a lent GPU's 10-minute command) stops after
    the step that crossed it, saves a loadable checkpoint and records the steps it did."""
    result = train(model="qwen-draft", steps=50, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
                   eval_videos=1, log_every=100, eval_every=0, device="cpu", loader_workers=0, max_minutes=1e-6,
                   out=str(tmp_path / "ck"), progress=False)
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert (saved["steps"], saved["steps_planned"], saved["max_minutes"]) == (1, 50, 1e-6) and result["steps"] == 1
    assert saved["history"][-1]["step"] == 1 and np.isfinite(saved["history"][-1]["loss"])
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    with pytest.raises(ConfigError, match="max_minutes="):
        train(model="qwen-draft", steps=1, max_minutes=0, device="cpu", out=str(tmp_path / "bad"), progress=False)



def test_a_finished_model_is_replaced_only_when_asked_and_refused_before_anything_is_built(tmp_path, monkeypatch):
    short = dict(model="qwen-draft", steps=1, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1,
                 eval_seconds=2, eval_videos=1, log_every=1, eval_every=0, device="cpu", loader_workers=0,
                 out=str(tmp_path / "ck"), progress=False)
    train(**short)
    first = (tmp_path / "ck" / "model.safetensors").read_bytes()
    from zoo.train import toy

    def not_built(*args, **kwargs):
        raise AssertionError("the recipe was built before the refusal")

    monkeypatch.setattr(toy.ToyRecipe, "build", not_built)
    with pytest.raises(ConfigError, match="holds a trained model .*train.overwrite=true"):
        train(**short | {"seed": 1})
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() == first      # nothing written
    monkeypatch.undo()
    train(**short | {"seed": 1, "overwrite": True})
    assert (tmp_path / "ck" / "model.safetensors").read_bytes() != first      # replaced, as asked
