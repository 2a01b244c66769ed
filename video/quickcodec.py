"""QuickCodec as a library: QuickVideo's keyframe-interval parallel decoding over a pool of decoder
processes, as a generator of frame groups and as one function.

    from video import read_video
    frames, seconds = read_video("movie.mp4", fps=1, size=448, workers=8)   # uint8 [N,3,448,448], float64 [N]

One packet scan (no decoding) gives every frame's timestamp and the keyframes (`video.codec.scan`);
the stream is cut at the keyframes nearest i/s of its length; each decoder process (one FFmpeg
thread) seeks once per interval, decodes forward, converts each selected frame straight into a
private shared-memory tensor and stops after its last needed frame. The decoder processes never
run the caller's `__main__`, so no `if __name__ == "__main__":` guard is needed. The decode stages
(`stages.decode`) run the same code inside a graph.
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

from graph.spawn import SpawnWithoutMainContext
from video.codec import (
    SKIPPABLE_CODECS,
    SharedFrames,
    StreamIndex,
    TaskResult,
    VideoError,
    decode_task,
    keyframe_intervals,
    output_size,
    plan_tasks,
    sample_times,
    scan,
    select_frames,
    warm_worker,
    worker_init,
)
from video.frames import FrameGroup, VideoInfo
from video.plan import plan_decode, seek_threshold

log = logging.getLogger(__name__)
__all__ = ["read_video", "quickcodec_groups", "DecoderPool", "Selection", "VideoError"]


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


def as_size(size: Any) -> Any:
    if size is None or isinstance(size, int):
        return size
    return tuple(int(s) for s in size)


# --------------------------------------------------------------------------------------------
# the shared shape of every decoder: select, then fill groups in order


class Selection:
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

    def info(self, decoder: str, lost_slots: list[int], plan: dict | None = None) -> VideoInfo:
        ix = self.index
        return VideoInfo(self.path, ix.duration_s, ix.fps, ix.n_frames, ix.codec, ix.width, ix.height,
                         self.n - len(lost_slots), (self.height, self.width),
                         tuple(float(self.seconds[s]) for s in lost_slots), decoder, plan)

    def make_group(self, g: int, frames: torch.Tensor, lost: set[int]) -> FrameGroup:
        a, b = self.group_range(g)
        keep = [s for s in range(a, b) if s not in lost]
        sel = frames[a:b] if len(keep) == b - a else frames[keep]
        secs = torch.from_numpy(self.seconds[a:b].copy() if len(keep) == b - a else self.seconds[keep].copy())
        return FrameGroup(g, sel, secs, last=g == self.n_groups - 1)


def warn_lost(path: str, sel: Selection, lost_slots: list[int], errors: list[str]) -> None:
    if lost_slots:
        times = ", ".join(f"{sel.seconds[s]:.3f}" for s in lost_slots[:8]) + (" …" if len(lost_slots) > 8 else "")
        log.warning("%s: %d of %d selected frames could not be decoded and are left out (t = %s s)%s",
                    path, len(lost_slots), sel.n, times,
                    f"; decoder errors: {errors[0]}" + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else "")
                    if errors else "")


def quickcodec_groups(path: str, pool: DecoderPool, *, fps=None, seconds=None, num_frames=None, size=None,
                      intervals: int = 0, group_frames: int = 0, interpolation: str = "BICUBIC",
                      seek_frames: int | str = "auto", skip_nonref: bool = True, stream: int | None = None,
                      on_info: Callable[[VideoInfo], None] | None = None) -> Iterator[FrameGroup]:
    """QuickCodec (QuickVideo's Alg. 2 + 3): yields FrameGroups in order, each as soon as it is complete.

    intervals: how many keyframe intervals to cut (0: `workers` when not grouping, else enough for
    every worker to have several, so the earliest groups finish first).
    seek_frames: seek past gaps of more than this many frames; "auto": chosen per video from its
    B-frame share (`video.plan`), so dense sampling decodes straight through and sparse sampling seeks."""
    path = str(path)
    sel = Selection(path, fps, seconds, num_frames, size, group_frames, stream)
    count = intervals or (pool.workers if sel.n_groups == 1 else max(4 * pool.workers, sel.n_groups))
    tasks = plan_tasks(keyframe_intervals(sel.index, count), sel.pts)
    ix = sel.index
    threshold = resolve_seek_frames(seek_frames, ix, skip_nonref)
    plan = plan_decode(ix.pts, ix.keyframes, [t.targets for t in tasks], threshold).metrics()
    decoded = seeks = 0
    shared = SharedFrames((sel.n, 3, sel.height, sel.width))
    frames = torch.from_numpy(shared.array)  # shares the mapping; stays valid after unlink
    futures: dict[cf.Future, Any] = {}
    ok = False
    try:
        executor = pool.get()
        for task in tasks:  # submission order is the order workers take them: earliest first
            # plain ints only: a torch.Size here would make every worker import torch (~1 s)
            futures[executor.submit(decode_task, path, sel.index, task, shared.path, shared.shape,
                                    interpolation, threshold, 1, skip_nonref)] = task
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
            decoded, seeks = decoded + res.decoded, seeks + res.seeks
            while next_group < sel.n_groups and filled[slice(*sel.group_range(next_group))].all():
                yield sel.make_group(next_group, frames, lost)
                next_group += 1
        lost_slots = sorted(lost)
        warn_lost(path, sel, lost_slots, errors)
        if len(lost_slots) == sel.n:
            raise VideoError(path, "none of the selected frames could be decoded")
        if on_info:
            # what it did beside what it planned: frames out of the decoder, seeks (one per interval included)
            on_info(sel.info("quickcodec", lost_slots, plan | {"decoded_frames": decoded, "seeks_made": seeks}))
        ok = True
    finally:
        shared.unlink()
        if not ok:
            for f in futures:
                f.cancel()
            pool.shutdown(kill=True)  # running tasks cannot be cancelled: end their processes


def check_seek_frames(seek_frames: int | str) -> None:
    """A ValueError unless `seek_frames` is a number of frames ≥ 0 or "auto"."""
    if seek_frames != "auto" and (isinstance(seek_frames, bool) or not isinstance(seek_frames, (int, np.integer))
                                  or seek_frames < 0):
        raise ValueError(f"seek_frames={seek_frames!r}: give a number of frames ≥ 0, or auto")


def resolve_seek_frames(seek_frames: int | str, index: StreamIndex, skip_nonref: bool) -> int:
    """The gap in frames past which a decoder seeks: as given, or chosen for this video ("auto")."""
    check_seek_frames(seek_frames)
    if seek_frames == "auto":
        return seek_threshold(index.reordered, index.n_frames, skip_nonref and index.codec in SKIPPABLE_CODECS)
    return int(seek_frames)


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
                                        size=as_size(size), interpolation=interpolation, stream=stream))
    return _concat(groups)


def _concat(groups: list[FrameGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(groups) == 1:
        return groups[0].frames, groups[0].seconds
    return torch.cat([g.frames for g in groups]), torch.cat([g.seconds for g in groups])


# --------------------------------------------------------------------------------------------
# stages
