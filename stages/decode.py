"""Decode stages: a Request's video → FrameGroups (uint8 [n, 3, H, W] + seconds), streamed.

All decoders share the ports and the frame selection (by timestamp relative to the stream's first
pts, see video/codec.py), so a sweep can swap them: `graph.nodes.decode.stage=torchcodec`.

- QuickCodec: QuickVideo's keyframe-interval parallel decoder over a pool of decoder processes,
  writing converted frames straight into shared memory; streaming hands intervals out earliest
  first and emits each group as soon as all its frames are in.
- PyAVDecoder: sequential PyAV decoding (one thread, or FFmpeg's frame threads) — the reference
  every other decoder is tested against.
- TorchCodecDecoder: torchcodec's `get_frames_played_at` with approximate seek.
- DecordDecoder: decord's `get_batch`.

The decoder pool is the one place a stage owns processes: it is the decoder's internal
parallelism (like FFmpeg's threads in the others), started in `setup` and ended in `close`;
a failing or cancelled call terminates it and the next call starts a fresh one.

Each decodes FFmpeg's best video stream of a file (not necessarily its first), or the one given
as `stream` (an index into the container's streams; decord can only take the best one).

`read_video(path, fps=..., size=..., workers=...)` is QuickCodec as a function.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import torch

from graph.stage import In, Out, Stage
from stages.types import FrameGroup, Request, VideoInfo
from video.codec import VideoError, default_video_stream, to_rgb
from video.quickcodec import (
    DecoderPool,
    Selection,
    as_size,
    check_seek_frames,
    quickcodec_groups,
    read_video,
    warn_lost,
)

log = logging.getLogger(__name__)
__all__ = ["QuickCodec", "PyAVDecoder", "TorchCodecDecoder", "DecordDecoder", "read_video", "VideoError", "DecoderPool"]


class _Decoder(Stage):
    placement = "cpu"
    inputs = {"request": In(Request)}
    outputs = {"group": Out(FrameGroup, stream=True), "video": Out(VideoInfo)}

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, stream: int | None = None):
        self.fps, self.seconds, self.num_frames = fps, seconds, num_frames
        self.size, self.group_frames = as_size(size), group_frames
        if self.size is not None and (np.min(np.atleast_1d(self.size)) <= 0):
            raise ValueError(f"size={size}: height and width must be positive")
        if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int) or stream < 0):
            raise ValueError(f"stream={stream!r}: give a stream index (0, 1, ...), or null for FFmpeg's best "
                             f"video stream")
        self.stream = stream

    def _video(self, request: Request) -> str:
        if request is None or not request.video:
            raise VideoError("<no video>", "the request carries no video path (give data.path=VIDEO)")
        return request.video

    def _select(self, path: str) -> Selection:
        return Selection(path, self.fps, self.seconds, self.num_frames, self.size, self.group_frames, self.stream)


class QuickCodec(_Decoder):
    """Keyframe-interval parallel decoding over `workers` decoder processes (QuickVideo §3.1).

    group_frames > 0 streams: the video is cut into `intervals` (0: auto, ≫ workers) handed out
    earliest first, and each group of `group_frames` frames is emitted once all its frames are in.
    seek_frames: within an interval, seek to the next needed keyframe instead of decoding when
    more than this many frames lie in between; "auto" chooses per video (`video.plan`), and the
    choice goes to metrics.json as video.plan.
    skip_nonref: do not decode H.264/HEVC frames nothing refers to unless they are selected.
    stream: the video stream's index among the container's streams (null: FFmpeg's best)."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 2, intervals: int = 0,
                 interpolation: str = "BICUBIC", seek_frames: int | str = "auto", skip_nonref: bool = True,
                 stream: int | None = None):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        check_seek_frames(seek_frames)
        self.workers, self.intervals = workers, intervals
        self.interpolation, self.seek_frames, self.skip_nonref = interpolation, seek_frames, skip_nonref
        self.pool: DecoderPool | None = None

    @classmethod
    def declared_processes(cls, kwargs: dict) -> int:
        return int(kwargs.get("workers", 2))     # the decoder pool: one busy core each

    def setup(self, ctx) -> None:
        self.pool = DecoderPool(self.workers)
        self.pool.warm()

    def __call__(self, ctx, request: Request):
        info: list[VideoInfo] = []
        for group in quickcodec_groups(self._video(request), self.pool, fps=self.fps, seconds=self.seconds,
                                       num_frames=self.num_frames, size=self.size, intervals=self.intervals,
                                       group_frames=self.group_frames, interpolation=self.interpolation,
                                       seek_frames=self.seek_frames, skip_nonref=self.skip_nonref,
                                       stream=self.stream, on_info=info.append):
            ctx.emit("group", group)
        return {"video": info[0]}

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown(kill=True)
            self.pool = None


class PyAVDecoder(_Decoder):
    """Sequential PyAV decoding of every frame, converting the selected ones (the reference).
    workers=1: one thread; workers=N: FFmpeg's frame threads (N=0: FFmpeg picks, all cores)."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 1, interpolation: str = "BICUBIC",
                 stream: int | None = None):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        self.threads, self.interpolation = workers, interpolation

    def __call__(self, ctx, request: Request):
        sel = self._select(self._video(request))
        _, lost = self.decode(sel, lambda group: ctx.emit("group", group))
        return {"video": sel.info(f"pyav(threads={self.threads})", lost)}

    def decode(self, sel: Selection, on_group: Callable[[FrameGroup], None] | None = None
               ) -> tuple[torch.Tensor, list[int]]:
        """Every frame in order; the selected ones converted. Returns (frames, lost slots)."""
        import av

        from video.codec import open_container

        by_pts: dict[int, list[int]] = {}
        for slot, p in enumerate(sel.pts.tolist()):
            by_pts.setdefault(p, []).append(slot)
        out = torch.empty((sel.n, 3, sel.height, sel.width), dtype=torch.uint8)
        done = np.zeros(sel.n, dtype=bool)
        errors: list[str] = []
        next_group = 0
        container = open_container(sel.path)
        try:
            vs = container.streams[sel.index.stream]
            vs.thread_type = "AUTO" if self.threads != 1 else "NONE"  # before the codec opens
            vs.codec_context.thread_count = self.threads
            for packet in container.demux(vs):
                try:
                    decoded = packet.decode()
                except av.error.FFmpegError as e:
                    errors.append(f"pts {packet.pts}: {e}")
                    continue
                for frame in decoded:
                    slots = by_pts.get(frame.pts)
                    if slots is None or done[slots[0]]:
                        continue
                    out[slots] = torch.from_numpy(to_rgb(frame, sel.height, sel.width, self.interpolation))
                    done[slots] = True
                    while on_group and next_group < sel.n_groups and done[slice(*sel.group_range(next_group))].all():
                        on_group(sel.make_group(next_group, out, set()))
                        next_group += 1
                if done.all():
                    break
        finally:
            container.close()
        lost = np.flatnonzero(~done).tolist()
        warn_lost(sel.path, sel, lost, errors)
        if len(lost) == sel.n:
            raise VideoError(sel.path, "none of the selected frames could be decoded")
        if on_group:  # groups that lost frames go out with the frames they have
            for g in range(next_group, sel.n_groups):
                on_group(sel.make_group(g, out, set(lost)))
        return out, lost


class TorchCodecDecoder(_Decoder):
    """torchcodec: `get_frames_played_at` with approximate seek and `workers` FFmpeg threads
    (0 = FFmpeg picks), resized inside the decoder by its own Resize transform (bilinear,
    antialiased; measured ~100 ms faster per 10 frames than resizing afterwards).

    device="cuda" (or "cuda:N") decodes on the GPU's video engine (NVDEC) through torchcodec's
    CUDA device: the frames land on that GPU and are resized there (bilinear, antialiased, as the
    CPU path). Its colours differ slightly from FFmpeg's CPU conversion (see docs/quickvideo.md)."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 0, seek_mode: str = "approximate",
                 stream: int | None = None, device: str = "cpu"):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
            raise ValueError(f"device={device!r}: give cpu, or cuda / cuda:N to decode on an NVIDIA GPU (NVDEC)")
        self.threads, self.seek_mode, self.device = workers, seek_mode, device

    def setup(self, ctx) -> None:
        try:
            from torchcodec.decoders import VideoDecoder  # noqa: F401
        except Exception as e:  # missing wheel or FFmpeg libraries: say which
            raise ImportError(f"torchcodec is not usable here ({e}); install it with .ci/reference-decoders.sh") from e
        if self.device != "cpu":
            check_nvdec(self.device)

    def __call__(self, ctx, request: Request):
        from torchcodec.decoders import VideoDecoder

        path = self._video(request)
        sel = self._select(path)
        resize = (sel.height, sel.width) != (sel.index.height, sel.index.width)
        transforms = None
        if resize and self.device == "cpu":
            from torchcodec.transforms import Resize

            transforms = [Resize((sel.height, sel.width))]
        decoder = VideoDecoder(path, stream_index=sel.index.stream, seek_mode=self.seek_mode,
                               num_ffmpeg_threads=self.threads, device=self.device, transforms=transforms)
        offset = float(sel.index.start_pts * sel.index.time_base)  # torchcodec speaks absolute stream time
        for g in range(sel.n_groups):
            a, b = sel.group_range(g)
            batch = decoder.get_frames_played_at(seconds=(sel.seconds[a:b] + offset).tolist())
            frames = batch.data
            if resize and self.device != "cpu":
                frames = resize_on_device(frames, sel.height, sel.width)
            ctx.emit("group", FrameGroup(g, frames, torch.from_numpy(sel.seconds[a:b].copy()), last=b == sel.n))
        where = f"threads={self.threads}" if self.device == "cpu" else f"nvdec on {self.device}"
        return {"video": sel.info(f"torchcodec({where})", [])}


def check_nvdec(device: str) -> None:
    """Raise a clear error unless `device` is a CUDA GPU this torch and this torchcodec can decode on."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"decoding on {device} (NVDEC) needs an NVIDIA GPU, and torch sees none here "
                           f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}); "
                           f"decode on the CPU with stage/decode@graph.nodes.decode.stage=quickcodec (or torchcodec)")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise RuntimeError(f"device={device}: this machine has {torch.cuda.device_count()} GPU(s)")
    import io

    import torchcodec
    from torchcodec.decoders import VideoDecoder

    from video.encode import encode_video

    # torchcodec's CPU wheels have no CUDA decoder: find out now, on a 4-frame clip, not on the first video
    clip = io.BytesIO()
    encode_video((np.full((64, 64, 3), 128, np.uint8) for _ in range(4)), 4, clip)
    try:
        VideoDecoder(clip.getvalue(), device=device).get_frame_at(0)
    except Exception as e:
        raise RuntimeError(f"torchcodec {torchcodec.__version__} cannot decode on {device} here ({type(e).__name__}: "
                           f"{e}); its CUDA build matching torch {torch.__version__} is needed for NVDEC") from e


def resize_on_device(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [n, 3, H, W] → uint8 [n, 3, height, width] on the frames' device: bilinear with
    antialiasing (what torchcodec's Resize does on the CPU), rounded back to uint8."""
    out = torch.nn.functional.interpolate(frames.float(), size=(height, width), mode="bilinear", antialias=True,
                                          align_corners=False)
    return out.round_().clamp_(0, 255).to(torch.uint8)


class DecordDecoder(_Decoder):
    """decord: `get_batch` of the selected frame indices with `workers` decoding threads
    (0 = decord picks), resized by decord's own scaler. decord always opens FFmpeg's best video
    stream: another `stream` is an error, never a silent decode of the wrong one."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 0, stream: int | None = None):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        self.threads = workers

    def setup(self, ctx) -> None:
        try:
            import decord  # noqa: F401
        except Exception as e:
            raise ImportError(f"decord is not usable here ({e}); install it with .ci/reference-decoders.sh") from e

    def __call__(self, ctx, request: Request):
        import decord

        path = self._video(request)
        sel = self._select(path)
        if self.stream is not None and self.stream != (best := default_video_stream(path)):
            raise VideoError(path, f"decord decodes only the default video stream ({best}), not stream {self.stream}; "
                                   f"decode it with the quickcodec, pyav or torchcodec stage")
        reader = decord.VideoReader(path, ctx=decord.cpu(0), width=sel.width, height=sel.height, num_threads=self.threads)
        # decord indexes frames in presentation order: our frame index is the pts's rank
        indices = np.searchsorted(sel.index.pts, sel.pts)
        for g in range(sel.n_groups):
            a, b = sel.group_range(g)
            batch = reader.get_batch(indices[a:b].tolist()).asnumpy()       # [n, H, W, 3]
            frames = torch.from_numpy(batch).permute(0, 3, 1, 2).contiguous()
            ctx.emit("group", FrameGroup(g, frames, torch.from_numpy(sel.seconds[a:b].copy()), last=b == sel.n))
        return {"video": sel.info(f"decord(threads={self.threads})", [])}
