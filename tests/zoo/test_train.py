"""The trainer end to end at a toy scale (a few steps of the draft shape): it writes a checkpoint
that loads like a real one (bf16 safetensors, tokenizer with chat template, preprocessing) and a
training.json; the batches it builds score only the answer."""

import json

import numpy as np
import pytest
import torch

from models.load import load_model
from zoo import captions, world
from zoo.shapes import SHAPES, zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train import (
    AUX,
    Batches,
    cell_labels,
    event_tokens,
    example,
    model_inputs,
    train,
)


def test_batches_label_only_the_answer_and_its_end():
    config, tok = zoo_config("qwen-draft"), build_tokenizer("qwen2_5_vl")
    ex = example(1_000_003, 6, 2.0, np.random.default_rng(0))
    batch = model_inputs(config, tok, [ex, example(1_000_004, 6, 2.0, np.random.default_rng(1))], with_answers=True)
    labels = batch["labels"][0]
    answer = labels[labels != -100].tolist()
    assert answer == tok(ex.answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert (batch["mm_token_type_ids"] == 2).sum() == 2 * 54     # 6 s at 2 fps: 6 temporal patches x 9, both rows


def test_curriculum_widens_from_warm_to_full_lengths():
    b = Batches("qwen-draft", 2, (8, 32), 0, (2, 12), ramp_batches=10)
    assert b.lengths(0) == (2, 12) and b.lengths(10) == (8, 32) and b.lengths(5) == (5, 22)


def test_a_few_steps_write_a_checkpoint_that_loads_like_a_real_one(tmp_path):
    result = train("qwen-draft", steps=3, batch_size=2, seconds=(2, 4), warm_seconds=(2, 4), warmup=1,
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
    train("qwen-draft", steps=2, batch_size=2, seconds=(2, 3), warm_seconds=(2, 3), warmup=1, eval_seconds=3,
          eval_videos=1, out=str(first), progress=False)
    result = train("qwen-draft", steps=2, batch_size=2, seconds=(2, 3), warm_seconds=(2, 3), warmup=1, eval_seconds=3,
                   eval_videos=1, out=str(tmp_path / "b"), init=str(first), progress=False)
    saved = json.loads((tmp_path / "b" / "training.json").read_text())
    assert result["init"] == str(first) and saved["init_training"]["steps"] == 2
    with pytest.raises(ValueError, match="is not a qwen-target checkpoint"):
        train("qwen-target", steps=1, init=str(first), progress=False)
    with pytest.raises(ValueError, match="trained with 1e\\+06"):    # the rotary base belongs to the checkpoint
        train("qwen-draft", steps=1, init=str(first), rope_theta=1e4, progress=False)


def test_the_rotary_base_is_a_zoo_option_for_both_families(tmp_path):
    from zoo.shapes import ROPE_THETA
    for name in ("qwen-draft", "llava-draft"):
        assert zoo_config(name).text_config.rope_parameters["rope_theta"] == ROPE_THETA
        assert zoo_config(name, rope_theta=5e5).text_config.rope_parameters["rope_theta"] == 5e5
    train("qwen-draft", steps=1, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
          eval_videos=1, rope_theta=5e5, precision="fp32", out=str(tmp_path / "ck"), progress=False)
    loaded = load_model(str(tmp_path / "ck"), name="d").model.config.text_config
    assert loaded.rope_parameters["rope_theta"] == 5e5
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert saved["rope_theta"] == 5e5 and saved["precision"] == "fp32"


def test_an_unknown_precision_is_refused_before_any_work():
    with pytest.raises(ValueError, match="bf16 .* or fp32"):
        train("qwen-draft", steps=1, precision="fp16", progress=False)


def test_cell_labels_say_what_is_on_each_cell_and_where_the_cell_is():
    w = world.make_world(1_000_011, 20)
    labels = cell_labels(w, 2.0, 40, 2)                 # 20 temporal steps of 9 row-major cells
    assert labels.shape == (20 * 9, len(AUX))
    names = list(AUX)
    row, column = labels[:, names.index("row")], labels[:, names.index("column")]
    assert row.tolist() == [i // 3 for i in range(9)] * 20 and column.tolist() == [i % 3 for i in range(9)] * 20
    scene = world.scene_at(w, 39 / 2.0)                   # the last step's last frame
    last = labels[-9:]
    for sp in scene.sprites:
        cell = last[min(int(sp.y), 2) * 3 + min(int(sp.x), 2)]
        assert AUX["shape"][cell[0]] == sp.shape and AUX["color"][cell[1]] == sp.color
    assert (last[:, 0] > 0).sum() == len(scene.sprites)


def test_event_labels_mark_each_event_on_its_cell_in_the_step_that_first_shows_it():
    """A move marks its source cell `leave` when the glide starts and its destination with the
    direction when it ends; every event lands in the temporal step of the first frame showing it."""
    from zoo.train import EVENT_CLASSES, event_labels

    w = world.make_world(3, 30)
    labels = event_labels(w, 2.0, 60, 2).reshape(30, 9)
    marked = {(int(s), int(c)): EVENT_CLASSES[labels[s, c]] for s, c in (labels != 0).nonzero()}
    # seed 3: appear 0.0 s and 4.33 s, recolor 6.97 s, moves left 10.53 s and right 14.25 s, ...
    moves = [(e, cell) for e, cell in zip(w.truth.events, w.cells) if e.kind == "move"]
    assert [e.change for e, _ in moves] == ["left", "right"]
    (_, (c, r)), _ = moves
    assert marked[(11, r * 3 + c + 1)] == "leave"              # moves left at 10.53 s: frame 22 is in step 11
    assert marked[(12, r * 3 + c)] == "left"                   # the glide ends 11.53 s: frame 24, step 12
    assert marked[(14, r * 3 + c)] == "leave" and marked[(15, r * 3 + c + 1)] == "right"    # and back at 14.25 s
    assert sorted(marked.values()).count("appear") == 3 and "recolor" in marked.values()
    assert len(marked) == 9


def test_event_tokens_are_where_each_event_is_shown():
    """Seed 3 at 2 fps, 2 frames a step: the first appearance in step 0 on its cell, a move on the
    cell it leaves (step 11) and the one it reaches (step 12), the opening background on all 9."""
    from zoo.train import event_tokens

    w = world.make_world(3, 30)
    tokens = event_tokens(w, 2.0, 60, 2)
    assert len(tokens) == len(w.truth.events) and tokens[0] == list(range(9))
    first = w.cells[1]
    assert tokens[1] == [first[1] * 3 + first[0]]
    i = next(i for i, e in enumerate(w.truth.events) if e.kind == "move")
    (c, r) = w.cells[i]                                        # where the left move ends
    assert tokens[i] == [11 * 9 + r * 3 + c + 1, 12 * 9 + r * 3 + c]
    assert event_tokens(w, 2.0, 20, 2)[i] == []                # 10 s of video: the move is not in it
    earlier = event_tokens(w, 2.0, 60, 2, before=True)     # a change: also its cell one step before
    for j, e in enumerate(w.truth.events):
        if e.kind in ("disappear", "recolor", "grow", "shrink"):
            assert earlier[j] == [tokens[j][0] - 9] + tokens[j]
        else:
            assert earlier[j] == tokens[j]


def test_grounding_marks_each_clauses_tokens_with_its_events_cells():
    """The positions whose next token belongs to clause j look at event j's visual tokens; a
    "what happened after" answer starts at the event after the named one; other answers mark nothing."""
    from zoo.train import answer_events, event_tokens, grounding_mask

    w = world.make_world(3, 30)
    truth, tokens = w.truth, event_tokens(w, 2.0, 60, 2)
    assert answer_events(truth, captions.caption(truth)) == list(range(len(truth.events)))
    assert answer_events(truth, captions.caption(world.Truth(30.0, truth.events[3:]))) == list(range(3, len(truth.events)))
    assert answer_events(truth, "red .") is None
    answer_at, video_at, width = 300, 5, 400
    mask = grounding_mask(truth, captions.caption(truth), tokens, answer_at, video_at, width)
    first, second = (len(captions._clause(e).split()) for e in truth.events[:2])
    assert mask[answer_at - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[0]]
    assert mask[answer_at + first - 2].nonzero().flatten().tolist() == [video_at + t for t in tokens[0]]
    assert mask[answer_at + first - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[1]]
    assert mask[answer_at + first + second - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[2]]
    assert not mask[: answer_at - 1].any()
    assert not grounding_mask(truth, "red .", tokens, answer_at, video_at, width).any()


def test_grounding_loss_is_small_only_where_the_head_looks_at_the_marked_tokens():
    import torch

    from zoo.train import grounding_loss

    mask = torch.zeros(1, 3, 3, dtype=torch.bool)
    mask[0, 2, 0] = True                                       # only query 2 has a target: key 0
    looks = torch.zeros(1, 2, 3, 3)
    looks[0, 0, :, 0] = 1.0                                    # head 0 all on key 0
    away = torch.zeros(1, 2, 3, 3)
    away[0, 0, :, 1] = 1.0
    away[0, 1, :, 0] = 1.0                                     # another head looking there does not count
    assert grounding_loss(looks, mask).item() < 1e-6
    assert grounding_loss(away, mask).item() > 10
    assert grounding_loss(looks, torch.zeros_like(mask)).item() == 0.0


def test_a_margin_asks_for_larger_logit_gaps():
    """margin m: the loss of the head's logits divided by m, so a gap that gives the target most of
    the mass at m = 1 costs more at m = 2, and a head that looks nowhere else costs nothing either way."""
    import torch

    from zoo.train import grounding_loss

    logits = torch.tensor([3.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[[True, False, False, False]]])
    weights = torch.softmax(logits, -1).view(1, 1, 1, 4)
    assert abs(grounding_loss(weights, mask).item() + torch.log_softmax(logits, -1)[0].item()) < 1e-5
    assert abs(grounding_loss(weights, mask, 2.0).item() + torch.log_softmax(logits / 2, -1)[0].item()) < 1e-5
    certain = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    assert grounding_loss(certain, mask, 2.0).item() < 1e-6


def test_grounded_training_runs_eager_and_saves_an_sdpa_checkpoint(tmp_path):
    result = train("qwen-draft", steps=2, batch_size=2, seconds=(4, 6), warm_seconds=(4, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, log_every=1, ground_weight=1.0, out=str(tmp_path / "ck"), progress=False)
    assert result["ground_layer"] == 1 and all(np.isfinite(h["ground_loss"]) for h in result["history"])
    assert load_model(str(tmp_path / "ck"), name="d").model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="layers 0..1"):
        train("qwen-draft", steps=1, ground_weight=1.0, ground_layer=2, progress=False)


def test_distillation_adds_the_teachers_kl_and_it_is_zero_against_itself(tmp_path):
    """A student equal to its teacher has KL 0 on every answer token; a different one does not."""
    import torch
    from transformers import AutoModelForImageTextToText

    from zoo.train import distill_loss

    torch.manual_seed(0)
    config, tok = zoo_config("qwen-draft"), build_tokenizer("qwen2_5_vl")
    net = AutoModelForImageTextToText.from_config(config).eval()
    batch = model_inputs(config, tok, [example(1_000_003, 4, 2.0, np.random.default_rng(0))], with_answers=True)
    batch = {k: v for k, v in batch.items() if k not in ("cell_labels", "event_labels", "ground_mask", "chain_mask")}
    logits = net(**batch).logits
    assert abs(distill_loss(logits, net, batch).item()) < 1e-5
    other = AutoModelForImageTextToText.from_config(config).eval()
    assert distill_loss(other(**batch).logits, net, batch).item() > 1e-3


def test_stretch_spreads_half_the_qwen_examples_and_leaves_llava_alone():
    """train.stretch: per example a factor on the temporal spacing, 1 for about half, else in
    [1, stretch]; the batch's second_per_grid_ts carries it. LLaVA (1-D positions) gets none."""
    rng = np.random.default_rng(0)
    factors = Batches("qwen-draft", 400, (2, 4), 0, stretch=4.0).stretches(rng)
    ones = sum(f == 1.0 for f in factors)
    assert 150 < ones < 250 and all(1.0 <= f <= 4.0 for f in factors) and max(factors) > 3.5
    assert Batches("llava-draft", 4, (2, 4), 0, stretch=4.0).stretches(rng) is None
    assert Batches("qwen-draft", 4, (2, 4), 0).stretches(rng) is None
    config, tok = zoo_config("qwen-draft"), build_tokenizer("qwen2_5_vl")
    exs = [example(1_000_003, 4, 2.0), example(1_000_004, 4, 2.0)]
    batch = model_inputs(config, tok, exs, with_answers=False, stretch=[1.0, 2.5])
    assert batch["second_per_grid_ts"].tolist() == [1.0, 2.5]       # 2 frames at 2 fps = 1 s a patch


def test_chain_marks_each_events_tokens_with_the_previous_events_before_them():
    """Rows: the visual tokens showing event j >= 1; columns: those showing event j - 1 that come
    before the row and do not show event j too. Nothing else has a target."""
    from zoo.train import chain_mask, event_tokens

    w = world.make_world(3, 30)
    tokens, video_at = event_tokens(w, 2.0, 60, 2), 5
    mask = chain_mask(tokens, video_at, 700)
    appear = tokens[1][0]                      # event 1 appears in step 0, where the background (event 0) is on all 9
    assert mask[video_at + appear].nonzero().flatten().tolist() == [video_at + i for i in range(appear)]
    for j in range(2, len(tokens)):
        for q in tokens[j]:
            expected = [video_at + i for i in tokens[j - 1] if i < q and i not in tokens[j]]
            assert mask[video_at + q].nonzero().flatten().tolist() == expected
    rows = {video_at + q for ts in tokens[1:] for q in ts}
    assert all(int(r) in rows for r in mask.any(-1).nonzero().flatten())


def test_text_shift_moves_only_the_text_after_the_video_for_both_families():
    """No offset gives the model's own positions (same logits as its forward without them); a shift
    of s adds s to every position after the video and leaves the video and what precedes it."""
    from transformers import AutoModelForImageTextToText

    from zoo.train import shifted_positions

    torch.manual_seed(0)
    for name in ("qwen-draft", "llava-draft"):
        config = zoo_config(name)
        tok, fps = build_tokenizer(config.model_type), 2.0 if config.model_type == "qwen2_5_vl" else 1.0
        net = AutoModelForImageTextToText.from_config(config).eval()
        exs = [example(1_000_003, 4, fps), example(1_000_004, 4, fps)]
        batch = model_inputs(config, tok, exs, with_answers=True, moves=[(7, []), (0, [])])
        offset = batch.pop("position_offset")
        plain = {k: v for k, v in batch.items() if k not in ("labels", "cell_labels", "event_labels", "ground_mask", "chain_mask")}
        own = shifted_positions(net, plain, torch.zeros_like(offset))
        with torch.no_grad():
            assert torch.allclose(net(**plain).logits, net(**plain, position_ids=own).logits, atol=1e-5)
        moved = shifted_positions(net, plain, offset)
        video = config.video_token_id if config.model_type == "qwen2_5_vl" else config.video_token_index
        after = int((batch["input_ids"][0] == video).nonzero().max()) + 1
        diff = moved - own
        first, second = (diff[:, 0], diff[:, 1]) if diff.dim() == 3 else (diff[0], diff[1])
        assert (first[..., :after] == 0).all() and (first[..., after:] == 7).all(), name
        assert (second == 0).all()


def test_clause_gaps_move_each_clause_on_from_the_previous():
    """position_offsets: the shift from the video's end, and after the k-th "." of the answer the
    sum of the first k gaps more; gaps beyond the answer's clauses are unused."""
    from zoo.train import position_offsets

    DOT = 9
    row = [1, 2, 3, 4, 5, 6, 9, 7, 8, 9, 0]        # video ends at 3, answer from 5: "6 . 7 8 . <end>"
    assert position_offsets(row, 3, 5, DOT, 10, [2, 5, 100]) == [0, 0, 0, 10, 10, 10, 10, 12, 12, 12, 17]
    assert position_offsets(row, 3, 5, DOT, 0, []) == [0] * 3 + [0] * 8


def test_text_moves_leave_half_the_examples_and_the_batch_carries_them():
    rng = np.random.default_rng(0)
    moves = Batches("llava-draft", 400, (2, 4), 0, text_shift=50, clause_gap=8).moves(rng)
    shifts = [m[0] for m in moves]
    assert 150 < shifts.count(0) < 250 and all(0 <= s <= 50 for s in shifts) and max(shifts) > 45
    assert all(m[1] == [] for m in moves if m[0] == 0)
    assert all(0 <= g <= 8 for m in moves for g in m[1]) and max(g for m in moves for g in m[1]) == 8
    assert Batches("qwen-draft", 4, (2, 4), 0).moves(rng) is None
    config, tok = zoo_config("qwen-draft"), build_tokenizer("qwen2_5_vl")
    batch = model_inputs(config, tok, [example(1_000_003, 4, 2.0)], with_answers=True, moves=[(3, [1] * 64)])
    answer = (batch["labels"][0] != -100).nonzero().flatten()
    dots = int((batch["input_ids"][0, answer] == tok.convert_tokens_to_ids(".")).sum())
    assert int(batch["position_offset"][0, answer[-1]]) == 3 + dots        # the <|im_end|> after the last clause
    assert batch["chain_mask"].shape == batch["ground_mask"].shape


def test_a_chained_shifted_run_logs_its_chain_loss_and_refuses_bad_settings(tmp_path):
    result = train("llava-draft", steps=2, batch_size=2, seconds=(4, 6), warm_seconds=(4, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, log_every=1, ground_weight=1.0, chain_weight=1.0, text_shift=20, clause_gap=4,
                   ground_margin=2.0, out=str(tmp_path / "ck"), progress=False)
    assert result["chain_layer"] == 1 and (result["text_shift"], result["clause_gap"], result["ground_margin"]) == (20, 4, 2.0)
    assert all(np.isfinite(h["chain_loss"]) for h in result["history"])
    assert load_model(str(tmp_path / "ck"), name="d").model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="layers 0..1"):
        train("qwen-draft", steps=1, chain_weight=1.0, chain_layer=5, progress=False)
    with pytest.raises(ValueError, match="text_shift"):
        train("qwen-draft", steps=1, text_shift=-1, progress=False)
    with pytest.raises(ValueError, match="ground_margin"):
        train("qwen-draft", steps=1, ground_margin=0.5, progress=False)


def test_codec_examples_are_the_rendered_frames_through_h264():
    """train.codec: same shape and content within the codec's error, but not the rendered bytes
    (4:2:0 chroma and compression artifacts are what inference sees)."""
    from zoo.train import h264_round_trip

    rendered = example(1_000_003, 6, 1.0)
    decoded = example(1_000_003, 6, 1.0, codec=True)
    assert decoded.frames.shape == rendered.frames.shape and decoded.answer == rendered.answer
    error = (decoded.frames.float() - rendered.frames.float()).abs()
    assert 0 < error.mean() < 3
    frames = rendered.frames.permute(0, 2, 3, 1).numpy()
    assert np.array_equal(h264_round_trip(frames, 1.0), decoded.frames.permute(0, 2, 3, 1).numpy())


def test_a_share_of_the_examples_come_from_a_denser_world_with_longer_answers(tmp_path):
    rng = np.random.default_rng(0)
    gaps = Batches("qwen-draft", 400, (2, 4), 0, dense_gap=(1.0, 1.5), dense_share=0.25).gaps(rng)
    assert set(gaps) == {(1.0, 1.5), world.GAP_S} and 60 < gaps.count((1.0, 1.5)) < 140
    assert Batches("qwen-draft", 3, (2, 4), 0).gaps(rng) == [world.GAP_S] * 3
    plain, dense = example(1_000_005, 30, 2.0), example(1_000_005, 30, 2.0, gap_s=(1.0, 1.5))
    assert len(dense.truth.events) > 2 * len(plain.truth.events)
    assert len(dense.answer.split(" . ")) == len(dense.truth.events)        # one clause per event
    result = train("qwen-draft", steps=1, batch_size=2, seconds=(6, 6), warm_seconds=(6, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, dense_gap=[1.0, 2.0], dense_share=1.0, out=str(tmp_path / "ck"), progress=False)
    assert (result["dense_gap"], result["dense_share"]) == ([1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="dense_gap"):
        train("qwen-draft", steps=1, dense_gap=[0.5, 1.0], progress=False)     # moves would overlap
    with pytest.raises(ValueError, match="dense_share"):
        train("qwen-draft", steps=1, dense_gap=[1.0, 2.0], dense_share=2, progress=False)


def test_the_device_is_resolved_before_any_work_and_a_missing_gpu_is_refused(monkeypatch):
    import os

    from zoo.train import loader_workers_for, resolve_device

    gpu = torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cuda" if gpu else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not gpu:
        with pytest.raises(ValueError, match="device='cuda'.*no GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device='cuda:99'"):
        resolve_device("cuda:99")
    for bad in ("bogus", "mps", "meta"):
        with pytest.raises(ValueError, match=f"device='{bad}': auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="device='bogus'"):
        train("qwen-draft", steps=1, device="bogus", progress=False)
    assert loader_workers_for(torch.device("cpu"), None) == 1 and loader_workers_for(torch.device("cpu"), 0) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert loader_workers_for(torch.device("cuda"), None) == 14 and loader_workers_for(torch.device("cuda"), 3) == 3
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="loader_workers="):
            loader_workers_for(torch.device("cpu"), bad)


def test_to_device_moves_every_tensor_of_a_nested_batch_and_keeps_dtypes():
    from collections import namedtuple

    from zoo.train import to_device

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


def test_the_training_step_makes_every_tensor_on_its_batchs_device():
    """What runs on a GPU cannot be run here, but what would break it can be seen: a tensor that
    step_losses (or the losses and positions it calls) makes without `device=` lands on the CPU."""
    import sys

    from torch.overrides import TorchFunctionMode
    from transformers import AutoModelForImageTextToText

    import zoo.train as trainer

    factories = {torch.ones, torch.zeros, torch.full, torch.empty, torch.arange, torch.tensor, torch.as_tensor,
                 torch.rand, torch.randn, torch.randint, torch.eye, torch.linspace}

    class Deviceless(TorchFunctionMode):
        """Records the trainer's calls of a tensor factory that name no device."""
        def __init__(self):
            super().__init__()
            self.found = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            caller = sys._getframe(1)
            if func in factories and "device" not in kwargs and caller.f_code.co_filename == trainer.__file__:
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
                 "events": torch.nn.Linear(hidden, len(trainer.EVENT_CLASSES))}
        batch = next(iter(Batches(name, 2, (3, 3), 0, text_shift=5, clause_gap=2)))
        with Deviceless() as mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                losses = trainer.step_losses(net, heads, batch, teacher, 1, 1, 2.0)
            sum(losses.values()).backward()
        assert set(losses) == {"lm", "cells", "events", "distill", "ground", "chain"}, name
        assert mode.found == [], name


def test_each_loader_worker_follows_the_curriculum_of_the_training_steps():
    """The DataLoader takes batches from its workers in turn; with 2 workers the loader's batches
    still widen step by step (warm 2 s to 6 s over 4 batches: 2, 3, 4, 5, 6, 6 s), not twice as slowly."""
    import itertools

    loader = torch.utils.data.DataLoader(Batches("qwen-draft", 1, (6, 6), 0, (2, 2), ramp_batches=4),
                                         batch_size=None, num_workers=2)
    seconds = [int(b["video_grid_thw"][0, 0]) for b in itertools.islice(loader, 6)]   # 2 fps, 2 frames a patch
    assert seconds == [2, 3, 4, 5, 6, 6]


def test_training_on_the_cpu_in_process_records_its_device(tmp_path):
    threads = torch.get_num_threads()
    result = train("qwen-draft", steps=1, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
                   eval_videos=1, log_every=1, device="cpu", loader_workers=0, out=str(tmp_path / "ck"), progress=False)
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert (saved["device"], saved["device_name"], saved["loader_workers"]) == ("cpu", None, 0)
    assert result["device"] == "cpu" and np.isfinite(result["history"][0]["loss"])
    assert torch.get_num_threads() == threads        # batches made in process leave training its threads


def test_a_time_budget_stops_training_early_and_saves_what_is_there(tmp_path):
    """max_minutes: a run that would outlast its budget (a lent GPU's 10-minute command) stops after
    the step that crossed it, saves a loadable checkpoint and records the steps it did."""
    result = train("qwen-draft", steps=50, batch_size=1, seconds=(2, 2), warm_seconds=(2, 2), warmup=1, eval_seconds=2,
                   eval_videos=1, log_every=100, eval_every=0, device="cpu", loader_workers=0, max_minutes=1e-6,
                   out=str(tmp_path / "ck"), progress=False)
    saved = json.loads((tmp_path / "ck" / "training.json").read_text())
    assert (saved["steps"], saved["steps_planned"], saved["max_minutes"]) == (1, 50, 1e-6) and result["steps"] == 1
    assert saved["history"][-1]["step"] == 1 and np.isfinite(saved["history"][-1]["loss"])
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    with pytest.raises(ValueError, match="max_minutes="):
        train("qwen-draft", steps=1, max_minutes=0, device="cpu", out=str(tmp_path / "bad"), progress=False)


def test_scaled_frame_rates_give_more_tokens_for_the_same_video_with_matching_positions_and_targets():
    """fps_scale: a share of the batches renders the same length of video at k times the zoo's frame
    rate; Qwen2.5-VL's time-aligned positions then span the same seconds (second_per_grid_ts / k), and
    the grounding targets sit on the temporal steps of the higher rate."""
    scaled = Batches("qwen-target", 1, (6, 6), 0, (6, 6), fps_scale=(3, 3), fps_share=1.0)
    plain = Batches("qwen-target", 1, (6, 6), 0, (6, 6), fps_scale=(3, 3), fps_share=0.0)
    fast, slow = next(iter(scaled)), next(iter(plain))
    assert int(fast["video_grid_thw"][0, 0]) == 3 * int(slow["video_grid_thw"][0, 0]) == 18   # 6 s at 6 fps, 2 frames a step
    assert fast["second_per_grid_ts"].tolist() == pytest.approx([1 / 3]) and slow["second_per_grid_ts"].tolist() == [1.0]
    ex = example(7, 6.0, 6.0)
    batch = model_inputs(zoo_config("qwen-target"), build_tokenizer("qwen2_5_vl"), [ex], with_answers=True)
    assert batch["video_grid_thw"][0, 0] == 18 and batch["cell_labels"].shape[0] == 18 * 9
    video_at = int((batch["input_ids"][0] == zoo_config("qwen-target").video_token_id).nonzero()[0])
    looked = {int(i) - video_at for i in batch["ground_mask"][0].nonzero()[:, 1]}
    at_6fps = {i for shown in event_tokens(ex.world, 6.0, 36, 2) for i in shown}
    assert looked == at_6fps != {i for shown in event_tokens(ex.world, 2.0, 36, 2) for i in shown}
    llava = next(iter(Batches("llava-target", 1, (4, 4), 0, (4, 4), fps_scale=(2, 2), fps_share=1.0)))
    assert llava["pixel_values_videos"].shape[1] == 8          # 4 s at 2 fps, one frame a step
    with pytest.raises(ValueError, match="fps_scale="):
        train("qwen-draft", steps=1, fps_scale=[0, 2], device="cpu", progress=False)
    with pytest.raises(ValueError, match="fps_scale="):
        train("qwen-draft", steps=1, fps_scale=[2.5, 3], device="cpu", progress=False)
