"""The decode plan: the seek threshold chosen per video, the counts it predicts, and that the
decoders do what it predicts."""

import numpy as np
import pytest

from video.codec import SharedFrames, decode_task, keyframe_intervals, plan_tasks, scan
from video.plan import SEEK_COST_FRAMES, plan_decode, seek_threshold, skipped_share
from video.quickcodec import DecoderPool, quickcodec_groups, resolve_seek_frames


def test_the_threshold_grows_with_the_frames_a_decoder_skips():
    # no B-frames: a gap costs every frame in it
    assert seek_threshold(0, 1000, True) == int(np.ceil(SEEK_COST_FRAMES))
    # x264's default (3 B-frames of every 4, a third of them references): half a gap is skipped
    assert skipped_share(750, 1000, True) == pytest.approx(0.5)
    assert seek_threshold(750, 1000, True) == int(np.ceil(2 * SEEK_COST_FRAMES))
    # without skipping (AV1, VP9, or skip_nonref off) B-frames cost like the others
    assert seek_threshold(750, 1000, False) == int(np.ceil(SEEK_COST_FRAMES))


def test_the_plan_counts_gaps_seeks_and_frames():
    pts = np.arange(240) * 10                  # 240 frames, a keyframe every 48
    keys = pts[::48]
    one_fps = [pts[i] for i in range(0, 240, 24)]   # two samples a GOP: the second's gap is 23 frames
    dense = plan_decode(pts, keys, [one_fps], seek_frames=10**6)
    assert (dense.strategy, dense.gaps, dense.seeks) == ("intervals", 4, 0)
    assert dense.frames == dense.straight_frames == 216 + 1   # frame 0 through frame 216
    sparse = plan_decode(pts, keys, [one_fps], seek_frames=8)
    assert (sparse.strategy, sparse.seeks) == ("seeking", 4)
    assert sparse.frames == dense.frames - 4 * 23              # each seek skips a 23-frame gap
    assert (sparse.gop_frames, sparse.sample_gap_frames) == (48.0, 24.0)
    four_fps = [pts[i] for i in range(0, 240, 6)]              # gaps of 5 frames: below 8, never seek
    assert plan_decode(pts, keys, [four_fps], seek_frames=8).strategy == "intervals"
    # gaps of 23, 35 and 71 frames: a threshold of 30 seeks past the last two only
    uneven = [pts[i] for i in (0, 24, 60, 120, 216)]
    assert plan_decode(pts, keys, [uneven], seek_frames=30).strategy == "mixed"


def test_auto_is_chosen_from_the_video_and_bad_values_are_refused(videos):
    index = scan(str(videos["h264_bframes_open_gop"]["path"]))
    assert index.reordered > 0
    assert resolve_seek_frames("auto", index, True) == seek_threshold(index.reordered, index.n_frames, True)
    assert resolve_seek_frames(7, index, True) == 7
    for bad in (-1, "often", 2.5, True):
        with pytest.raises(ValueError, match="seek_frames"):
            resolve_seek_frames(bad, index, True)
    assert scan(str(videos["h264_closed_gop"]["path"])).reordered == 0      # encoded without B-frames


@pytest.mark.parametrize("case", ["h264_closed_gop", "h264_bframes_open_gop", "hevc"])
@pytest.mark.parametrize("threshold", [0, 8, 10**6])
def test_the_decoder_seeks_where_the_plan_says(case, threshold, videos):
    """decode_task and plan_decode make the same choice at every gap: the seeks the plan predicts,
    plus one to start each interval that does not start at the stream's first frame."""
    path = str(videos[case]["path"])
    index = scan(path)
    targets = index.pts[::9]
    tasks = plan_tasks(keyframe_intervals(index, 2), targets)
    plan = plan_decode(index.pts, index.keyframes, [t.targets for t in tasks], threshold)
    seeks = 0
    for task in tasks:
        shape = (len(targets), 3, 16, 16)
        with SharedFrames(shape) as out:
            result = decode_task(path, index, task, out.path, shape, seek_frames=threshold)
        assert result.done == task.targets
        seeks += result.seeks - (task.start != index.start_pts)
    assert seeks == plan.seeks


def test_the_plan_reaches_the_run_metrics(videos):
    path = str(videos["h264_closed_gop"]["path"])
    info = []
    with DecoderPool(1) as pool:
        list(quickcodec_groups(path, pool, fps=1, size=32, on_info=info.append))
    plan = info[0].metrics()["video"]["plan"]
    assert plan["seek_frames"] == seek_threshold(0, scan(path).n_frames, True)
    assert plan["strategy"] in ("intervals", "seeking", "mixed") and plan["decoded_frames"] > 0
    assert set(plan) >= {"gop_frames", "sample_gap_frames", "gaps", "seeks", "frames", "straight_frames", "seeks_made"}
