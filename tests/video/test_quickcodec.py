"""QuickCodec as a library: byte-identical to PyAV's sequential decode on every kind of video;
streaming equals one-shot; the stream FFmpeg would choose by default; bad input is a clear error
with nothing left behind; callers need no __main__ guard."""


import _thread
import os
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from stages.decode import PyAVDecoder
from tests.video.videos import CASES, make_video, pyav_frames, read_counter, reference
from video.codec import (
    SharedFrames,
    StreamIndex,
    VideoError,
    decode_task,
    keyframe_intervals,
    plan_tasks,
    scan,
)
from video.quickcodec import DecoderPool, Selection, quickcodec_groups, read_video

SELECTIONS = {
    "every_frame": dict(size=None),
    "fps5_resized": dict(fps=5, size=(64, 80)),
    "num_frames7": dict(num_frames=7, size=48),
    "seconds": dict(seconds=[0.0, 0.51, 1.0, 2.9], size=None),
}




def test_encoding_the_av1_clip_leaves_the_scheduling_policy_as_it_was(tmp_path):
    # SVT-AV1 as root switches the encoding thread to SCHED_FIFO 99; the generator puts it back
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    make_video("av1_mkv", tmp_path / "av1")
    assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before


@pytest.fixture(scope="module")
def pool():
    with DecoderPool(2) as p:
        yield p


def quick(path, pool, group_frames=0, intervals=8, **sel):
    groups = list(quickcodec_groups(str(path), pool, group_frames=group_frames, intervals=intervals, **sel))
    return torch.cat([g.frames for g in groups]), torch.cat([g.seconds for g in groups]), groups


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize("case", CASES)
def test_quickcodec_is_byte_identical_to_sequential_pyav(case, selection, videos, pool):
    path = videos[case]["path"]
    want, want_s = reference(path, **SELECTIONS[selection])
    got, got_s, _ = quick(path, pool, **SELECTIONS[selection])
    assert got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(got_s, want_s)
    assert torch.equal(got, want), f"{case}/{selection}: frames differ from PyAV's sequential decode"


@pytest.mark.parametrize("case", ["h264_bframes_open_gop", "hevc", "vfr", "mpegts_offset"])
def test_streaming_groups_equal_one_shot(case, videos, pool):
    path = videos[case]["path"]
    one, one_s, _ = quick(path, pool, size=None)
    streamed, streamed_s, groups = quick(path, pool, size=None, group_frames=5, intervals=0)
    assert torch.equal(one, streamed) and torch.equal(one_s, streamed_s)
    assert [g.index for g in groups] == list(range(len(groups))) and groups[-1].last
    assert all(len(g.frames) == 5 for g in groups[:-1])


@pytest.mark.parametrize("case", CASES)
def test_the_right_frames_come_back(case, videos, pool):
    """Decoded frames carry their frame number: fps=8 on a 24 fps video picks every third."""
    facts = videos[case]
    frames, seconds, _ = quick(facts["path"], pool, fps=8 if case != "vfr" else 2, size=None)
    if case == "vfr":  # the frame on screen at t: the last one stamped at or before t
        pts_s = np.asarray(facts["pts_s"]) - facts["pts_s"][0]
        expect = [int(np.searchsorted(pts_s, t + 1e-6, side="right") - 1) for t in np.arange(len(frames)) / 2]
    elif case == "rotated":
        expect = None      # the counter sits on the stored (unrotated) picture: not readable here
    else:   # every third frame as PyAV shows it: its counter, unless the encoder repeated a picture
        shown = [read_counter(f.permute(1, 2, 0).numpy()) for f in pyav_frames(facts["path"], 0)]
        expect = shown[::3]
        assert sum(c != i for i, c in enumerate(shown)) <= 3, "the encoder lost the frame counters"
    got = [read_counter(f.permute(1, 2, 0).numpy()) for f in frames]
    if expect is not None:
        assert got == expect
    assert seconds[0] == 0.0  # relative to the stream's first pts, whatever it is (10 s in the TS case)


def test_selection_by_timestamp_on_offset_and_vfr(videos):
    ts = scan(videos["mpegts_offset"]["path"])
    assert float(ts.start_pts * ts.time_base) == pytest.approx(10.0, abs=0.01)
    vfr = scan(videos["vfr"]["path"])
    assert vfr.n_frames == videos["vfr"]["n_frames"]  # counted from packets, not the header


def test_keyframe_intervals_follow_the_seed():
    index = StreamIndex("x", 0, Fraction(1, 1000), np.arange(0, 10000, 100), np.array([0, 2000, 2900, 5000, 7600]),
                        1, 1, "h264")
    assert keyframe_intervals(index, 4) == [(0, 2900), (2900, 5000), (5000, 7600), (7600, 9901)]
    assert keyframe_intervals(index, 1) == [(0, 9901)]
    assert keyframe_intervals(index, 50) == [(0, 2000), (2000, 2900), (2900, 5000), (5000, 7600), (7600, 9901)]
    tasks = plan_tasks(keyframe_intervals(index, 2), np.array([0, 0, 4900, 5000, 9900]))
    assert [(t.start, t.targets, t.slots) for t in tasks] == [(0, [0, 4900], [[0, 1], [2]]), (5000, [5000, 9900], [[3], [4]])]


def test_sparse_sampling_seeks_instead_of_decoding_everything(videos, tmp_path):
    path = str(videos["h264_closed_gop"]["path"])  # keyframe every 12 frames
    index = scan(path)
    targets = [int(index.pts[i]) for i in (1, 30, 61)]
    task = plan_tasks([(index.start_pts, int(index.pts[-1]) + 1)], np.array(targets))[0]
    shape = (3, 3, index.height, index.width)
    with SharedFrames(shape) as out:
        dense = decode_task(path, index, task, out.path, shape, seek_frames=10**9)
        dense_frames = out.array.copy()
        sparse = decode_task(path, index, task, out.path, shape, seek_frames=4)
        assert np.array_equal(out.array, dense_frames)
    assert dense.seeks == 0 and dense.decoded >= 62
    assert sparse.seeks == 2 and sparse.decoded < 20 and sparse.done == targets


@pytest.mark.parametrize("case", ["h264_bframes_open_gop", "hevc"])
def test_unselected_nonreference_frames_are_not_decoded(case, videos):
    path = str(videos[case]["path"])
    index = scan(path)
    targets = index.pts[::6]
    task = plan_tasks([(index.start_pts, int(index.pts[-1]) + 1)], targets)[0]
    shape = (len(targets), 3, index.height, index.width)
    with SharedFrames(shape) as out:
        full = decode_task(path, index, task, out.path, shape, seek_frames=10**9, skip_nonref=False)
        want = out.array.copy()
        out.array[:] = 0
        lean = decode_task(path, index, task, out.path, shape, seek_frames=10**9, skip_nonref=True)
        assert np.array_equal(out.array, want)
    assert lean.done == full.done == targets.tolist()
    assert lean.decoded < full.decoded


# ------------------------------------------------------------------ bad input


def test_missing_file():
    with pytest.raises(VideoError, match="nope.mp4: no such file"):
        read_video("/tmp/nope.mp4", fps=1)


def test_not_a_video(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_text("this is not a video\n" * 100)
    with pytest.raises(VideoError, match="notes.mp4: not a video file FFmpeg can read"):
        read_video(bad, fps=1)


def test_no_video_stream(tmp_path):
    path = tmp_path / "audio.m4a"
    with av.open(str(path), "w") as c:
        s = c.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 16000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(VideoError, match=r"audio.m4a: has no video stream \(streams: audio\)"):
        read_video(path, fps=1)


def test_truncated_file_decodes_what_is_there_and_says_what_was_lost(videos, tmp_path, caplog):
    src = Path(videos["mkv_h264"]["path"]).read_bytes()
    cut = tmp_path / "cut.mkv"
    cut.write_bytes(src[: len(src) * 6 // 10])
    frames, seconds = read_video(cut, size=None, workers=2)
    assert 10 < len(frames) < videos["mkv_h264"]["n_frames"]
    ref_sel = Selection(str(cut), None, None, None, None, 0)
    ref, lost = PyAVDecoder(fps=None, size=None).decode(ref_sel)
    keep = [i for i in range(ref_sel.n) if i not in lost]
    assert torch.equal(frames, ref[keep])


def test_corrupt_middle_decodes_without_hanging(videos, tmp_path):
    data = bytearray(Path(videos["h264_closed_gop"]["path"]).read_bytes())
    rng = np.random.default_rng(1)
    mid = len(data) // 2
    data[mid:mid + 1500] = rng.integers(0, 256, 1500, dtype=np.uint8).tobytes()
    bad = tmp_path / "corrupt.mp4"
    bad.write_bytes(bytes(data))
    before = _reelflow_shm()
    frames, seconds = read_video(bad, size=None, workers=2)
    assert 0 < len(frames) <= videos["h264_closed_gop"]["n_frames"] and len(seconds) == len(frames)
    assert _reelflow_shm() == before


def test_fps_above_the_videos_own(videos):
    with pytest.raises(VideoError, match=r"fps=60 is above the video's own 24 fps"):
        read_video(videos["h264_closed_gop"]["path"], fps=60)


@pytest.mark.parametrize("size", [0, -4, (0, 10), (10, -1)])
def test_size_must_be_positive(size, videos):
    with pytest.raises(VideoError, match="height and width must be positive"):
        read_video(videos["h264_closed_gop"]["path"], fps=1, size=size)


def _reelflow_shm():
    return {f for f in os.listdir("/dev/shm") if f.startswith("reelflow-")}


def test_shared_memory_is_private_and_unlinked():
    with SharedFrames((2, 3, 4, 4)) as shm:
        assert os.stat(shm.path).st_mode & 0o777 == 0o600
        view = torch.from_numpy(shm.array)
    view.fill_(7)  # the mapping outlives the name
    assert not Path(shm.path).exists() and int(view.sum()) == 7 * 96


@pytest.fixture(scope="module")
def slow_video(tmp_path_factory):
    """Big enough that decoding takes a few seconds: room to kill or interrupt mid-decode."""
    path = tmp_path_factory.mktemp("slow") / "slow.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=30)
        s.width, s.height, s.pix_fmt = 640, 480, "yuv420p"
        s.options = {"preset": "ultrafast", "x264-params": "keyint=30:scenecut=0"}
        base = rng.integers(0, 255, (480, 640, 3), dtype=np.uint8)
        for i in range(600):
            for p in s.encode(av.VideoFrame.from_ndarray(np.roll(base, 7 * i, axis=1), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def test_a_decoder_process_that_dies(slow_video):
    before = _reelflow_shm()
    pool = DecoderPool(2)
    pool.warm()
    pids = pool.pids()
    killer = threading.Timer(0.5, lambda: [os.kill(p, 9) for p in pids])
    killer.start()
    with pytest.raises(VideoError, match=r"slow.mp4: a decoder process died while decoding .* s \(SIGKILL: out of mem"):
        list(quickcodec_groups(str(slow_video), pool, size=None))
    pool.shutdown()
    assert _reelflow_shm() == before


def test_ctrl_c_during_decode_leaves_nothing(slow_video, ctrl_c):
    import multiprocessing

    before, children = _reelflow_shm(), set(multiprocessing.active_children())
    threading.Timer(0.8, _thread.interrupt_main).start()
    with pytest.raises(KeyboardInterrupt):
        read_video(slow_video, size=None, workers=2)
        time.sleep(5)  # (only reached if the decode beat the timer)
    time.sleep(0.2)
    assert _reelflow_shm() == before
    assert set(multiprocessing.active_children()) <= children, "decoder processes left behind"


# ------------------------------------------------------------------ from any caller

REPO = Path(__file__).resolve().parents[2]

CALLER_SCRIPT = """\
from stages.decode import read_video
frames, seconds = read_video({video!r}, fps=4, workers=2)
print(tuple(frames.shape), len(seconds))
"""


@pytest.mark.parametrize("caller", ["script", "module", "-c", "stdin", "interactive"])
def test_read_video_from_a_plain_unguarded_caller(caller, videos, tmp_path):
    """No `if __name__ == "__main__":` guard needed: decoder processes never run the caller's
    __main__ (a spawned child re-running this script would call read_video again, and die)."""
    code = CALLER_SCRIPT.format(video=str(videos["h264_closed_gop"]["path"]))
    script = tmp_path / "my_script.py"
    script.write_text(code)
    command, stdin = {"script": ([sys.executable, str(script)], None),
                      "module": ([sys.executable, "-m", "my_script"], None),
                      "-c": ([sys.executable, "-c", code], None),
                      "stdin": ([sys.executable, "-"], code),            # __main__.__file__ is "<stdin>"
                      "interactive": ([sys.executable, "-i"], code)}[caller]  # no __file__ at all
    # the worktree's packages first (an installed reelflow may point elsewhere); tmp_path for -m
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])}
    run = subprocess.run(command, cwd=REPO, env=env, input=stdin, capture_output=True, text=True, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(12, 3, 120, 160) 12" in run.stdout.splitlines(), run.stderr[-3000:]  # 3 s at 4 fps, native size


def test_starting_decoder_processes_leaves_main_as_it_was():
    main = vars(sys.modules["__main__"])
    before = {name: main.get(name, "absent") for name in ("__file__", "__spec__")}
    with DecoderPool(1) as pool:
        pool.warm()
    assert {name: main.get(name, "absent") for name in ("__file__", "__spec__")} == before


# ------------------------------------------------------------------ as stages in a graph


# ------------------------------------------------------------------ which video stream






@pytest.mark.parametrize("stream", [None, 0, 2])
def test_read_video_decodes_ffmpegs_best_video_stream_unless_told(stream, two_streams):
    want = pyav_frames(two_streams["path"], two_streams["main"] if stream is None else stream)
    frames, seconds = read_video(two_streams["path"], size=None, workers=2, stream=stream)
    assert frames.shape == want.shape and torch.equal(frames, want)
    assert len(seconds) == two_streams["n_frames"]


@pytest.mark.parametrize("selection", ["fps5_resized", "seconds"])
@pytest.mark.parametrize("stream", [None, 0])
def test_quickcodec_is_byte_identical_on_the_chosen_stream(stream, selection, two_streams, pool):
    path = two_streams["path"]
    want, want_s = reference(path, stream=stream, **SELECTIONS[selection])
    got, got_s, _ = quick(path, pool, stream=stream, **SELECTIONS[selection])
    assert torch.equal(got_s, want_s) and torch.equal(got, want)


@pytest.mark.parametrize(("stream", "reason"), [(1, "stream 1 is audio, not video"), (3, "has no stream 3"),
                                                (-1, "has no stream -1")])
def test_a_stream_that_is_not_a_video_stream(stream, reason, two_streams):
    with pytest.raises(VideoError, match=rf"two_video_streams.mp4: {reason} "
                                         r"\(its video streams: 0 \(80x60 h264\), 2 \(160x120 h264\)\)"):
        read_video(two_streams["path"], fps=1, stream=stream)


def test_decoder_workers_stay_light(videos, pool):
    """Workers import PyAV and numpy, never torch (a torch import costs each worker ~1 s)."""
    quick(videos["h264_closed_gop"]["path"], pool, fps=2, size=32)
    assert pool.get().submit(eval, "'torch' in __import__('sys').modules").result() is False
