"""The toy world: determinism, events over the whole timeline, the video file, the grammar and the scorer."""

import itertools
import json
import re

import av
import numpy as np
import pytest

from zoo.captions import _lcs_length, caption, parse, prompts, score, score_reference, vocabulary
from zoo.videos import make_video, render
from zoo.world import COLORS, END_S, GAP_S, Truth, make_world, scene_at


def frames_bytes(world, fps=2, size=64) -> bytes:
    return b"".join(f.tobytes() for f in render(world, fps, size))


def clauses(text: str) -> list[str]:
    return [c.strip() + " ." for c in text.split(".") if c.strip()]


def decode(path) -> list[av.VideoFrame]:
    with av.open(str(path)) as container:
        return list(container.decode(container.streams.video[0]))


# ------------------------------------------------------------------------------------- world

def test_same_seed_same_world_and_frames_other_seed_differs():
    assert make_world(7, 30) == make_world(7, 30)
    assert frames_bytes(make_world(7, 30)) == frames_bytes(make_world(7, 30))
    assert make_world(7, 30).truth != make_world(8, 30).truth
    assert frames_bytes(make_world(7, 30)) != frames_bytes(make_world(8, 30))


def test_render_gives_fresh_uint8_frames_of_the_asked_size():
    frames = list(render(make_world(1, 10), 2, (48, 80)))
    assert len(frames) == 20
    assert all(f.shape == (48, 80, 3) and f.dtype == np.uint8 for f in frames)
    assert len({id(f) for f in frames}) == len(frames)        # list(render(...)) keeps every frame


def test_a_shorter_video_is_a_prefix_of_a_longer_one():
    short, long = make_world(4, 30).truth.events, make_world(4, 120).truth.events
    assert short == tuple(e for e in long if e.time <= 30 - END_S)


@pytest.mark.parametrize("seconds", [20, 30, 120, 600])
def test_events_are_spread_over_the_whole_timeline(seconds):
    counts = []
    for seed in range(20):
        events = make_world(seed, seconds).truth.events
        times = [e.time for e in events]
        assert times == sorted(times) and times[0] == 0
        assert any(seconds / 3 <= t < 2 * seconds / 3 for t in times), f"seed {seed}: nothing in the middle third"
        assert seconds - END_S - GAP_S[1] <= times[-1] <= seconds - END_S
        later = [t for t in times if t > 0]
        assert all(b - a >= GAP_S[0] - 1e-9 for a, b in zip(later, later[1:]))
        counts.append(len(events))
    if seconds >= 30:
        assert 6 <= np.mean(counts) * 30 / seconds <= 11, counts        # about 8 events per 30 s


def test_a_denser_world_keeps_its_gaps_and_refuses_overlapping_moves():
    import pytest

    for seed in range(10):
        times = [e.time for e in make_world(seed, 60, gap_s=(1.0, 1.5)).truth.events if e.time > 0]
        assert all(1.0 - 1e-9 <= b - a <= 1.5 + 1e-9 for a, b in itertools.pairwise(times))
        assert len(times) >= (60 - END_S) / 1.5 - 2
    with pytest.raises(ValueError, match="gap_s"):
        make_world(0, 30, gap_s=(0.5, 1.0))
    with pytest.raises(ValueError, match="gap_s"):
        make_world(0, 30, gap_s=(3.0, 2.0))


def test_objects_on_screen_have_distinct_shapes_and_places():
    for seed in range(5):
        world = make_world(seed, 120)
        assert len(scene_at(world, 0).sprites) == 1
        for t in np.arange(0, 120, 0.5):
            sprites = scene_at(world, t).sprites
            assert len(sprites) <= 3
            assert len({s.shape for s in sprites}) == len(sprites)          # "the <shape>" names one object
            assert len({(s.x, s.y) for s in sprites}) == len(sprites)


def test_truth_round_trips_through_json():
    truth = make_world(3, 120).truth
    assert Truth.from_dict(json.loads(json.dumps(truth.to_dict()))) == truth


# ------------------------------------------------------------------------------------- video

@pytest.mark.parametrize("seconds,fps,size", [(10, 2, 64), (7.5, 4, (48, 80)), (12, 0.5, 112)])
def test_video_has_the_asked_length_fps_and_size(tmp_path, seconds, fps, size):
    path = tmp_path / "toy.mp4"
    truth = make_video(3, seconds, fps, size, path)
    assert truth == make_world(3, seconds).truth
    frames = decode(path)
    h, w = (size, size) if isinstance(size, int) else size
    assert len(frames) == round(seconds * fps)
    assert {(f.height, f.width) for f in frames} == {(h, w)}
    assert [round(f.time, 3) for f in frames] == [round(k / fps, 3) for k in range(len(frames))]


def test_pieces_start_on_keyframes_and_cover_the_video():
    from zoo.videos import chunk_ranges

    assert chunk_ranges(100, 8, 6.0, 2.0) == [range(0, 48), range(48, 96), range(96, 100)]   # 6 s: 3 GOPs of 16
    assert chunk_ranges(10, 8, 0.1, 2.0) == [range(0, 10)]                                  # never under one GOP
    with pytest.raises(ValueError, match="chunk_s"):
        chunk_ranges(10, 8, 0, 2.0)


def test_render_can_start_anywhere():
    world = make_world(4, 9)
    whole = list(render(world, 4, 32))
    part = list(render(world, 4, 32, range(10, 25)))
    assert len(part) == 15 and all((a == b).all() for a, b in zip(part, whole[10:25]))
    with pytest.raises(ValueError, match="frames"):
        next(render(world, 4, 32, range(30, 40)))


def test_a_video_encoded_in_pieces_is_one_stream_whatever_the_workers(tmp_path):
    seconds, fps = 13, 8
    truth = make_video(5, seconds, fps, (48, 80), tmp_path / "one.mp4", chunk_s=4, workers=1)
    assert truth == make_world(5, seconds).truth
    make_video(5, seconds, fps, (48, 80), tmp_path / "two.mp4", chunk_s=4, workers=2)
    assert (tmp_path / "one.mp4").read_bytes() == (tmp_path / "two.mp4").read_bytes()
    frames = decode(tmp_path / "two.mp4")
    assert [round(f.time, 3) for f in frames] == [round(k / fps, 3) for k in range(seconds * fps)]
    with av.open(str(tmp_path / "two.mp4")) as container:
        keys = [i for i, p in enumerate(container.demux(video=0)) if p.dts is not None and p.is_keyframe]
    assert keys == list(range(0, seconds * fps, 16))                # a keyframe every 2 s, pieces included
    clean = list(render(make_world(5, seconds), fps, (48, 80)))
    error = max(np.abs(f.to_ndarray(format="rgb24").astype(int) - c).mean() for f, c in zip(frames, clean))
    assert error < 3, error                                         # compression, not misplaced frames
    assert not list(tmp_path.glob(".*"))                            # the pieces' folder is gone


def test_colors_survive_h264_at_64px(tmp_path):
    palette = np.array(list(COLORS.values()), np.float32)
    for seed in (5, 6):
        world = make_world(seed, 60)
        make_video(seed, 60, 1, 64, tmp_path / "toy.mp4")
        decoded = [f.to_ndarray(format="rgb24") for f in decode(tmp_path / "toy.mp4")]
        for k, (clean, seen) in enumerate(zip(render(world, 1, 64), decoded)):
            for s in scene_at(world, k).sprites:
                inside = (clean == COLORS[s.color]).all(axis=-1)    # fully covered pixels
                mean = seen[inside].astype(np.float32).mean(axis=0)
                nearest = list(COLORS)[np.argmin(((palette - mean) ** 2).sum(axis=1))]
                assert nearest == s.color, f"seed {seed}, {k} s: a {s.color} {s.shape} decodes as {mean}"


# ----------------------------------------------------------------------------------- grammar

def test_caption_is_one_clause_per_event_and_scores_one():
    for seed in range(30):
        truth = make_world(seed, 60).truth
        text = caption(truth)
        assert len(clauses(text)) == len(truth.events)
        assert parse(text) == [e.key() for e in truth.events]
        s = score(text, truth)
        assert (s["precision"], s["recall"], s["f1"]) == (1.0, 1.0, 1.0)


def test_a_reference_scores_as_its_truth_does_and_counts_its_events():
    truth = make_world(3, 60).truth
    half = " ".join(clauses(caption(truth))[: len(truth.events) // 2])
    s = score_reference(half, json.loads(json.dumps(truth.to_dict())))     # as a request carries it
    assert s == {k: score(half, truth)[k] for k in ("precision", "recall", "f1")} | {"events": len(truth.events)}
    assert s["precision"] == 1.0 and s["recall"] < 1.0


def test_every_word_of_captions_prompts_and_answers_is_in_the_vocabulary():
    vocab = vocabulary()
    assert len(vocab) == len(set(vocab)) < 100
    assert all(re.fullmatch(r"[a-z]+|[.?]", w) for w in vocab)
    used = set()
    for seed, seconds in itertools.product(range(60), (5, 30, 120)):
        truth = make_world(seed, seconds).truth
        for prompt, answer in prompts(truth, seed):
            used.update(prompt.split(), answer.split())
        used.update(caption(truth).split())
    assert used <= set(vocab), used - set(vocab)
    assert set(vocab) - used <= {"nothing"}      # the grammar has no dead words ("nothing": rare)


def test_prompt_answers_agree_with_the_truth():
    kinds = set()
    for seed in range(40):
        world = make_world(seed, 90)
        truth = world.truth
        pairs = prompts(truth, np.random.default_rng(seed))
        assert pairs[0] == ("describe the video .", caption(truth))
        for prompt, answer in pairs[1:]:
            if m := re.fullmatch(r"what happened after the (\w+) (\w+) appeared \?", prompt):
                kinds.add("after")
                (appeared,) = [e for e in truth.events if e.kind == "appear" and (e.color, e.shape) == m.groups()]
                later = tuple(e for e in truth.events if e.time > appeared.time)
                assert parse(answer) == [e.key() for e in later]
                if later:
                    assert score(answer, Truth(90, later))["f1"] == 1.0
                else:
                    assert answer == "nothing ."
            elif m := re.fullmatch(r"what color is the (\w+) at the end \?", prompt):
                kinds.add("color")
                (sprite,) = [s for s in scene_at(world, 90).sprites if s.shape == m.group(1)]
                assert answer == f"{sprite.color} ."
            else:
                raise AssertionError(f"unknown prompt {prompt!r}")
    assert kinds == {"after", "color"}


# ------------------------------------------------------------------------------------ scorer

def test_a_missing_event_lowers_recall_only():
    truth = make_world(2, 60).truth
    parts = clauses(caption(truth))
    s = score(" ".join(parts[:len(parts) // 2] + parts[len(parts) // 2 + 1:]), truth)
    assert s["precision"] == 1.0 and s["recall"] == (len(parts) - 1) / len(parts) and s["f1"] < 1


def test_an_extra_wrong_event_lowers_precision_only():
    truth = make_world(2, 60).truth
    parts = clauses(caption(truth))
    keys = {e.key() for e in truth.events}
    wrong = next(f"the {c} {s} moves up ." for c in COLORS for s in ("circle", "star")
                 if ("move", c, s, "up") not in keys)
    s = score(" ".join(parts[:3] + [wrong] + parts[3:]), truth)
    assert s["recall"] == 1.0 and s["precision"] == len(parts) / (len(parts) + 1) and s["f1"] < 1


def test_order_matters():
    truth = make_world(2, 60).truth
    assert score(" ".join(reversed(clauses(caption(truth)))), truth)["recall"] < 0.5


@pytest.mark.parametrize("text", ["", "   ", ".", "nothing .", "banana split ?? the the the", "a large red circle",
                                  "the red circle moves sideways .", "the red sphere turns green .", "\x00 ☃ 123 !"])
def test_garbage_scores_zero_without_error(text):
    s = score(text, make_world(2, 30).truth)
    assert (s["precision"], s["recall"], s["f1"]) == (0.0, 0.0, 0.0)


def test_parser_tolerates_case_spacing_and_a_missing_final_stop():
    assert parse("A LARGE red Circle appears.The red circle moves left  ; the red circle   grows") == [
        ("appear", "large", "red", "circle"), ("move", "red", "circle", "left"), ("grow", "red", "circle")]
    assert parse("a large red circle appears the red circle moves left .") == []   # no stop: one bad clause


def test_lcs_matches_the_textbook_dp():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = (list(rng.integers(0, 4, rng.integers(0, 25))) for _ in range(2))
        table = np.zeros((len(a) + 1, len(b) + 1), int)
        for i, j in itertools.product(range(len(a)), range(len(b))):
            table[i + 1, j + 1] = table[i, j] + 1 if a[i] == b[j] else max(table[i, j + 1], table[i + 1, j])
        assert _lcs_length(a, b) == table[-1, -1]
