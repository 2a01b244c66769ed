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

import concurrent.futures as cf
import logging
import os
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from graph.stage import In, Out, Stage
from video.codec import (SharedFrames, SpawnWithoutMainContext, StreamIndex, TaskResult, VideoError, decode_task,
                         default_video_stream, keyframe_intervals, output_size, plan_tasks, sample_times, scan,
                         select_frames, to_rgb, warm_worker, worker_init)
from stages.types import FrameGroup, Request, VideoInfo

log = logging.getLogger(__name__)
__all__ = ["QuickCodec", "PyAVDecoder", "TorchCodecDecoder", "DecordDecoder", "read_video", "VideoError", "DecoderPool"]


class DecoderPool:
    """`workers` spawned decoder processes, which never run the caller's __main__ (so no
    `if __name__ == "__main__":` guard is needed). Tasks run in submission order (earliest first)."""

    def __init__(self, workers: int):
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        self.workers = workers
        self._pool: cf.ProcessPoolExecutor | None = None

    def get(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(self.workers, mp_context=SpawnWithoutMainContext(),
                                                initializer=worker_init)
        return self._pool

    def warm(self) -> None:
        """Start every worker now (imports included), so the first decode is not charged for it."""
        pool = self.get()
        for hold in (0.2, 0.5, 1.0):  # until every worker has answered once
            if len(set(pool.map(warm_worker, [hold] * self.workers))) == self.workers:
                return

    def pids(self) -> list[int]:
        return list((self._pool._processes or {}).keys()) if self._pool else []  # noqa: SLF001

    def how_processes_ended(self) -> list[str]:
        """How the decoder processes that ended by themselves ended: "SIGKILL", "exit code 1".
        A broken pool ends the others with SIGTERM, so that signal is not counted."""
        procs = list((self._pool._processes or {}).values()) if self._pool else []  # noqa: SLF001
        ended = set(wait([p.sentinel for p in procs], timeout=0))
        deadline = time.monotonic() + 1.0
        how = []
        for proc in procs:
            # an ended process's pipe closes a moment before it can be reaped (and the pool's own
            # thread may be reaping it now): give its exit status that moment
            while proc.sentinel in ended and proc.exitcode is None and time.monotonic() < deadline:
                time.sleep(0.01)
            code = proc.exitcode
            if code is None or code == -signal.SIGTERM:
                continue
            if code >= 0:
                how.append(f"exit code {code}")
            else:
                try:
                    how.append(signal.Signals(-code).name)
                except ValueError:
                    how.append(f"signal {-code}")
        return sorted(set(how))

    def shutdown(self, kill: bool = False) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if kill:
            # ProcessPoolExecutor (3.11) cannot stop running tasks; the processes must go.
            for proc in list((pool._processes or {}).values()):  # noqa: SLF001
                proc.terminate()
        pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "DecoderPool":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.shutdown(kill=exc_type is not None)


def _as_size(size: Any) -> Any:
    if size is None or isinstance(size, int):
        return size
    return tuple(int(s) for s in size)


# --------------------------------------------------------------------------------------------
# the shared shape of every decoder: select, then fill groups in order


class _Selection:
    """The frames to return: requested times → frame pts → output slots, plus the groups."""

    def __init__(self, path: str, fps, seconds, num_frames, size, group_frames: int, stream: int | None = None):
        self.index: StreamIndex = scan(path, stream)
        self.path = path
        times = sample_times(self.index, fps=fps, seconds=seconds, num_frames=num_frames)
        self.pts = select_frames(self.index, times)                        # int64 [N]
        self.seconds = self.index.seconds(self.pts)                        # float64 [N]
        self.height, self.width = output_size(self.index, size)
        self.n = len(self.pts)
        self.group_frames = group_frames if group_frames and group_frames > 0 else self.n
        self.n_groups = -(-self.n // self.group_frames)

    def group_range(self, g: int) -> tuple[int, int]:
        return g * self.group_frames, min((g + 1) * self.group_frames, self.n)

    def info(self, decoder: str, lost_slots: list[int]) -> VideoInfo:
        ix = self.index
        return VideoInfo(self.path, ix.duration_s, ix.fps, ix.n_frames, ix.codec, ix.width, ix.height,
                         self.n - len(lost_slots), (self.height, self.width),
                         tuple(float(self.seconds[s]) for s in lost_slots), decoder)

    def make_group(self, g: int, frames: torch.Tensor, lost: set[int]) -> FrameGroup:
        a, b = self.group_range(g)
        keep = [s for s in range(a, b) if s not in lost]
        sel = frames[a:b] if len(keep) == b - a else frames[keep]
        secs = torch.from_numpy(self.seconds[a:b].copy() if len(keep) == b - a else self.seconds[keep].copy())
        return FrameGroup(g, sel, secs, last=g == self.n_groups - 1)


def _warn_lost(path: str, sel: _Selection, lost_slots: list[int], errors: list[str]) -> None:
    if lost_slots:
        times = ", ".join(f"{sel.seconds[s]:.3f}" for s in lost_slots[:8]) + (" …" if len(lost_slots) > 8 else "")
        log.warning("%s: %d of %d selected frames could not be decoded and are left out (t = %s s)%s",
                    path, len(lost_slots), sel.n, times,
                    f"; decoder errors: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")
                    if errors else "")


def quickcodec_groups(path: str, pool: DecoderPool, *, fps=None, seconds=None, num_frames=None, size=None,
                      intervals: int = 0, group_frames: int = 0, interpolation: str = "BICUBIC",
                      seek_frames: int = 12, skip_nonref: bool = True, stream: int | None = None,
                      on_info: Callable[[VideoInfo], None] | None = None) -> Iterator[FrameGroup]:
    """QuickCodec (seed Alg. 2 + 3): yields FrameGroups in order, each as soon as it is complete.

    intervals: how many keyframe intervals to cut (0: `workers` when not grouping, else enough for
    every worker to have several, so the earliest groups finish first)."""
    path = str(path)
    sel = _Selection(path, fps, seconds, num_frames, size, group_frames, stream)
    count = intervals or (pool.workers if sel.n_groups == 1 else max(4 * pool.workers, sel.n_groups))
    tasks = plan_tasks(keyframe_intervals(sel.index, count), sel.pts)
    shared = SharedFrames((sel.n, 3, sel.height, sel.width))
    frames = torch.from_numpy(shared.array)  # shares the mapping; stays valid after unlink
    futures: dict[cf.Future, Any] = {}
    ok = False
    try:
        executor = pool.get()
        for task in tasks:  # submission order is the order workers take them: earliest first
            # plain ints only: a torch.Size here would make every worker import torch (~1 s)
            futures[executor.submit(decode_task, path, sel.index, task, shared.path, shared.shape,
                                    interpolation, seek_frames, 1, skip_nonref)] = task
        filled = np.zeros(sel.n, dtype=bool)
        lost: set[int] = set()
        errors: list[str] = []
        next_group = 0
        done = cf.as_completed(futures)  # wakes on completion events, never polls
        for fut in tqdm(done, total=len(futures), desc=f"decode {Path(path).name}", unit="interval",
                        leave=False, disable=None):
            try:
                res: TaskResult = fut.result()
            except cf.process.BrokenProcessPool:
                task = futures[fut]
                a, b = sel.index.seconds([task.start, min(task.end, int(sel.index.pts[-1]))])
                how = ", ".join(pool.how_processes_ended()) or "killed, or out of memory"
                if how == "SIGKILL":
                    how += ": out of memory, or killed"
                raise VideoError(path, f"a decoder process died while decoding {a:.2f}–{b:.2f} s ({how})") from None
            task = futures[fut]
            lost_pts = set(res.lost)
            for p, slots in zip(task.targets, task.slots):
                filled[slots] = True
                if p in lost_pts:
                    lost.update(slots)
            errors += res.errors
            while next_group < sel.n_groups and filled[slice(*sel.group_range(next_group))].all():
                yield sel.make_group(next_group, frames, lost)
                next_group += 1
        lost_slots = sorted(lost)
        _warn_lost(path, sel, lost_slots, errors)
        if len(lost_slots) == sel.n:
            raise VideoError(path, "none of the selected frames could be decoded")
        if on_info:
            on_info(sel.info("quickcodec", lost_slots))
        ok = True
    finally:
        shared.unlink()
        if not ok:
            for f in futures:
                f.cancel()
            pool.shutdown(kill=True)  # running tasks cannot be cancelled: end their processes


def read_video(path: str | os.PathLike, *, fps: float | None = None, seconds=None, num_frames: int | None = None,
               size: int | tuple[int, int] | None = None, workers: int | None = None,
               interpolation: str = "BICUBIC", stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the selected frames of `path` with QuickCodec.

    Returns (frames uint8 [N, 3, H, W], seconds float64 [N]), seconds relative to the video
    stream's first timestamp. Give one of `fps`, `seconds` (a list of times) or `num_frames`
    (evenly spaced, first and last included); none returns every frame. `size` is an int (square)
    or (h, w); None keeps the video's size. `workers` decoder processes (default: the cores).
    `stream`: which video stream, as an index into the container's streams (`container.streams[i]`
    in PyAV); None: the one FFmpeg picks as best (`container.streams.best("video")`)."""
    workers = workers or len(os.sched_getaffinity(0))
    with DecoderPool(workers) as pool:
        groups = list(quickcodec_groups(str(path), pool, fps=fps, seconds=seconds, num_frames=num_frames,
                                        size=_as_size(size), interpolation=interpolation, stream=stream))
    return _concat(groups)


def _concat(groups: list[FrameGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(groups) == 1:
        return groups[0].frames, groups[0].seconds
    return torch.cat([g.frames for g in groups]), torch.cat([g.seconds for g in groups])


# --------------------------------------------------------------------------------------------
# stages


class _Decoder(Stage):
    placement = "cpu"
    inputs = {"request": In(Request)}
    outputs = {"group": Out(FrameGroup, stream=True), "video": Out(VideoInfo)}

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, stream: int | None = None):
        self.fps, self.seconds, self.num_frames = fps, seconds, num_frames
        self.size, self.group_frames = _as_size(size), group_frames
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

    def _select(self, path: str) -> _Selection:
        return _Selection(path, self.fps, self.seconds, self.num_frames, self.size, self.group_frames, self.stream)


class QuickCodec(_Decoder):
    """Keyframe-interval parallel decoding over `workers` decoder processes (QuickVideo §3.1).

    group_frames > 0 streams: the video is cut into `intervals` (0: auto, ≫ workers) handed out
    earliest first, and each group of `group_frames` frames is emitted once all its frames are in.
    seek_frames: within an interval, seek to the next needed keyframe instead of decoding when
    more than this many frames lie in between (sparse sampling; measured by bench_seek).
    skip_nonref: do not decode H.264/HEVC frames nothing refers to unless they are selected.
    stream: the video stream's index among the container's streams (null: FFmpeg's best)."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 2, intervals: int = 0,
                 interpolation: str = "BICUBIC", seek_frames: int = 12, skip_nonref: bool = True,
                 stream: int | None = None):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        if workers < 1:
            raise ValueError(f"workers must be ≥ 1, got {workers}")
        self.workers, self.intervals = workers, intervals
        self.interpolation, self.seek_frames, self.skip_nonref = interpolation, seek_frames, skip_nonref
        self.pool: DecoderPool | None = None

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

    def decode(self, sel: _Selection, on_group: Callable[[FrameGroup], None] | None = None
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
        _warn_lost(sel.path, sel, lost, errors)
        if len(lost) == sel.n:
            raise VideoError(sel.path, "none of the selected frames could be decoded")
        if on_group:  # groups that lost frames go out with the frames they have
            for g in range(next_group, sel.n_groups):
                on_group(sel.make_group(g, out, set(lost)))
        return out, lost


class TorchCodecDecoder(_Decoder):
    """torchcodec: `get_frames_played_at` with approximate seek and `workers` FFmpeg threads
    (0 = FFmpeg picks), resized inside the decoder by its own Resize transform (bilinear,
    antialiased; measured ~100 ms faster per 10 frames than resizing afterwards)."""

    def __init__(self, fps: float | None = 1.0, seconds: list | None = None, num_frames: int | None = None,
                 size: Any = 448, group_frames: int = 0, workers: int = 0, seek_mode: str = "approximate",
                 stream: int | None = None):
        super().__init__(fps, seconds, num_frames, size, group_frames, stream)
        self.threads, self.seek_mode = workers, seek_mode

    def setup(self, ctx) -> None:
        try:
            from torchcodec.decoders import VideoDecoder  # noqa: F401
        except Exception as e:  # missing wheel or FFmpeg libraries: say which
            raise ImportError(f"torchcodec is not usable here ({e}); install it with .ci/reference-decoders.sh") from e

    def __call__(self, ctx, request: Request):
        from torchcodec.decoders import VideoDecoder

        path = self._video(request)
        sel = self._select(path)
        transforms = None
        if (sel.height, sel.width) != (sel.index.height, sel.index.width):
            from torchcodec.transforms import Resize

            transforms = [Resize((sel.height, sel.width))]
        decoder = VideoDecoder(path, stream_index=sel.index.stream, seek_mode=self.seek_mode,
                               num_ffmpeg_threads=self.threads, device="cpu", transforms=transforms)
        offset = float(sel.index.start_pts * sel.index.time_base)  # torchcodec speaks absolute stream time
        for g in range(sel.n_groups):
            a, b = sel.group_range(g)
            batch = decoder.get_frames_played_at(seconds=(sel.seconds[a:b] + offset).tolist())
            frames = batch.data
            ctx.emit("group", FrameGroup(g, frames, torch.from_numpy(sel.seconds[a:b].copy()), last=b == sel.n))
        return {"video": sel.info(f"torchcodec(threads={self.threads})", [])}


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
