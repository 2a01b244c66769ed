"""The toy world as frames and videos.

Rendering is a pure function of (world, fps, size): frame k shows the world at k / fps s, each
object pasted (anti-aliased) over a precomputed background; `make_video` encodes with libx264
(`video.encode`), and `ensure_video` keeps a cache of made videos with their truth beside them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

from video.encode import encode_video
from zoo.world import (
    BACKGROUNDS,
    COLORS,
    GRID,
    SIZE_OF,
    Truth,
    World,
    _scenes,
    make_world,
)

__all__ = ["frame_count", "render", "make_video", "ensure_video", "chunk_ranges", "held_out_requests"]



def frame_count(seconds: float, fps: float) -> int:
    """How many frames a video of `seconds` s has at `fps`: round(seconds * fps), frame k at k / fps."""
    if not fps > 0:
        raise ValueError(f"fps must be > 0, got {fps}")
    n = round(seconds * fps)
    if n < 1:
        raise ValueError(f"{seconds} s at {fps} fps is less than one frame")
    return n


def _hw(size: int | tuple[int, int]) -> tuple[int, int]:
    h, w = (size, size) if isinstance(size, (int, np.integer)) else size
    if h < 8 or w < 8:
        raise ValueError(f"size must be at least 8x8, got {size}")
    return int(h), int(w)


def render(world: World, fps: float, size: int | tuple[int, int],
           frames: range | None = None) -> Iterator[np.ndarray]:
    """The video's frames, uint8 [H, W, 3] RGB, a new array each. `size` is a side or (H, W);
    `frames` (default: all) picks which, by index, so a long video can be rendered in pieces."""
    h, w = _hw(size)
    n = frame_count(world.seconds, fps)
    frames = range(n) if frames is None else frames
    if frames.step != 1 or not 0 <= frames.start <= frames.stop <= n:
        raise ValueError(f"frames={frames}: a contiguous range within the video's {n} frames")
    backgrounds = {kind: _background(kind, h, w) for kind in BACKGROUNDS}
    unit = min(h, w)
    for scene in _scenes(world, (k / fps for k in frames)):
        frame = backgrounds[scene.background].copy()
        for s in scene.sprites:
            _paste(frame, _mask(s.shape, max(3, round(SIZE_OF[s.size] * unit))), COLORS[s.color],
                   s.y * h / GRID, s.x * w / GRID)
        yield frame


def _background(kind: str, h: int, w: int) -> np.ndarray:
    # low-contrast greys, with stripes and checks a few pixels wide even at 64 px, so the kind is
    # still visible after 4:2:0 and compression but never mistaken for an object
    yy, xx = np.mgrid[0:h, 0:w]
    if kind == "plain":
        grey = np.full((h, w), 122)
    elif kind == "striped":
        grey = np.where((yy // max(2, round(min(h, w) / 16))) % 2, 100, 145)
    else:
        cell = max(3, round(min(h, w) / 10))
        grey = np.where((yy // cell + xx // cell) % 2, 100, 145)
    return np.repeat(grey.astype(np.uint8)[:, :, None], 3, axis=2)


@lru_cache(maxsize=64)
def _mask(shape: str, d: int) -> np.ndarray:
    """Coverage of `shape` in a d x d box, float32 [d, d, 1] in 0..1 (4x4 supersampled)."""
    ss = 4
    u = (np.arange(d * ss) + 0.5) / (d * ss) * 2 - 1
    x, y = np.meshgrid(u, u)               # y grows downwards, as image rows do
    r2 = x * x + y * y
    if shape == "circle":
        inside = r2 <= 0.95 ** 2
    elif shape == "ring":
        inside = (r2 <= 1.0) & (r2 >= 0.55 ** 2)   # the hole is wide enough to survive 64 px
    elif shape == "square":
        inside = np.maximum(abs(x), abs(y)) <= 0.82   # about the circle's area
    elif shape == "triangle":
        inside = _in_polygon(x, y, [(0.0, -0.95), (0.95, 0.75), (-0.95, 0.75)])
    else:  # star: five points, inner radius 0.45 of the outer
        angles = -np.pi / 2 + np.arange(10) * np.pi / 5
        radii = np.where(np.arange(10) % 2, 0.45, 1.0)
        inside = _in_polygon(x, y, list(zip(radii * np.cos(angles), radii * np.sin(angles) + 0.08)))
    alpha = inside.reshape(d, ss, d, ss).mean(axis=(1, 3)).astype(np.float32)[:, :, None]
    alpha.setflags(write=False)            # shared by every frame through the cache
    return alpha


def _in_polygon(x: np.ndarray, y: np.ndarray, poly) -> np.ndarray:
    """Even-odd rule, vectorised over the points."""
    inside = np.zeros(x.shape, bool)
    for (x0, y0), (x1, y1) in zip(poly, poly[-1:] + poly[:-1]):
        if y0 != y1:
            inside ^= ((y0 > y) != (y1 > y)) & (x < x0 + (y - y0) * (x1 - x0) / (y1 - y0))
    return inside


def _paste(frame: np.ndarray, alpha: np.ndarray, color, cy: float, cx: float) -> None:
    d = alpha.shape[0]
    top, left = round(cy - d / 2), round(cx - d / 2)
    y0, x0, y1, x1 = max(top, 0), max(left, 0), min(top + d, frame.shape[0]), min(left + d, frame.shape[1])
    if y0 >= y1 or x0 >= x1:
        return
    a = alpha[y0 - top:y1 - top, x0 - left:x1 - left]
    region = frame[y0:y1, x0:x1]
    region[:] = region * (1 - a) + np.asarray(color, np.float32) * a + 0.5

# ------------------------------------------------------------------------------------- video

def make_video(seed: int, seconds: float, fps: float, size: int | tuple[int, int], path, *,
               crf: int = 18, gop_s: float = 2.0, chunk_s: float | None = None, workers: int = 1) -> Truth:
    """Renders the world of (`seed`, `seconds`) and encodes it as H.264 (yuv420p, a keyframe every
    `gop_s` s, no scene-cut keyframes) in an mp4 at `path`; returns its truth.

    chunk_s: encode the video as independent pieces of this many seconds (rounded to whole GOPs),
    `workers` of them at a time in processes, joined without re-encoding. For long videos: one
    libx264 on 1080p renders and encodes ~50 frames/s here, so 30 min at 24 fps would take ~15 min.
    The pieces depend on `chunk_s` only, never on `workers`, so the file is the same for any
    number of workers; it differs from the unchunked encode only in the encoder's rate control
    near each piece's start."""
    world = make_world(seed, seconds)
    h, w = _hw(size)
    if h % 2 or w % 2:
        raise ValueError(f"H.264 4:2:0 needs an even height and width, got {h}x{w}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if chunk_s is None:
        encode_video(render(world, fps, (h, w)), fps, str(path), crf=crf, gop_s=gop_s)
        return world.truth
    pieces = chunk_ranges(frame_count(seconds, fps), fps, chunk_s, gop_s)
    _encode_pieces(seed, seconds, fps, (h, w), pieces, Path(path), crf=crf, gop_s=gop_s, workers=workers)
    return world.truth


def chunk_ranges(n_frames: int, fps: float, chunk_s: float, gop_s: float) -> list[range]:
    """Frame ranges of about `chunk_s` s each, every one starting on a keyframe (a whole number of
    GOPs of round(gop_s * fps) frames), covering 0..n_frames."""
    if not chunk_s > 0:
        raise ValueError(f"chunk_s={chunk_s}: the length of an independently encoded piece, > 0 s")
    gop = max(1, round(gop_s * fps))
    step = gop * max(1, round(chunk_s * fps / gop))
    return [range(a, min(a + step, n_frames)) for a in range(0, n_frames, step)]


def _encode_piece(job) -> str:
    seed, seconds, fps, hw, frames, out, crf, gop_s = job
    encode_video(render(make_world(seed, seconds), fps, hw, frames), fps, out, crf=crf, gop_s=gop_s,
                first_pts=frames.start, threads=1)
    return out


def _encode_pieces(seed, seconds, fps, hw, pieces: list[range], path: Path, *, crf, gop_s, workers: int) -> None:
    """Encodes each piece to its own mp4 in a temporary folder beside `path` (in `workers`
    processes), then copies their packets, in order, into `path`."""
    import concurrent.futures
    import shutil
    import tempfile

    import av
    from tqdm import tqdm

    from graph.spawn import SpawnWithoutMainContext

    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=path.parent))
    try:
        jobs = [(seed, seconds, fps, hw, r, str(tmp / f"{i:05d}.mp4"), crf, gop_s) for i, r in enumerate(pieces)]
        # spawn, not fork: the caller may hold threads (torch, the engine's workers); and never
        # re-running the caller's __main__, so an unguarded script can make long videos
        with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=SpawnWithoutMainContext()) as pool:
            files = list(tqdm(pool.map(_encode_piece, jobs), total=len(jobs), desc=f"encoding {path.name}",
                              unit="piece", mininterval=5, disable=len(jobs) < 4))
        with av.open(str(path), "w", format="mp4") as out:
            stream = None
            for name in files:
                with av.open(name) as piece:
                    src = piece.streams.video[0]
                    if stream is None:
                        stream = out.add_stream_from_template(src)
                    for packet in piece.demux(src):
                        if packet.dts is None:      # the demuxer's end-of-stream marker
                            continue
                        packet.stream = stream
                        out.mux(packet)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_video(seed: int, seconds: float, fps: float = 2.0, size: int | tuple[int, int] = 84, cache_dir=None, *,
                 chunk_s: float | None = None, workers: int | None = None) -> tuple[Path, Truth]:
    """The toy video of (`seed`, `seconds`) made once into the cache (`$REELFLOW_CACHE/toy`, else
    ~/.cache/reelflow/toy) with its truth beside it as JSON; written under a temporary name and
    renamed, so an interrupted run never leaves a file that looks complete. `size` is a side or
    (H, W); chunk_s, workers: see `make_video` (workers None: one per core); a chunked video is its
    own cache entry, since its bits differ a little from the unchunked encode."""
    import json
    import os

    h, w = _hw(size)
    root = Path(cache_dir) if cache_dir else Path(os.environ.get("REELFLOW_CACHE", Path.home() / ".cache" / "reelflow")) / "toy"
    side = f"{h}" if h == w else f"{w}x{h}"
    chunked = f"-chunks{chunk_s:g}s" if chunk_s is not None else ""
    path = root / f"toy-s{seed}-{seconds:g}s-{fps:g}fps-{side}px{chunked}.mp4"
    truth_path = path.with_suffix(".json")
    if not (path.is_file() and truth_path.is_file()):
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.mp4")
        truth = make_video(seed, seconds, fps, (h, w), tmp, chunk_s=chunk_s, workers=workers or os.cpu_count() or 1)
        truth_path.write_text(json.dumps(truth.to_dict()) + "\n")
        tmp.replace(path)
    return path, Truth.from_dict(json.loads(truth_path.read_text()))


def held_out_requests(videos: int = 8, seconds: float = 30, first_seed: int = 0, fps: float = 2.0,
                      size: int | list = 84, prompt: str | None = None, chunk_s: float | None = None,
                      workers: int | None = None) -> list[dict]:
    """`videos` held-out toy-world videos (seeds first_seed.., below the training seeds), made once
    into the cache, as request rows like a manifest's ({"id", "video", "prompt", "reference"}), each
    carrying its truth as the reference. The `data.toy` config names this maker. size: a side or
    [H, W]; chunk_s, workers: encode a long video in pieces, in parallel (`make_video`)."""
    size = size if isinstance(size, int) else tuple(size)     # a side, or [H, W] from the config
    rows = []
    for seed in range(first_seed, first_seed + videos):
        path, truth = ensure_video(seed, seconds, fps, size, chunk_s=chunk_s, workers=workers)
        rows.append({"id": f"s{seed}-{seconds:g}s", "video": str(path), "prompt": prompt or "describe the video .",
                     "reference": truth.to_dict()})
    return rows
