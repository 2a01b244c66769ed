"""The one video writer: frames to an mp4 (H.264 or HEVC) with a keyframe exactly every `gop_s`
seconds, used by the toy world's videos and the synthetic benchmark videos.

Fixed GOPs (no scene-cut keyframes) make keyframe intervals, and so QuickCodec's work split,
predictable from the frame rate alone.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Iterable

import numpy as np

__all__ = ["encode_video", "ENCODERS"]

# codec name → (FFmpeg encoder, its private-options key)
ENCODERS = {"h264": ("libx264", "x264-params"), "hevc": ("libx265", "x265-params")}


def encode_video(frames: Iterable[np.ndarray], fps: float, out, *, crf: int = 18, gop_s: float = 2.0,
                 first_pts: int = 0, threads: int | None = None, frame_threads: bool = False,
                 pixel_format: str = "rgb24", preset: str = "veryfast", total: int | None = None,
                 desc: str | None = None, codec: str = "h264", bframes: int | None = None) -> None:
    """Encodes `frames` as H.264 or HEVC (yuv420p) into an mp4 at `out`, a path or a writable binary file.

    frames: uint8 [H, W, 3] RGB each (pixel_format="rgb24", converted by the encoder), or PyAV's
        yuv420p layout [H * 3 // 2, W] (pixel_format="yuv420p"); each is copied, so a generator may
        reuse one buffer.
    first_pts: the first frame is shown at first_pts / fps s (a piece of a longer video).
    threads: libx264's thread count (None: its own choice); frame_threads: frame-parallel encoding
        with as many threads as x264 picks (PyAV's default, slice threads, is slower for x264).
    codec: "h264" (libx264) or "hevc" (libx265); bframes: B-frames between references (None: the
        encoder's default, 3 for x264 and 4 for x265 at these presets; 0: none).
    total, desc: a progress bar over `total` frames, labelled `desc` (none without desc).
    """
    import av
    from tqdm.auto import tqdm

    if codec not in ENCODERS:
        raise ValueError(f"codec={codec!r}: choose one of {sorted(ENCODERS)}")
    encoder, params_key = ENCODERS[codec]
    rate = Fraction(fps).limit_denominator(1001)
    gop = max(1, round(gop_s * fps))
    with av.open(out, "w", format="mp4") as container:
        stream = None
        for i, buf in enumerate(tqdm(frames, total=total, desc=desc, unit="frame", disable=True if desc is None else None,
                                     leave=False)):
            if stream is None:
                height = buf.shape[0] if pixel_format == "rgb24" else buf.shape[0] * 2 // 3
                stream = container.add_stream(encoder, rate=rate)
                stream.width, stream.height, stream.pix_fmt = buf.shape[1], height, "yuv420p"
                if frame_threads:
                    stream.codec_context.thread_type = "FRAME"
                    stream.codec_context.thread_count = 0
                params = f"keyint={gop}:min-keyint={gop}:scenecut=0"
                if bframes is not None:
                    params += f":bframes={bframes}"
                if codec == "hevc":
                    params += ":log-level=error"     # x265 prints its settings to stderr otherwise
                stream.options = {"preset": preset, "crf": str(crf), params_key: params}
                if threads is not None:
                    stream.options |= {"threads": str(threads)}
            frame = av.VideoFrame.from_ndarray(buf, format=pixel_format)
            frame.pts, frame.time_base = first_pts + i, 1 / rate
            container.mux(stream.encode(frame))
        if stream is not None:
            container.mux(stream.encode(None))
