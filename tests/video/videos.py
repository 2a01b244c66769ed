"""Generator of small test videos covering the cases a video decoder must get right.

Every frame is different (moving shapes + a binary frame counter), so a decoder
that returns the wrong frame produces different bytes. ``read_counter`` recovers
the frame index from decoded pixels, which lets decoder tests check *which*
frame came back, not only how many.

Usage::

    facts = make_video("h264_bframes_open_gop", tmp_path)
    container = av.open(facts["path"])

Run the self-test explicitly (the file name is not ``test_*.py``)::

    python -m pytest tests/video/videos.py -q
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import deque
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch

W, H = 160, 120  # multiples of 8/16: every encoder here accepts them as-is
FPS = 24
N_FRAMES = 72  # 3 s at 24 fps
AUDIO_RATE = 48000

# Frame counter: COUNTER_BITS cells of COUNTER_CELL px along the bottom edge,
# large enough to survive lossy coding at any sane quality.
COUNTER_BITS = 10
COUNTER_CELL = W // COUNTER_BITS
COUNTER_TOP = H - COUNTER_CELL

CASES: dict[str, dict] = {
    "h264_bframes_open_gop": {
        "container": "mp4", "codec": "h264",
        "exercises": "B-frame reordering (bf=3, b-pyramid: decode order != presentation order) and "
                     "open GOP: keyframes after the first are non-IDR I-frames whose leading B-frames "
                     "reference the previous GOP, so seeking to them must drop/handle leading frames.",
    },
    "h264_closed_gop": {
        "container": "mp4", "codec": "h264",
        "exercises": "Plain IPPP stream, IDR every 12 frames, no B-frames: the baseline every "
                     "keyframe-seek must be exact on.",
    },
    "hevc": {
        "container": "mp4", "codec": "hevc",
        "exercises": "HEVC decode path with B-frames (bframes=2) and a keyframe every 24 frames.",
    },
    "vp9_webm": {
        "container": "webm", "codec": "vp9",
        "exercises": "VP9 decode path in WebM: no frame count in the header (stream.frames == 0), "
                     "keyframe every 24 frames.",
    },
    "av1_mkv": {
        "container": "matroska", "codec": "av1",
        "exercises": "AV1 (SVT-AV1, hierarchical mini-GOP) in Matroska, decoded with libdav1d; no frame "
                     "count in the header. Packets arrive in presentation order: AV1 reorders "
                     "through hidden frames and show_existing_frame instead.",
    },
    "mpegts_offset": {
        "container": "mpegts", "codec": "h264",
        "exercises": "MPEG-TS whose first video pts is ~10 s, not 0: timestamps must not be assumed "
                     "to start at zero; TS has no index and no frame count.",
    },
    "vfr": {
        "container": "mp4", "codec": "h264",
        "exercises": "Variable frame rate: durations cycle 1/30, 1/15, 1/10 s (time_base 1/1000), so "
                     "index <-> time must come from pts, not from a nominal fps.",
    },
    "audio_interleaved": {
        "container": "mp4", "codec": "h264",
        "exercises": "H.264 + AAC sine track with packets interleaved: the demuxer must skip audio "
                     "packets and not lose video ones.",
    },
    "single_keyframe": {
        "container": "mp4", "codec": "h264",
        "exercises": "Exactly one keyframe (IDR at frame 0): any seek must decode from the start.",
    },
    "rotated": {
        "container": "mp4", "codec": "h264",
        "exercises": "Display-matrix rotation of 90 degrees (counter-clockwise, as FFmpeg's "
                     "VideoFrame.rotation reports it; the legacy 'rotate' tag would read 270). The "
                     "coded frames are 160x120, displayed 120x160.",
    },
    "mkv_h264": {
        "container": "matroska", "codec": "h264",
        "exercises": "H.264 in Matroska: no frame count in the header (stream.frames == 0), "
                     "B-frames, mkv's 1 ms time base.",
    },
}

_SUFFIX = {"mp4": ".mp4", "webm": ".webm", "matroska": ".mkv", "mpegts": ".ts"}


# --------------------------------------------------------------------------- content

def frame_rgb(i: int) -> np.ndarray:
    """Deterministic H x W x 3 uint8 picture for frame ``i``; differs in every frame."""
    y, x = np.mgrid[0:H, 0:W]
    img = np.empty((H, W, 3), np.uint8)
    # Scrolling gradient background: every pixel changes between frames.
    img[..., 0] = (x * 2 + i * 3) % 256
    img[..., 1] = (y * 2 + i * 5) % 256
    img[..., 2] = (x + y + i * 7) % 256
    area = slice(0, COUNTER_TOP - 4)  # keep shapes clear of the counter strip
    # Red square moving right, green disc moving down, blue bar moving left.
    sx = (i * 4) % (W - 24)
    img[10:34, sx:sx + 24] = (230, 30, 30)
    cy, cx = 12 + (i * 3) % (COUNTER_TOP - 28), 100
    disc = (y - cy) ** 2 + (x - cx) ** 2 <= 10 ** 2
    img[area][disc[area]] = (30, 220, 30)
    bx = W - 8 - (i * 5) % (W - 8)
    img[40:COUNTER_TOP - 4, bx:bx + 8] = (30, 30, 230)
    # Binary frame counter, LSB first, white = 1.
    for b in range(COUNTER_BITS):
        img[COUNTER_TOP:, b * COUNTER_CELL:(b + 1) * COUNTER_CELL] = 255 if (i >> b) & 1 else 0
    return img


def read_counter(rgb: np.ndarray) -> int:
    """Frame index encoded by ``frame_rgb`` (works on lossy-decoded, unrotated frames)."""
    c = COUNTER_CELL // 2
    cells = rgb[COUNTER_TOP + c, c::COUNTER_CELL][:COUNTER_BITS].astype(int).mean(axis=1)
    return sum(1 << b for b, v in enumerate(cells) if v > 128)


def _audio_frames(seconds: float):
    """1024-sample mono fltp frames of a 440 Hz sine covering ``seconds``."""
    n_total = int(seconds * AUDIO_RATE)
    for start in range(0, n_total, 1024):
        t = np.arange(start, start + 1024) / AUDIO_RATE
        samples = (0.3 * np.sin(2 * math.pi * 440 * t)).astype(np.float32)[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = AUDIO_RATE
        frame.pts = start
        frame.time_base = Fraction(1, AUDIO_RATE)
        yield frame


# --------------------------------------------------------------------------- encoding

def _encode(path: Path, fmt: str, codec: str, *, options: dict[str, str] | None = None,
            pts: list[int] | None = None, time_base: Fraction = Fraction(1, FPS),
            gop_size: int | None = None, rotation: int = 0, audio: bool = False) -> dict:
    """Encode N_FRAMES of ``frame_rgb`` into ``path``; return encoder-side facts."""
    # SVT-AV1, run as root, leaves the thread that encodes under SCHED_FIFO 99: everything this
    # process starts afterwards would inherit it (and livelock; graph.workers.leave_realtime_scheduling)
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        return _encode_frames(path, fmt, codec, options=options, pts=pts, time_base=time_base,
                              gop_size=gop_size, rotation=rotation, audio=audio)
    finally:
        if (os.sched_getscheduler(0), os.sched_getparam(0)) != (policy, param):
            os.sched_setscheduler(0, policy, param)


# PyAV writes a display matrix (set_display_rotation) from version 16; lmms-eval's extra installs
# PyAV 15, which cannot. There the rotated case is this file, written by this function with PyAV 16+
# (write_rotated_fixture), and its encoder-side facts beside it.
ROTATED_FIXTURE = Path(__file__).resolve().parent / "data" / "rotated-h264.mp4"


def _can_write_rotation() -> bool:
    return int(av.__version__.split(".")[0]) >= 16


def write_rotated_fixture() -> None:
    """Rewrite ROTATED_FIXTURE (and its facts) with this PyAV: `python -c "from tests.video.videos
    import write_rotated_fixture; write_rotated_fixture()"` (needs PyAV 16+)."""
    assert _can_write_rotation(), "writing a display matrix needs PyAV 16+"
    ROTATED_FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    facts = _BUILD["rotated"](ROTATED_FIXTURE)
    ROTATED_FIXTURE.with_suffix(".json").write_text(json.dumps(facts) + "\n")


def _encode_frames(path: Path, fmt: str, codec: str, *, options: dict[str, str] | None,
                   pts: list[int] | None, time_base: Fraction, gop_size: int | None, rotation: int,
                   audio: bool) -> dict:
    if rotation and not _can_write_rotation():
        assert rotation == 90 and fmt == "mp4" and not audio, "only the rotated case is shipped"
        shutil.copyfile(ROTATED_FIXTURE, path)
        return json.loads(ROTATED_FIXTURE.with_suffix(".json").read_text())
    pts = pts if pts is not None else list(range(N_FRAMES))
    keyframes = 0
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its banner to stderr otherwise
    with av.open(str(path), "w", format=fmt) as out:
        vs = out.add_stream(codec, rate=FPS)
        vs.width, vs.height, vs.pix_fmt = W, H, "yuv420p"
        vs.codec_context.time_base = time_base
        if time_base != Fraction(1, FPS):
            vs.time_base = time_base  # VFR: keep the exact ms timestamps in the container
        if gop_size is not None:
            vs.codec_context.gop_size = gop_size
        vs.options = dict(options or {})
        if rotation:
            vs.set_display_rotation(rotation)  # must precede the first encode
        aus = out.add_stream("aac", rate=AUDIO_RATE, layout="mono") if audio else None
        audio_frames = deque(_audio_frames(float((pts[-1] + 1) * time_base)) if audio else ())

        def mux(packets):
            nonlocal keyframes
            for p in packets:
                keyframes += p.stream is vs and p.is_keyframe
            out.mux(packets)

        for i, t in enumerate(pts):
            frame = av.VideoFrame.from_ndarray(frame_rgb(i), format="rgb24")
            frame.pts, frame.time_base = t, time_base
            mux(vs.encode(frame))
            # Feed audio up to the current video time so both streams advance together.
            while audio_frames and audio_frames[0].pts / AUDIO_RATE <= float(t * time_base):
                mux(aus.encode(audio_frames.popleft()))
        mux(vs.encode(None))
        if aus is not None:
            for af in audio_frames:
                mux(aus.encode(af))
            mux(aus.encode(None))
    return {"n_frames": len(pts), "keyframes": keyframes, "has_audio": audio}


def _scan(path: Path) -> dict:
    """Read back what the container really holds (demux only, video stream)."""
    with av.open(str(path)) as c:
        vs = c.streams.video[0]
        tb = vs.time_base
        packets = [p for p in c.demux(vs) if p.pts is not None]
        rotation = 0
        for p in packets:  # rotation is only readable on decoded frames in PyAV
            frames = vs.decode(p)
            if frames:
                rotation = frames[0].rotation
                break
    first_pts = min(p.pts for p in packets)
    pts_in_decode_order = [p.pts for p in packets]
    return {
        "start_pts_s": float(first_pts * tb),
        "reordered": pts_in_decode_order != sorted(pts_in_decode_order),
        "rotation": rotation,
        "packets": packets,
    }


def _h264_nal_types(data: bytes) -> set[int]:
    """NAL unit types of an AVCC (4-byte length-prefixed, as x264 writes in mp4) packet."""
    types, pos = set(), 0
    while pos + 4 < len(data):
        size = int.from_bytes(data[pos:pos + 4], "big")
        types.add(data[pos + 4] & 0x1F)
        pos += 4 + size
    return types


_X264 = "keyint={k}:min-keyint={k}:scenecut=0"
_BUILD = {
    "h264_bframes_open_gop": lambda p: _encode(p, "mp4", "libx264", options={
        "preset": "veryfast",
        "x264-params": "open-gop=1:keyint=24:min-keyint=24:scenecut=0:bframes=3:b-pyramid=normal"}),
    "h264_closed_gop": lambda p: _encode(p, "mp4", "libx264", options={
        "preset": "veryfast", "x264-params": _X264.format(k=12) + ":bframes=0"}),
    "hevc": lambda p: _encode(p, "mp4", "libx265", options={
        "preset": "ultrafast",
        "x265-params": "keyint=24:min-keyint=24:scenecut=0:bframes=2:log-level=none"}),
    # Constant-quality mode; the bundled libvpx emits no alt-ref (hidden) frames whatever
    # lag-in-frames/auto-alt-ref say (likely a realtime-only build), so none are asked for.
    "vp9_webm": lambda p: _encode(p, "webm", "libvpx-vp9", gop_size=24, options={
        "deadline": "good", "cpu-used": "8", "crf": "32", "b": "0"}),
    # Temporal filtering blurs the counter cells between frames at any crf; turn it off.
    "av1_mkv": lambda p: _encode(p, "matroska", "libsvtav1", gop_size=24, options={
        "preset": "10", "crf": "18", "svtav1-params": "enable-tf=0"}),
    # 10 s offset in frame units of the 1/24 time base.
    "mpegts_offset": lambda p: _encode(p, "mpegts", "libx264", pts=[10 * FPS + i for i in range(N_FRAMES)],
                                       options={"preset": "veryfast", "x264-params": _X264.format(k=24)}),
    # Durations cycle 33, 67, 100 ms; no B-frames so only the timestamps are irregular.
    "vfr": lambda p: _encode(p, "mp4", "libx264", time_base=Fraction(1, 1000), pts=_vfr_pts(),
                             options={"preset": "veryfast", "x264-params": _X264.format(k=24) + ":bframes=0"}),
    "audio_interleaved": lambda p: _encode(p, "mp4", "libx264", audio=True, options={
        "preset": "veryfast", "x264-params": _X264.format(k=24)}),
    "single_keyframe": lambda p: _encode(p, "mp4", "libx264", options={
        "preset": "veryfast", "x264-params": _X264.format(k=10 * N_FRAMES)}),
    "rotated": lambda p: _encode(p, "mp4", "libx264", rotation=90, options={
        "preset": "veryfast", "x264-params": _X264.format(k=24)}),
    "mkv_h264": lambda p: _encode(p, "matroska", "libx264", options={
        "preset": "veryfast", "x264-params": _X264.format(k=24)}),
}


def _vfr_pts() -> list[int]:
    durations = [33, 67, 100]
    pts, t = [], 0
    for i in range(N_FRAMES):
        pts.append(t)
        t += durations[i % 3]
    return pts


def make_video(case: str, path: Path) -> dict:
    """Write the video for ``case`` and return its facts.

    ``path`` is a directory (file named after the case) or a file prefix (suffix added).
    """
    spec = CASES[case]
    path = Path(path)
    base = path / case if path.is_dir() else path
    out = base.with_name(base.name + _SUFFIX[spec["container"]])
    out.parent.mkdir(parents=True, exist_ok=True)

    enc = _BUILD[case](out)
    scan = _scan(out)
    facts = {
        "path": out,
        "codec": spec["codec"],
        "container": spec["container"],
        "n_frames": enc["n_frames"],
        "keyframes": enc["keyframes"],  # counted at the encoder, before muxing
        "has_audio": enc["has_audio"],
        "start_pts_s": scan["start_pts_s"],  # as the container holds it
        "vfr": case == "vfr",
        "rotation": scan["rotation"],  # read back, 0 if the muxer dropped it
        "reordered": scan["reordered"],  # some packet's decode order != presentation order
        "width": W, "height": H,
    }
    if case == "vfr":
        facts["pts_s"] = [t / 1000 for t in _vfr_pts()]

    # Guard the properties each case exists for, so a silent encoder change is caught here.
    if case == "h264_bframes_open_gop":
        assert scan["reordered"], "no B-frame reordering in the open-GOP case"
        key_nals = [_h264_nal_types(bytes(p)) for p in scan["packets"] if p.is_keyframe]
        facts["open_gop_keyframes"] = sum(5 not in t for t in key_nals)  # I but not IDR
        assert facts["open_gop_keyframes"] > 0, "open GOP produced only IDR keyframes"
    if case == "single_keyframe":
        assert facts["keyframes"] == 1
    if case == "h264_closed_gop":
        assert facts["keyframes"] == math.ceil(N_FRAMES / 12) and not scan["reordered"]
    if case == "rotated":
        assert facts["rotation"] == 90, f"rotation read back as {facts['rotation']}"
    return facts


# --------------------------------------------------------------------------- several streams

def preview_rgb(i: int) -> np.ndarray:
    """Frame ``i`` of the preview track: half size and inverted, so no byte matches the main one."""
    return np.ascontiguousarray(255 - frame_rgb(i)[::2, ::2])


def make_two_video_streams(path: Path) -> dict:
    """An mp4 whose first stream is a small preview video, then an audio track, then the main
    video (flagged default): FFmpeg's best video stream is the last, not the first.

    ``path`` is a directory (file ``two_video_streams.mp4``) or a file prefix (``.mp4`` added).
    """
    path = Path(path)
    out_path = path / "two_video_streams.mp4" if path.is_dir() else path.with_name(path.name + ".mp4")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(out_path), "w", format="mp4") as out:
        preview = out.add_stream("libx264", rate=FPS)
        preview.width, preview.height, preview.pix_fmt = W // 2, H // 2, "yuv420p"
        preview.options = {"preset": "veryfast", "x264-params": _X264.format(k=12) + ":bframes=0"}
        audio = out.add_stream("aac", rate=AUDIO_RATE, layout="mono")
        main = out.add_stream("libx264", rate=FPS)
        main.width, main.height, main.pix_fmt = W, H, "yuv420p"
        main.options = {"preset": "veryfast", "x264-params": _X264.format(k=24) + ":bframes=2"}
        # mp4 flags the first track of a kind as default unless told otherwise; FFmpeg's choice
        # of the best stream prefers the default one
        main.disposition = av.stream.Disposition.default.value    # an int: PyAV 15 takes no Flag here
        for i in range(N_FRAMES):
            for stream, rgb in ((preview, preview_rgb(i)), (main, frame_rgb(i))):
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts = i
                out.mux(stream.encode(frame))
        for af in _audio_frames(N_FRAMES / FPS):
            out.mux(audio.encode(af))
        for stream in (preview, audio, main):
            out.mux(stream.encode(None))
    facts = {"path": out_path, "n_frames": N_FRAMES, "preview": 0, "audio": 1, "main": 2,
             "sizes": {0: (H // 2, W // 2), 2: (H, W)}}
    with av.open(str(out_path)) as c:
        assert [s.type for s in c.streams] == ["video", "audio", "video"]
        assert c.streams.best("video").index == facts["main"], "FFmpeg's best video stream is not the main one"
    return facts


# --------------------------------------------------------------------------- self-test

def test_every_case_generates_and_decodes(tmp_path):
    for case in CASES:
        facts = make_video(case, tmp_path)
        with av.open(str(facts["path"])) as c:
            assert len(c.streams.video) == 1, case
            assert (len(c.streams.audio) == 1) == facts["has_audio"], case
            vs = c.streams.video[0]
            if facts["container"] in ("webm", "matroska", "mpegts"):
                assert vs.frames == 0, f"{case}: container unexpectedly has a frame count"
            keyframes = sum(p.is_keyframe for p in c.demux(vs) if p.pts is not None)
            assert keyframes == facts["keyframes"], (case, keyframes, facts["keyframes"])

        with av.open(str(facts["path"])) as c:
            frames = list(c.decode(video=0))
        pts = [f.time for f in frames]
        assert len(frames) == facts["n_frames"], (case, len(frames))
        assert all(a < b for a, b in zip(pts, pts[1:])), f"{case}: pts not increasing"
        assert abs(pts[0] - facts["start_pts_s"]) < 1e-6, case
        # The right picture in the right order: counter reads back 0..n-1.
        assert [read_counter(f.to_ndarray(format="rgb24")) for f in frames] == \
            list(range(facts["n_frames"])), case
        if case == "mpegts_offset":
            assert facts["start_pts_s"] > 0.5
        if case == "vfr":
            assert np.allclose(np.array(pts) - pts[0], facts["pts_s"], atol=1e-3)
        if case == "rotated":
            assert frames[0].rotation == 90


def test_two_video_streams_generate_and_decode(tmp_path):
    facts = make_two_video_streams(tmp_path)
    with av.open(str(facts["path"])) as c:
        main = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams[facts["main"]])]
    with av.open(str(facts["path"])) as c:
        preview = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams[facts["preview"]])]
    assert len(main) == len(preview) == facts["n_frames"]
    assert main[0].shape == (H, W, 3) and preview[0].shape == (H // 2, W // 2, 3)
    assert [read_counter(f) for f in main] == list(range(facts["n_frames"]))


# ------------------------------------------------------------------ reference decodes

def reference(path, **sel):
    """The selection `sel` as sequential single-threaded PyAV decodes it: (uint8 [n, 3, H, W], seconds [n])."""
    from stages.decode import PyAVDecoder
    from video.quickcodec import Selection

    s = Selection(str(path), sel.get("fps"), sel.get("seconds"), sel.get("num_frames"), sel.get("size"), 0,
                   sel.get("stream"))
    frames, lost = PyAVDecoder(fps=None, size=None).decode(s)
    assert not lost
    return frames, torch.from_numpy(s.seconds)


def pyav_frames(path, stream: int) -> torch.Tensor:
    """Every frame of `container.streams[stream]` as PyAV alone decodes it: uint8 [n, 3, H, W]."""
    with av.open(str(path)) as c:
        rgb = [f.to_ndarray(format="rgb24") for f in c.decode(c.streams[stream])]
    return torch.from_numpy(np.stack(rgb)).permute(0, 3, 1, 2)
