"""zoo.train.toy end to end at a toy scale (a few steps of the draft shape): it writes a checkpoint
that loads like a real one (bf16 safetensors, tokenizer with chat template, preprocessing) and a
training.json; its step computes every loss term on the batch's device."""

import json

import numpy as np
import pytest
import torch

from graph.spec import ConfigError
from models.load import load_model
from zoo.shapes import SHAPES, zoo_config
from zoo.train.data import Batches
from zoo.train.labels import AUX
from zoo.train.toy import train


def test_a_few_steps_write_a_checkpoint_that_loads_like_a_real_one(tmp_path):
    result = train(model="qwen-draft", steps=3, batch_size=2, seconds=(2, 4), warm_seconds=(2, 4), warmup=1,
                   eval_seconds=4, eval_videos=1, log_every=1, out=str(tmp_path / "ck"), progress=False)
    assert len(result["history"]) == 3 and all(np.isfinite(h["loss"]) for h in result["history"])
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert saved["steps"] == 3 and 0.0 <= saved["f1_at_4s"] <= 1.0
    assert saved["device"] == ("cuda" if torch.cuda.is_available() else "cpu") and saved["loader_workers"] >= 1
    lm = load_model(str(tmp_path / "ck"), name="d")
    assert lm.fps == 2.0 and lm.frame_size == (84, 84)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert lm.model.config.model_type == SHAPES["qwen-draft"][0]
    assert isinstance(lm.encode(torch.zeros(2, 3, 84, 84, dtype=torch.uint8)), torch.Tensor)


def test_training_goes_on_from_a_checkpoint_and_keeps_its_recipe(tmp_path):
    first = tmp_path / "a"
    train(model="qwen-draft", steps=2, batch_size=2, seconds=(2, 3), warm_seconds=(2, 3), warmup=1, eval_seconds=3,
          eval_videos=1, out=str(first), progress=False)
    result = train(model="qwen-draft", steps=2, batch_size=2, seconds=(2, 3), warm_seconds=(2, 3), warmup=1, eval_seconds=3,
                   eval_videos=1, out=str(tmp_path / "b"), init=str(first), progress=False)
    saved = json.loads((tmp_path / "b" / "training.json").read_text())
    assert result["init"] == str(first) and saved["init_training"]["steps"] == 2
    with pytest.raises(ConfigError, match="is not a qwen-target checkpoint"):
        train(model="qwen-target", steps=1, init=str(first), progress=False)
    with pytest.raises(ConfigError, match="trained with 1e\\+06"):    # the rotary base belongs to the checkpoint
        train(model="qwen-draft", steps=1, init=str(first), rope_theta=1e4, progress=False)


def test_the_rotary_base_is_a_zoo_option_for_both_families(tmp_path):
    from zoo.shapes import ROPE_THETA
    for name in ("qwen-draft", "llava-draft"):
        assert zoo_config(name).text_config.rope_parameters["rope_theta"] == ROPE_THETA
        assert zoo_config(name, rope_theta=5e5).text_config.rope_parameters["rope_theta"] == 5e5
    train(model="qwen-draft", steps=1, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
          eval_videos=1, rope_theta=5e5, precision="fp32", out=str(tmp_path / "ck"), progress=False)
    loaded = load_model(str(tmp_path / "ck"), name="d").model.config.text_config
    assert loaded.rope_parameters["rope_theta"] == 5e5
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert saved["rope_theta"] == 5e5 and saved["precision"] == "fp32"


def test_grounded_training_runs_eager_and_saves_an_sdpa_checkpoint(tmp_path):
    result = train(model="qwen-draft", steps=2, batch_size=2, seconds=(4, 6), warm_seconds=(4, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, log_every=1, ground_weight=1.0, out=str(tmp_path / "ck"), progress=False)
    assert result["ground_layer"] == 1 and all(np.isfinite(h["ground_loss"]) for h in result["history"])
    assert load_model(str(tmp_path / "ck"), name="d").model.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="layers 0..1"):
        train(model="qwen-draft", steps=1, ground_weight=1.0, ground_layer=2, progress=False)


def test_a_chained_shifted_run_logs_its_chain_loss_and_refuses_bad_settings(tmp_path):
    result = train(model="llava-draft", steps=2, batch_size=2, seconds=(4, 6), warm_seconds=(4, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, log_every=1, ground_weight=1.0, chain_weight=1.0, text_shift=20, clause_gap=4,
                   ground_margin=2.0, out=str(tmp_path / "ck"), progress=False)
    assert result["chain_layer"] == 1 and (result["text_shift"], result["clause_gap"], result["ground_margin"]) == (20, 4, 2.0)
    assert all(np.isfinite(h["chain_loss"]) for h in result["history"])
    assert load_model(str(tmp_path / "ck"), name="d").model.config._attn_implementation == "sdpa"
    with pytest.raises(ConfigError, match="layers 0..1"):
        train(model="qwen-draft", steps=1, chain_weight=1.0, chain_layer=5, progress=False)
    with pytest.raises(ConfigError, match="text_shift"):
        train(model="qwen-draft", steps=1, text_shift=-1, progress=False)
    with pytest.raises(ConfigError, match="ground_margin"):
        train(model="qwen-draft", steps=1, ground_margin=0.5, progress=False)


def test_the_training_step_makes_every_tensor_on_its_batchs_device():
    """What runs on a GPU cannot be run here, but what would break it can be seen: a tensor that
    step_losses (or the losses and positions it calls) makes without `device=` lands on the CPU."""
    import sys
    from pathlib import Path

    from torch.overrides import TorchFunctionMode
    from transformers import AutoModelForImageTextToText

    import zoo.train
    from zoo.train.labels import EVENT_CLASSES
    from zoo.train.toy import step_losses

    package = Path(zoo.train.__file__).parent

    factories = {torch.ones, torch.zeros, torch.full, torch.empty, torch.arange, torch.tensor, torch.as_tensor,
                 torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace}

    class Deviceless(TorchFunctionMode):
        """Records the trainer's calls (any module of zoo.train) of a tensor factory that name no device."""
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            caller = sys._getframe(1)
            if func in factories and "device" not in kwargs and Path(caller.f_code.co_filename).parent == package:
                self.found.append(f"torch.{func.__name__} in {caller.f_code.co_name}, line {caller.f_lineno}")
            return func(*args, **kwargs)

    torch.manual_seed(0)
    for name in ("qwen-draft", "llava-draft"):
        config = zoo_config(name)
        net = AutoModelForImageTextToText.from_config(config)
        net.set_attn_implementation("eager")
        teacher = AutoModelForImageTextToText.from_config(config).eval()
        hidden = config.text_config.hidden_size
        heads = {"cells": torch.nn.Linear(hidden, sum(len(v) for v in AUX.values())),
                 "events": torch.nn.Linear(hidden, len(EVENT_CLASSES))}
        batches = iter(Batches(name, 2, (3, 3), 0, text_shift=5, clause_gap=2, visual_drop=1.0, visual_uv_share=0.5))
        batch = next(b for b in batches if bool(b["keep_by_uv"].any()) and not bool(b["keep_by_uv"].all()))
        with Deviceless() as mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = step_losses(net, heads, batch, teacher, 1, 1, 2.0)
            sum(losses.values()).backward()
        assert set(losses) == {"loss", "aux_loss", "event_loss", "distill_loss", "ground_loss", "chain_loss"}, name
        assert mode.found == [], name



@pytest.mark.parametrize("name", ["qwen-draft", "llava-draft"])
def test_each_loss_term_equals_an_independent_computation(name):
    """The step encodes the video once and feeds the same features to the probes and the language
    model; here each term is recomputed the plain way: the model's own forward (which encodes the
    video itself) with its attentions and hidden states, and the formulas written out."""
    from transformers import AutoModelForImageTextToText

    from zoo.train.data import shifted_positions
    from zoo.train.labels import EVENT_CLASSES
    from zoo.train.toy import step_losses

    torch.manual_seed(0)
    config = zoo_config(name)
    net = AutoModelForImageTextToText.from_config(config)
    net.set_attn_implementation("eager")
    teacher = AutoModelForImageTextToText.from_config(config).eval()
    hidden = config.text_config.hidden_size
    heads = {"cells": torch.nn.Linear(hidden, sum(len(v) for v in AUX.values())),
             "events": torch.nn.Linear(hidden, len(EVENT_CLASSES))}
    batches = iter(Batches(name, 2, (6, 6), 0, stretch=3.0, text_shift=9, clause_gap=3))
    batch = next(b for b in batches if bool(b["position_offset"].any()) and bool(b["ground_mask"].any()))
    ground_layer, chain_layer, margin = 1, 0, 2.0
    with torch.no_grad():
        losses = step_losses(net, heads, batch, teacher, ground_layer, chain_layer, margin)

        extra = ("labels", "cell_labels", "event_labels", "ground_mask", "chain_mask", "position_offset")
        plain = {k: v for k, v in batch.items() if k not in extra}
        positions = shifted_positions(net, plain, batch["position_offset"])
        out = net(**plain, labels=batch["labels"], position_ids=positions, output_attentions=True,
                  output_hidden_states=True)
        labels = batch["labels"].double()
        logp = torch.log_softmax(out.logits.double(), -1)[:, :-1]          # position t predicts t + 1
        scored = batch["labels"][:, 1:] != -100
        nll = -logp.gather(-1, batch["labels"][:, 1:].clamp_min(0)[..., None])[..., 0]
        assert labels.shape == batch["input_ids"].shape
        expected = {"loss": nll[scored].mean()}

        qwen = config.model_type == "qwen2_5_vl"
        if qwen:
            video = torch.cat(net.model.get_video_features(plain["pixel_values_videos"],
                                                           plain["video_grid_thw"]).pooler_output)
        else:
            video = net.model.get_video_features(plain["pixel_values_videos"]).pooler_output[:, :-1].flatten(0, 1)
        probe = heads["cells"](video).double()
        cells, total, at = batch["cell_labels"].reshape(-1, len(AUX)), 0.0, 0
        for i, values in enumerate(AUX.values()):
            part = torch.log_softmax(probe[:, at:at + len(values)], -1)
            total = total - part.gather(-1, cells[:, i:i + 1])[:, 0].mean()
            at += len(values)
        expected["aux_loss"] = total / len(AUX)

        video_id = config.video_token_id if qwen else config.video_token_index
        rows = []
        for b in range(batch["input_ids"].shape[0]):
            where = (batch["input_ids"][b] == video_id).nonzero()[:, 0].tolist()
            rows += [(b, i) for i in (where if qwen else where[:-1])]          # LLaVA: the newline is no cell
        middle = out.hidden_states[len(out.hidden_states) // 2]
        event_logp = torch.log_softmax(heads["events"](torch.stack([middle[b, i] for b, i in rows])).double(), -1)
        y = batch["event_labels"]
        w = torch.where(y == 0, 0.1, 1.0).double()
        expected["event_loss"] = -(w * event_logp.gather(-1, y[:, None])[:, 0]).sum() / w.sum()

        def looking(attention, mask):
            a = attention[:, 0].double() ** (1 / margin)
            a = a / a.sum(-1, keepdim=True)
            has = mask.any(-1)
            return -torch.log((a * mask).sum(-1)[has]).mean()
        expected["ground_loss"] = looking(out.attentions[ground_layer], batch["ground_mask"])
        expected["chain_loss"] = looking(out.attentions[chain_layer], batch["chain_mask"])

        teacher_logp = torch.log_softmax(teacher(**plain).logits.double(), -1)[:, :-1][scored]
        student_logp = logp[scored]
        expected["distill_loss"] = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1).mean()

    assert set(losses) == set(expected)
    for k, v in expected.items():
        assert torch.isfinite(losses[k]) and float(losses[k]) == pytest.approx(float(v), rel=1e-5, abs=1e-6), k


def test_two_runs_with_one_seed_train_the_same_and_the_check_does_not_disturb_training(tmp_path):
    """Same seed, same settings: the same losses at every step and the same saved weights; and a run
    that checks its F1 after every step trains exactly like one that never does (the check lends
    the model to the adapter and gets it back as it was)."""
    import hashlib

    keys = {"model": "qwen-draft", "steps": 2, "batch_size": 2, "seconds": (4, 4), "warm_seconds": (4, 4),
            "warmup": 1, "eval_seconds": 2, "eval_videos": 1, "log_every": 1, "aux_weight": 1.0, "event_weight": 1.0,
            "ground_weight": 1.0, "chain_weight": 1.0, "text_shift": 8, "clause_gap": 2, "ground_margin": 2.0,
            "stretch": 2.0, "teacher": "zoo/weights/qwen-target", "device": "cpu", "progress": False}
    runs = {tag: train(**keys, eval_every=every, out=str(tmp_path / tag))
            for tag, every in (("a", 0), ("b", 0), ("checked", 1))}

    def weights(tag):
        return hashlib.sha256((tmp_path / tag / "model.safetensors").read_bytes()).hexdigest()

    names = {"loss", "aux_loss", "event_loss", "ground_loss", "chain_loss", "distill_loss"}
    for row in runs["a"]["history"]:
        assert names <= set(row) and all(np.isfinite(row[k]) for k in names)

    def losses(tag, drop=("s",)):                  # the rows without their wall-clock seconds
        return [{k: v for k, v in row.items() if k not in drop} for row in runs[tag]["history"]]

    assert losses("a") == losses("b") and weights("a") == weights("b")
    assert "f1_at_10s" in runs["checked"]["history"][0]         # after step 1 (none after the last)
    assert losses("checked", ("s", "f1_at_10s")) == losses("a") and weights("checked") == weights("a")


@pytest.mark.parametrize("name", ["qwen-draft", "llava-draft"])
def test_a_dropout_step_distills_the_whole_video_teacher_into_the_student_that_sees_uv_prunes_share(name):
    """With every row dropped to 20 % of its video, chosen by UV-Prune on the teacher: the student
    runs with only those visual tokens in its mask, at the whole prompt's positions, and the
    distillation term is KL(teacher ‖ student) with the teacher seeing the whole video."""
    import math

    from transformers import AutoModelForImageTextToText

    from stages.prune import uv_scores
    from zoo.train.data import shifted_positions
    from zoo.train.toy import step_losses

    torch.manual_seed(0)
    config = zoo_config(name)
    net, teacher = (AutoModelForImageTextToText.from_config(config).eval() for _ in range(2))
    batch = next(iter(Batches(name, 2, (4, 4), 0, visual_drop=1.0, visual_keep=(0.2, 0.2), visual_uv_share=1.0)))
    with torch.no_grad():
        losses = step_losses(net, {}, batch, teacher, uv_layers=(0, 2))
        plain = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values_videos",
                                                          "video_grid_thw", "second_per_grid_ts", "mm_token_type_ids")}
        taught = teacher(**plain, output_hidden_states=True)
        video_id = config.video_token_id if config.model_type == "qwen2_5_vl" else config.video_token_index
        mask = batch["attention_mask"].clone()
        for b in range(2):
            where = (batch["input_ids"][b] == video_id).nonzero()[:, 0]
            start, end = int(where[0]), int(where[-1]) + 1
            answer = int((batch["labels"][b] != -100).nonzero()[0])
            scores = uv_scores({i: h[b] for i, h in enumerate(taught.hidden_states)}, slice(start, end),
                               torch.arange(end, answer), [0, 1, 2])
            k = math.ceil(round(0.2 * (end - start), 9))
            dropped = torch.ones(end - start, dtype=torch.bool)
            dropped[scores.topk(k).indices] = False
            mask[b, start:end][dropped] = 0
        positions = shifted_positions(net, plain, torch.zeros_like(batch["input_ids"]))
        student = net(**{k: v for k, v in plain.items() if k != "attention_mask"}, attention_mask=mask,
                      position_ids=positions, labels=batch["labels"])
        scored = batch["labels"][:, 1:] != -100
        t = torch.log_softmax(taught.logits.double(), -1)[:, :-1][scored]
        s = torch.log_softmax(student.logits.double(), -1)[:, :-1][scored]
        expected = (t.exp() * (t - s)).sum(-1).mean()
    assert float(losses["loss"]) == pytest.approx(float(student.loss), rel=1e-4)
    assert float(losses["distill_loss"]) == pytest.approx(float(expected), rel=1e-4)
    assert int(mask.sum()) < int(batch["attention_mask"].sum())


def test_with_dropout_the_looking_loss_asks_for_attention_on_kept_tokens_only():
    from transformers import AutoModelForImageTextToText

    from zoo.train.data import shifted_positions
    from zoo.train.dropout import keep_mask
    from zoo.train.losses import grounding_loss
    from zoo.train.toy import step_losses

    torch.manual_seed(0)
    config = zoo_config("qwen-draft")
    net = AutoModelForImageTextToText.from_config(config).eval()
    net.set_attn_implementation("eager")
    batches = iter(Batches("qwen-draft", 2, (6, 6), 0, visual_drop=1.0, visual_keep=(0.3, 0.3)))
    batch = next(b for b in batches if bool(b["ground_mask"].any()))
    with torch.no_grad():
        losses = step_losses(net, {}, batch, None, ground_layer=1)
        is_video = batch["input_ids"] == config.video_token_id
        keep = keep_mask(is_video, batch["keep_noise"], batch["keep_fraction"])
        plain = {k: v for k, v in batch.items() if k in ("input_ids", "pixel_values_videos", "video_grid_thw",
                                                          "second_per_grid_ts", "mm_token_type_ids")}
        positions = shifted_positions(net, plain | {"attention_mask": batch["attention_mask"]},
                                      torch.zeros_like(batch["input_ids"]))
        out = net(**plain, attention_mask=batch["attention_mask"] * keep, position_ids=positions,
                  output_attentions=True)
        expected = grounding_loss(out.attentions[1], batch["ground_mask"] & keep[:, None, :])
    assert bool((batch["ground_mask"] & ~keep[:, None, :]).any())          # some targets were dropped
    assert torch.isfinite(losses["ground_loss"]) and float(losses["ground_loss"]) == pytest.approx(float(expected), rel=1e-4)
