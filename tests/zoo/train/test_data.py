"""zoo.train.data: examples and batches score only the answer, carry the training-only targets, and
draw lengths, denser worlds, frame rates and position moves as their settings say."""

import numpy as np
import pytest
import torch

from graph.spec import ConfigError
from zoo import world
from zoo.shapes import zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train.data import Batches, example, model_inputs
from zoo.train.labels import event_tokens
from zoo.train.toy import train


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


def test_text_shift_moves_only_the_text_after_the_video_for_both_families():
    """No offset gives the model's own positions (same logits as its forward without them); a shift
    of s adds s to every position after the video and leaves the video and what precedes it."""
    from transformers import AutoModelForImageTextToText

    from zoo.train.data import shifted_positions

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
    from zoo.train.data import position_offsets

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


def test_codec_examples_are_the_rendered_frames_through_h264():
    """train.codec: same shape and content within the codec's error, but not the rendered bytes
    (4:2:0 chroma and compression artifacts are what inference sees)."""
    from zoo.train.data import h264_round_trip

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
    result = train(model="qwen-draft", steps=1, batch_size=2, seconds=(6, 6), warm_seconds=(6, 6), warmup=1, eval_seconds=4,
                   eval_videos=1, dense_gap=[1.0, 2.0], dense_share=1.0, out=str(tmp_path / "ck"), progress=False)
    assert (result["dense_gap"], result["dense_share"]) == ([1.0, 2.0], 1.0)
    with pytest.raises(ConfigError, match="dense_gap"):
        train(model="qwen-draft", steps=1, dense_gap=[0.5, 1.0], progress=False)     # moves would overlap
    with pytest.raises(ConfigError, match="dense_share"):
        train(model="qwen-draft", steps=1, dense_gap=[1.0, 2.0], dense_share=2, progress=False)


def test_each_loader_worker_follows_the_curriculum_of_the_training_steps():
    """The DataLoader takes batches from its workers in turn; with 2 workers the loader's batches
    still widen step by step (warm 2 s to 6 s over 4 batches: 2, 3, 4, 5, 6, 6 s), not twice as slowly."""
    import itertools

    loader = torch.utils.data.DataLoader(Batches("qwen-draft", 1, (6, 6), 0, (2, 2), ramp_batches=4),
                                         batch_size=None, num_workers=2)
    seconds = [int(b["video_grid_thw"][0, 0]) for b in itertools.islice(loader, 6)]   # 2 fps, 2 frames a patch
    assert seconds == [2, 3, 4, 5, 6, 6]


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
    with pytest.raises(ConfigError, match="fps_scale="):
        train(model="qwen-draft", steps=1, fps_scale=[0, 2], device="cpu", progress=False)
    with pytest.raises(ConfigError, match="fps_scale="):
        train(model="qwen-draft", steps=1, fps_scale=[2.5, 3], device="cpu", progress=False)



def test_a_stream_started_at_step_k_gives_the_uninterrupted_streams_batches_from_k():
    """What a resumed run trains on: step k's batch does not depend on the batches before it."""
    import itertools

    whole = list(itertools.islice(iter(Batches("qwen-draft", 2, (3, 4), 5, (2, 3), ramp_batches=3)), 4))
    later = list(itertools.islice(iter(Batches("qwen-draft", 2, (3, 4), 5, (2, 3), ramp_batches=3, start=2)), 2))
    for a, b in zip(whole[2:], later):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(whole[0]["input_ids"], whole[1]["input_ids"])
