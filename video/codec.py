"""Keyframe-interval video decoding (QuickCodec, QuickVideo §3.1 and Appendix A) as plain
functions over PyAV and numpy. No torch here: decoder worker processes import only this.

The pieces, in the order a decode uses them:

- `scan`: demux the video stream's packets without decoding (audio and pts-less packets skipped);
  every packet pts is a frame's pts, so the scan *is* the frame timeline, never the container's
  frame count. The stream is FFmpeg's best video stream unless one is asked for by index.
- `select_frames`: which frames to return, by timestamp relative to the stream's first pts: the
  frame on screen at each requested time (the last frame whose pts ≤ t).
- `keyframe_intervals`: cut the stream at the keyframes nearest i/s of its length (QuickVideo's Alg. 3).
- `plan_tasks`: for each interval, the selected frames (pts) it must produce and their output slots.
- `decode_task`: in a worker, seek once to the interval's first needed keyframe (our own index,
  not the container's guess), decode forward, drop frames before that keyframe (open GOP),
  convert each selected frame (YUV→RGB and resize in one swscale call) into the shared output,
  stop after the interval's last needed frame. When the next needed frame is more than
  `seek_frames` frames ahead, seek to its keyframe instead of decoding the gap (sparse sampling).
"""

from __future__ import annotations

import glob
import logging
import mmap
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class VideoError(ValueError):
    """A video that cannot be decoded as asked; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike, reason: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}")


# --------------------------------------------------------------------------------------------
# scanning


@dataclass(frozen=True)
class StreamIndex:
    path: str
    stream: int                  # index of the video stream among the container's streams
    time_base: Fraction
    pts: np.ndarray              # int64 [n_frames] sorted unique pts of the video packets
    keyframes: np.ndarray        # int64 [n_keyframes] sorted pts of keyframe packets
    width: int
    height: int
    codec: str
    packets_without_pts: int = 0
    reordered: int = 0           # frames shown before a frame decoded earlier (B-frames)

    @property
    def start_pts(self) -> int:
        return int(self.pts[0])

    @property
    def n_frames(self) -> int:
        return len(self.pts)

    def seconds(self, pts: np.ndarray | int) -> np.ndarray:
        """float64 seconds relative to the stream's first pts."""
        return (np.asarray(pts, dtype=np.int64) - self.start_pts).astype(np.float64) * float(self.time_base)

    @property
    def duration_s(self) -> float:
        """Up to the end of the last frame (its length taken as the median frame spacing)."""
        step = np.median(np.diff(self.pts)) if len(self.pts) > 1 else 0
        return float((self.pts[-1] - self.pts[0] + step) * self.time_base)

    @property
    def fps(self) -> float:
        span = float((self.pts[-1] - self.pts[0]) * self.time_base)
        return (len(self.pts) - 1) / span if span > 0 else 0.0


def open_container(path: str | os.PathLike):
    import av

    p = Path(path)
    if not p.exists():
        raise VideoError(path, "no such file")
    if not p.is_file():
        raise VideoError(path, "not a regular file")
    try:
        container = av.open(str(p))
    except av.error.FFmpegError as e:
        raise VideoError(path, f"not a video file FFmpeg can read ({e})") from None
    if not container.streams.video:
        kinds = ", ".join(s.type for s in container.streams) or "none"
        container.close()
        raise VideoError(path, f"has no video stream (streams: {kinds})")
    return container


def video_stream(container, path: str | os.PathLike, stream: int | None = None):
    """The video stream to decode: `container.streams[stream]`, or by default the one FFmpeg
    picks (av_find_best_stream, as PyAV's `streams.best`, torchcodec and decord do), which need
    not be the first: a file may carry a small preview track before the main one."""
    if stream is None:
        return container.streams.best("video")
    streams = container.streams
    if isinstance(stream, bool) or not isinstance(stream, (int, np.integer)):
        raise VideoError(path, f"stream={stream!r} is not a stream index")
    stream = int(stream)
    if 0 <= stream < len(streams) and streams[stream].type == "video":
        return streams[stream]
    video = ", ".join(f"{s.index} ({s.codec_context.width}x{s.codec_context.height} {s.codec_context.name})"
                      for s in streams.video)
    if not 0 <= stream < len(streams):
        raise VideoError(path, f"has no stream {stream} (its video streams: {video})")
    raise VideoError(path, f"stream {stream} is {streams[stream].type}, not video (its video streams: {video})")


def default_video_stream(path: str | os.PathLike) -> int:
    """Index of the video stream decoded when none is asked for."""
    container = open_container(path)
    try:
        return video_stream(container, path).index
    finally:
        container.close()


def scan(path: str | os.PathLike, stream: int | None = None) -> StreamIndex:
    """Demux a video stream's packets (no decoding) into a frame timeline: `stream` (an index
    into the container's streams), or by default FFmpeg's best video stream."""
    import av

    container = open_container(path)
    try:
        vs = video_stream(container, path, stream)
        pts, keys, no_pts = [], [], 0
        reordered, latest = 0, None
        try:
            for packet in container.demux(vs):
                if packet.size == 0:       # the demuxer's end-of-stream flush packet
                    continue
                if packet.pts is None:     # cannot be placed in time: skip (pitfall 9)
                    no_pts += 1
                    continue
                pts.append(packet.pts)
                if latest is not None and packet.pts < latest:  # packets come in decode order
                    reordered += 1
                latest = packet.pts if latest is None else max(latest, packet.pts)
                if packet.is_keyframe:
                    keys.append(packet.pts)
        except av.error.FFmpegError as e:  # truncated / corrupt tail: keep what was readable
            log.warning("%s: packet scan stopped early (%s); using the %d packets read", path, e, len(pts))
        if not pts:
            raise VideoError(path, "no video packets with timestamps (empty, truncated or corrupt)")
        pts_arr = np.unique(np.asarray(pts, dtype=np.int64))
        keys_arr = np.unique(np.asarray(keys, dtype=np.int64))
        if len(keys_arr) == 0 or keys_arr[0] > pts_arr[0]:
            # No keyframe flag on the first frame (seen with some TS muxers): decoding from the
            # stream's start is always possible, so treat its first pts as one.
            keys_arr = np.unique(np.concatenate([[pts_arr[0]], keys_arr]))
        cc = vs.codec_context
        return StreamIndex(str(path), vs.index, vs.time_base, pts_arr, keys_arr,
                           cc.width, cc.height, cc.name, no_pts, reordered)
    finally:
        container.close()


# --------------------------------------------------------------------------------------------
# selecting


def sample_times(index: StreamIndex, *, fps: float | None = None, seconds=None,
                 num_frames: int | None = None) -> np.ndarray:
    """Requested times (float64 seconds from the first pts). Exactly one of fps / seconds /
    num_frames, or none for every frame. `num_frames` spreads evenly from the first to the last
    frame, both included (as Qwen2.5-VL's sampler does)."""
    given = [name for name, v in (("fps", fps), ("seconds", seconds), ("num_frames", num_frames)) if v is not None]
    if len(given) > 1:
        raise ValueError(f"give one of fps, seconds, num_frames (got {', '.join(given)})")
    last = float(index.seconds(index.pts[-1]))
    if fps is not None:
        if fps <= 0:
            raise VideoError(index.path, f"fps={fps} must be positive")
        native = index.fps
        if native and fps > native * 1.001:
            raise VideoError(index.path, f"fps={fps:g} is above the video's own {native:.3g} fps: frames would repeat; "
                                         f"use fps ≤ {native:.3g}, or num_frames")
        n = int(np.floor(last * fps + 1e-9)) + 1
        return np.arange(n, dtype=np.float64) / fps
    if seconds is not None:
        t = np.atleast_1d(np.asarray(seconds, dtype=np.float64))
        if t.size == 0:
            raise VideoError(index.path, "seconds is empty")
        bad = t[(t < 0) | (t >= index.duration_s)]
        if bad.size:
            raise VideoError(index.path, f"seconds {bad[:5].tolist()} outside the video [0, {index.duration_s:.3f}) s")
        return t
    if num_frames is not None:
        if num_frames < 1:
            raise VideoError(index.path, f"num_frames={num_frames} must be ≥ 1")
        if num_frames > index.n_frames:
            raise VideoError(index.path, f"num_frames={num_frames} is more than the video's {index.n_frames} frames")
        return np.linspace(0.0, last, num_frames) if num_frames > 1 else np.zeros(1)
    return index.seconds(index.pts)


def select_frames(index: StreamIndex, times: np.ndarray) -> np.ndarray:
    """pts of the frame on screen at each time: the last frame with pts ≤ t. int64 [len(times)]."""
    rel = index.seconds(index.pts)
    # half a tick of slack so a time computed as k/fps lands on the frame stamped at it
    slack = 0.5 * float(index.time_base)
    pos = np.searchsorted(rel, np.asarray(times) + slack, side="right") - 1
    return index.pts[np.clip(pos, 0, len(rel) - 1)]


def output_size(index: StreamIndex, size) -> tuple[int, int]:
    """(height, width) of the returned frames; `size` is None (native), an int (square) or (h, w)."""
    if size is None:
        return index.height, index.width
    h, w = (size, size) if isinstance(size, (int, np.integer)) else tuple(size)
    if int(h) <= 0 or int(w) <= 0:
        raise VideoError(index.path, f"size={size}: height and width must be positive")
    return int(h), int(w)


# --------------------------------------------------------------------------------------------
# intervals and tasks


def keyframe_intervals(index: StreamIndex, count: int) -> list[tuple[int, int]]:
    """QuickVideo's Alg. 3: `count` pts intervals [start, end) whose inner boundaries are the keyframes
    nearest i/count of the stream's span; fewer when keyframes are scarcer than intervals."""
    keys = index.keyframes
    lo, hi = index.start_pts, int(index.pts[-1])
    bounds = [lo]
    for i in range(1, count):
        est = lo + (hi - lo) * i / count
        j = int(np.searchsorted(keys, est))
        candidates = [keys[k] for k in (j - 1, j) if 0 <= k < len(keys)]
        nearest = int(min(candidates, key=lambda k: abs(k - est)))
        if nearest > bounds[-1]:
            bounds.append(nearest)
    bounds.append(hi + 1)  # end is exclusive: the last frame belongs to the last interval
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass
class Task:
    """One worker's job: produce the frames `targets` (pts, ascending) into `slots`."""

    start: int
    end: int
    targets: list[int]
    slots: list[list[int]]     # output slots of each target (several when times share a frame)
    first_slot: int = 0
    last_slot: int = 0


def plan_tasks(intervals: list[tuple[int, int]], frame_pts: np.ndarray) -> list[Task]:
    """Assign each selected frame (by pts, slots in output order) to the interval holding it."""
    by_pts: dict[int, list[int]] = {}
    for slot, p in enumerate(frame_pts.tolist()):
        by_pts.setdefault(p, []).append(slot)
    unique = sorted(by_pts)
    tasks = []
    for start, end in intervals:
        i, j = np.searchsorted(unique, start), np.searchsorted(unique, end)
        targets = unique[i:j]
        if not targets:
            continue
        slots = [by_pts[p] for p in targets]
        flat = [s for group in slots for s in group]
        tasks.append(Task(start, end, targets, slots, min(flat), max(flat)))
    return tasks


# --------------------------------------------------------------------------------------------
# shared output


class SharedFrames:
    """A uint8 [N, 3, H, W] array in a private shared-memory file (mode 0600) that decoder
    processes write into. `unlink()` removes the name; the mapping (and arrays over it) stay
    valid until dropped, so results need no copy and nothing is left in /dev/shm."""

    def __init__(self, shape: tuple[int, int, int, int]):
        self.shape = tuple(int(s) for s in shape)
        self.nbytes = int(np.prod(self.shape))
        self.path = f"/dev/shm/reelflow-{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(1, self.nbytes))
            self.mmap = mmap.mmap(fd, max(1, self.nbytes))
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.mmap, dtype=np.uint8, count=self.nbytes).reshape(self.shape)

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedFrames":
        return self

    def __exit__(self, *exc) -> None:
        self.unlink()


def process_alive(pid: int) -> bool:
    """Running, or stopped; not gone and not a zombie (dead, waiting for its parent to reap it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                                 # someone else's live process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_segments_of(pid: int) -> list[str]:
    """Remove the shared-memory files of a process that is gone (killed in the middle of a decode,
    so it could not unlink them). A live process's files are left alone."""
    if process_alive(pid):
        return []                                   # its files are in use
    removed = []
    for path in glob.glob(f"/dev/shm/reelflow-{int(pid)}-*"):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _attach(path: str, shape: tuple) -> tuple[mmap.mmap, np.ndarray]:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, int(np.prod(shape)))
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8).reshape(shape)


# --------------------------------------------------------------------------------------------
# decoding (in worker processes)


def worker_init() -> None:
    """Decoder processes ignore Ctrl-C (the parent ends them) and die with their parent."""
    import signal

    from graph.spawn import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def warm_worker(hold_s: float) -> int:
    """Import what decoding needs, then hold the worker a moment so its siblings get the other
    warm-up tasks (one per worker)."""
    import time

    import av  # noqa: F401

    time.sleep(hold_s)
    return os.getpid()


def to_rgb(frame, height: int, width: int, interpolation: str = "BICUBIC") -> np.ndarray:
    """One swscale call: YUV → RGB24 and resize. uint8 [3, height, width]. Every decoder of
    reelflow that converts through PyAV uses exactly this, so they agree byte for byte."""
    if frame.width == width and frame.height == height:
        rgb = frame.to_ndarray(format="rgb24")
    else:
        rgb = frame.reformat(width=width, height=height, format="rgb24", interpolation=interpolation).to_ndarray()
    return rgb.transpose(2, 0, 1)


@dataclass
class TaskResult:
    done: list[int] = field(default_factory=list)   # targets written
    lost: list[int] = field(default_factory=list)   # targets that never came out of the decoder
    decoded: int = 0                                 # frames decoded
    seeks: int = 0
    errors: list[str] = field(default_factory=list)  # decoder errors skipped over


SKIPPABLE_CODECS = ("h264", "hevc")


def _frames_from(container, vs, keyframe: int | None, result: TaskResult, wanted: set[int] | None = None):
    """Frames in display order from `keyframe` on (None: from where the container stands);
    corrupt packets are skipped and noted. With `wanted`, frames no other frame refers to
    (non-reference B-frames) are not decoded at all unless their pts is wanted: nothing else
    depends on them, so every wanted frame still decodes exactly as in a full decode."""
    import av

    if keyframe is not None:
        container.seek(int(keyframe), stream=vs, backward=True, any_frame=False)  # also flushes the decoder
        result.seeks += 1
    cc = vs.codec_context
    for packet in container.demux(vs):
        if wanted is not None:
            cc.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in wanted else "NONREF"
        try:
            frames = packet.decode()
        except av.error.FFmpegError as e:
            result.errors.append(f"pts {packet.pts}: {e}")
            continue
        for frame in frames:
            if frame.pts is not None:
                yield frame


def decode_task(path: str, index: StreamIndex, task: Task, out_path: str, out_shape: tuple,
                interpolation: str = "BICUBIC", seek_frames: int = 12, threads: int = 1,
                skip_nonref: bool = True) -> TaskResult:
    """Runs in a decoder process: decode `task`'s frames into the shared output at `out_path`."""
    import av

    result = TaskResult()
    _, _, height, width = out_shape
    mm, out = _attach(out_path, out_shape)
    container = vs = None

    def reopen():
        nonlocal container, vs
        if container is not None:
            container.close()
        container = av.open(path)
        vs = container.streams[index.stream]
        vs.thread_type = "AUTO" if threads != 1 else "NONE"  # before the codec opens (pitfall 9)
        vs.codec_context.thread_count = threads

    reopen()
    fresh = True  # the container still stands at the stream's start
    try:
        keys, all_pts = index.keyframes, index.pts
        targets, i = task.targets, 0

        def keyframe_for(p: int) -> int:
            return int(keys[np.searchsorted(keys, p, side="right") - 1])

        kf = keyframe_for(targets[0])
        late_seeks: set[int] = set()   # keyframes a seek overshot: reach them by decoding instead
        while i < len(targets):
            floor = kf                      # frames shown before the keyframe we started from are
            verified, jumped = False, False  # leading frames of an open GOP: never correct here
            from_start = kf == index.start_pts
            if from_start and not fresh:
                reopen()                     # a seek to the very start is unreliable in some containers
            fresh = False
            # Only where "non-reference" is a property of each packet's one frame: H.264 and
            # HEVC. AV1/VP9 packets can carry hidden frames shown later by reference (dav1d
            # drops frames we need when told to skip), so they decode in full.
            wanted = set(targets) if skip_nonref and index.codec in SKIPPABLE_CODECS else None
            for frame in _frames_from(container, vs, None if from_start else kf, result, wanted):
                result.decoded += 1
                if frame.pts < floor:
                    continue
                if not verified:
                    verified = True
                    if frame.pts > floor and not from_start:
                        # the seek landed after our keyframe (MPEG-TS, some HEVC): go back one
                        late_seeks.add(kf)
                        earlier = keys[keys < kf]
                        kf, jumped = (int(earlier[-1]) if len(earlier) else index.start_pts), True
                        break
                while i < len(targets) and targets[i] < frame.pts:
                    result.lost.append(targets[i])   # the decoder skipped it (corrupt data)
                    i += 1
                if i < len(targets) and frame.pts == targets[i]:
                    rgb = to_rgb(frame, height, width, interpolation)
                    for slot in task.slots[i]:
                        out[slot] = rgb
                    result.done.append(targets[i])
                    i += 1
                if i == len(targets):
                    break
                next_kf = keyframe_for(targets[i])
                if next_kf > frame.pts and next_kf not in late_seeks:
                    gap = int(np.searchsorted(all_pts, next_kf) - np.searchsorted(all_pts, frame.pts, side="right"))
                    if gap > seek_frames:   # cheaper to seek than to decode the gap
                        kf, jumped = next_kf, True
                        break
            else:
                if not verified and not from_start:  # the seek landed past every frame we need
                    late_seeks.add(kf)
                    earlier = keys[keys < kf]
                    kf = int(earlier[-1]) if len(earlier) else index.start_pts
                    continue
                result.lost.extend(targets[i:])      # the stream ended first (truncated file)
                i = len(targets)
            if not jumped:
                break
    finally:
        container.close()
        del out
        mm.close()
    return result
