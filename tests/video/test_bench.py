"""The benchmark video generator: a tiny version decodes, has the right frames and keyframes, is
cached, and moves."""

from __future__ import annotations

import logging

import av
import numpy as np
import pytest

from stages.source import BenchVideo
from stages.types import Request
from video.bench import bench_video_path, ensure_bench_video

MINUTES, W, H, FPS, GOP_S = 0.05, 320, 180, 24, 1.0      # 72 frames, a keyframe every 24


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return ensure_bench_video(MINUTES, width=W, height=H, fps=FPS, gop_s=GOP_S, seed=3,
                              cache_dir=tmp_path_factory.mktemp("videos"))


def test_decodes_with_the_asked_frames(video):
    with av.open(str(video)) as c:
        s = c.streams.video[0]
        assert (s.codec_context.name, s.width, s.height, s.average_rate) == ("h264", W, H, FPS)
        frames = [f.to_ndarray(format="gray") for f in c.decode(s)]
    assert len(frames) == round(MINUTES * 60 * FPS) == 72
    diffs = [np.abs(a.astype(int) - b).mean() for a, b in zip(frames, frames[1:])]
    assert min(diffs) > 0.5, "consecutive frames should differ (camera, objects, noise)"
    assert np.std(frames[0]) > 20, "the picture should have texture, not flat colour"


def test_keyframes_every_gop(video):
    with av.open(str(video)) as c:
        s = c.streams.video[0]
        packets = [p for p in c.demux(s) if p.pts is not None]
        frame_of = lambda p: round(p.pts * s.time_base * FPS)   # noqa: E731
        keys = sorted(frame_of(p) for p in packets if p.is_keyframe)
        order = [frame_of(p) for p in packets]
    assert keys == list(range(0, 72, round(GOP_S * FPS)))
    assert order != sorted(order), "x264's default B-frames: decode order differs from display order"


def test_second_call_reuses(video, caplog):
    mtime = video.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="video.bench"):
        again = ensure_bench_video(MINUTES, width=W, height=H, fps=FPS, gop_s=GOP_S, seed=3, cache_dir=video.parent)
    assert again == video and again.stat().st_mtime_ns == mtime
    assert "reusing" in caplog.text
    assert [p.name for p in video.parent.iterdir()] == [video.name], "no temporary files left behind"


def test_name_holds_every_parameter(tmp_path):
    base = dict(width=W, height=H, fps=FPS, gop_s=GOP_S, seed=3, cache_dir=tmp_path)
    names = {bench_video_path(MINUTES, **base).name}
    for change in (dict(width=640), dict(height=360), dict(fps=30), dict(gop_s=2.0), dict(seed=4)):
        names.add(bench_video_path(MINUTES, **{**base, **change}).name)
    names.add(bench_video_path(0.1, **base).name)
    assert len(names) == 7


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    assert bench_video_path(1.0).parent == tmp_path / "videos"


def test_bad_parameters(tmp_path):
    with pytest.raises(ValueError):
        ensure_bench_video(0, cache_dir=tmp_path)
    with pytest.raises(ValueError):
        ensure_bench_video(0.05, width=321, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_generation_leaves_nothing(tmp_path, monkeypatch):
    import video.bench as sv

    def broken(*args, **kwargs):
        yield np.zeros((H * 3 // 2, W), np.uint8)
        raise KeyboardInterrupt

    monkeypatch.setattr(sv, "render_frames", broken)
    with pytest.raises(KeyboardInterrupt):
        ensure_bench_video(MINUTES, width=W, height=H, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stage_emits_request(video, monkeypatch):
    monkeypatch.setattr("video.bench.cache_root", lambda cache_dir=None: video.parent)
    stage = BenchVideo(minutes=MINUTES, width=W, height=H, fps=FPS, gop_s=GOP_S, seed=3)
    stage.setup(None)
    out = stage(None)
    assert out == {"request": Request(id=f"bench-{MINUTES}min", video=str(video), prompt=None)}
    assert isinstance(out["request"], Request)
