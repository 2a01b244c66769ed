"""The benchmark video: a synthetic H.264 file that compresses and decodes like real footage,
generated once and cached, so decoder and end-to-end benchmarks need no downloaded data.

    path = ensure_bench_video(30)            # 30 min, 1280x720, 24 fps, a keyframe every 2 s

Content (all deterministic in `seed`; the scene schedule does not depend on the length, so a
short video is a prefix of a longer one with the same parameters):

- scenes of 20-40 s, each a large procedurally generated background (sky with clouds over a
  ridge line, rough textured ground, buildings with windows, rocks; multi-octave value noise)
  that the camera pans across slowly along a smooth path with a little hand-held shake, in
  quarter pixels; a scene cut switches to a new background (at any frame, not on a keyframe);
- blobs of moving texture (water, foliage in wind) that change every frame, not rigidly;
- 4-9 moving textured objects per scene (ellipses and notched rectangles with gradients and
  texture, sub-pixel motion) that enter, cross, wobble and disappear, and are replaced;
- a slow drift of the exposure (a few levels) and light per-frame sensor noise on luma.

At 1280x720 this encodes to about 1.5-1.8 Mbit/s (P/B frames of several KB, not the few hundred
bytes of flat or rigidly moving content).

Rendering is done directly in YUV 4:2:0 (what the encoder takes): each frame is a crop of
precomputed background planes (one per quarter-pixel phase), the moving texture and objects are
pasted from precomputed frames and sprites, and noise is one of a few precomputed noise planes
added with uint8 wrap-around (every pixel is kept in 16..235, so noise and exposure never wrap),
so rendering stays far cheaper than encoding. The encoder is libx264 (preset veryfast, crf 23,
B-frames as x264's defaults, a keyframe exactly every `gop_s` seconds, no scene-cut keyframes),
or libx265 for `codec="hevc"` (crf 28, its default), with frame threads, so it runs on its own threads while the next frame is rendered; it is the
bottleneck (the long benchmark videos take minutes to make, once).

The file name holds every parameter plus GEN_VERSION (bump it when the content changes). The
file is written under a temporary name and renamed into place, so an interrupted generation never
leaves a file that looks complete.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from video.encode import ENCODERS, encode_video

log = logging.getLogger(__name__)
__all__ = ["ensure_bench_video", "bench_video_path", "render_frames", "check_bench_video", "GEN_VERSION"]

GEN_VERSION = 1
PRESET = "veryfast"
CRF = {"h264": 23, "hevc": 28}   # each encoder's default quality: x265's 28 looks about like x264's 23
NOISE_PLANES = 16
NOISE_SIGMA = 2.0         # sensor noise on luma, in 8-bit levels
DYN_STEPS = 12            # frames of the moving-texture loop (played forwards and back)
SUBPEL = 4                # camera and objects move in quarter pixels
LO, HI = 16, 235          # video range; noise (±4) and lighting (±6) never take a pixel out of 0..255


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else `$REELFLOW_CACHE/videos`, else `~/.cache/reelflow/videos`."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("REELFLOW_CACHE")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "reelflow") / "videos"


def check_bench_video(minutes: float, width: int, height: int, fps: int, gop_s: float) -> tuple[int, int]:
    if not minutes > 0:
        raise ValueError(f"minutes must be > 0, got {minutes}")
    if width < 16 or height < 16 or width % 2 or height % 2:
        raise ValueError(f"width and height must be even and ≥ 16, got {width}x{height}")
    if int(fps) != fps or fps < 1:
        raise ValueError(f"fps must be a positive integer, got {fps}")
    frames = round(minutes * 60 * fps)
    gop = round(gop_s * fps)
    if frames < 1 or gop < 1:
        raise ValueError(f"minutes={minutes}, gop_s={gop_s} at fps={fps} give {frames} frames, a GOP of {gop}")
    return frames, gop


def check_codec(codec: str, bframes: int | None) -> None:
    if codec not in CRF:
        raise ValueError(f"codec={codec!r}: the benchmark videos are {' or '.join(sorted(CRF))}")
    if bframes is not None and (isinstance(bframes, bool) or not 0 <= int(bframes) <= 16):
        raise ValueError(f"bframes={bframes!r}: give 0-16 B-frames between references, or null for the encoder's default")


def bench_video_path(minutes: float, *, width: int = 1280, height: int = 720, fps: int = 24, gop_s: float = 2.0,
                     seed: int = 0, codec: str = "h264", bframes: int | None = None,
                     cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `ensure_bench_video` keeps the video for these parameters (it may not exist yet)."""
    frames, gop = check_bench_video(minutes, width, height, fps, gop_s)
    check_codec(codec, bframes)
    encoder = ENCODERS[codec][0].removeprefix("lib")
    b_frames = "" if bframes is None else f"-bf{int(bframes)}"
    name = (f"bench-{minutes:g}min-{frames}f-{width}x{height}-{fps}fps-gop{gop}-seed{seed}"
            f"-{encoder}{PRESET}crf{CRF[codec]}{b_frames}-v{GEN_VERSION}.mp4")
    return cache_root(cache_dir) / name


def ensure_bench_video(minutes: float, *, width: int = 1280, height: int = 720, fps: int = 24, gop_s: float = 2.0,
                       seed: int = 0, codec: str = "h264", bframes: int | None = None,
                       cache_dir: str | os.PathLike | None = None) -> Path:
    """The cached benchmark video for these parameters, generated first if it is not there.
    codec: "h264" or "hevc"; bframes: B-frames between references (None: the encoder's default)."""
    path = bench_video_path(minutes, width=width, height=height, fps=fps, gop_s=gop_s, seed=seed, codec=codec,
                            bframes=bframes, cache_dir=cache_dir)
    if path.is_file():
        log.info("benchmark video: reusing %s", path)
        return path
    frames, gop = check_bench_video(minutes, width, height, fps, gop_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")
    log.info("benchmark video: generating %s (%s, %d frames, %dx%d, %d fps, keyframe every %d frames)",
             path, codec, frames, width, height, fps, gop)
    start = time.perf_counter()
    try:
        encode_video(render_frames(frames, width, height, fps, seed), fps, str(tmp), crf=CRF[codec], gop_s=gop_s,
                     frame_threads=True, pixel_format="yuv420p", preset=PRESET, total=frames,
                     desc=f"bench video {minutes:g} min", codec=codec, bframes=bframes)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    took = time.perf_counter() - start
    size = path.stat().st_size
    log.info("benchmark video: wrote %s in %.1f s (%.0f frames/s), %.1f MB, %.2f Mbit/s",
             path.name, took, frames / took, size / 1e6, size * 8 / (frames / fps) / 1e6)
    return path


# ---------------------------------------------------------------------------------- rendering

def _noise(gen: torch.Generator, h: int, w: int, cell: float, finest: float = 2.5, persistence: float = 0.6) -> np.ndarray:
    """Multi-octave value noise, float32 [h, w], zero mean and unit std: octaves from `cell`
    pixels down to `finest` pixels, each `persistence` times the amplitude of the one before."""
    out = torch.zeros(1, 1, h, w)
    amp = 1.0
    while cell >= finest:
        gh, gw = max(2, math.ceil(h / cell) + 1), max(2, math.ceil(w / cell) + 1)
        grid = torch.randn(1, 1, gh, gw, generator=gen)
        out += amp * F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
        amp *= persistence
        cell /= 2
    out = out[0, 0]
    return ((out - out.mean()) / out.std().clamp_min(1e-6)).numpy()


def _ellipse(h: int, w: int) -> np.ndarray:
    yy = (np.arange(h, dtype=np.float32) + 0.5) / h * 2 - 1
    xx = (np.arange(w, dtype=np.float32) + 0.5) / w * 2 - 1
    return yy[:, None] ** 2 + xx[None, :] ** 2 <= 1


def _paint(plane: np.ndarray, y: int, x: int, patch: np.ndarray, mask: np.ndarray) -> None:
    """Copy `patch` into `plane` at (y, x) where `mask`, clipped to the plane."""
    h, w = patch.shape
    y0, x0, y1, x1 = max(y, 0), max(x, 0), min(y + h, plane.shape[0]), min(x + w, plane.shape[1])
    if y0 >= y1 or x0 >= x1:
        return
    sl = (slice(y0 - y, y1 - y), slice(x0 - x, x1 - x))
    np.copyto(plane[y0:y1, x0:x1], patch[sl], where=mask[sl])


def _to_u8(a: np.ndarray) -> np.ndarray:
    return np.clip(a, LO, HI).astype(np.uint8)


def _phases(a: np.ndarray) -> list[list[np.ndarray]]:
    """`a` [h, w] resampled (bilinear) at every quarter-pixel offset: [fy][fx] -> uint8 [h-1, w-1],
    so motion can be sub-pixel, as a real camera's is, at the cost of a crop per frame."""
    out = []
    for fy in np.arange(SUBPEL) / SUBPEL:
        rows = (1 - fy) * a[:-1] + fy * a[1:]
        out.append([_to_u8((1 - fx) * rows[:, :-1] + fx * rows[:, 1:]) for fx in np.arange(SUBPEL) / SUBPEL])
    return out


def _subpel(v: float) -> tuple[int, int]:
    """A coordinate as (whole pixels, quarter-pixel phase)."""
    q = int(round(v * SUBPEL))
    return q // SUBPEL, q % SUBPEL


class _Scene:
    """One scene: background planes larger than the frame, a camera path over them, and a stream
    of moving objects. Everything comes from `rng` (one per scene)."""

    def __init__(self, rng: np.random.Generator, width: int, height: int, fps: int):
        self.rng, self.w, self.h, self.fps = rng, width, height, fps
        gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
        s = height / 720                                    # sizes are given for 720p
        bh, bw = 2 * round(height * 1.4 / 2), 2 * round(width * 1.4 / 2)
        self.bh, self.bw = bh, bw

        # luma: sky (smooth, with clouds) over a ridge line, textured ground below
        horizon = rng.uniform(0.25, 0.55) * bh
        ridge = horizon + 0.08 * bh * _noise(gen, 1, bw, cell=bw / 3, finest=4 * s)[0]
        rows = np.arange(bh, dtype=np.float32)[:, None]
        ground = rows > ridge[None, :]
        detail = _noise(gen, bh, bw, cell=160 * s, finest=2.0, persistence=0.85)   # rough: grass, gravel
        coarse = _noise(gen, bh, bw, cell=bw / 2, finest=40 * s)
        sky_y = rng.uniform(150, 215) - 40 * rows / bh + 14 * coarse + 2 * detail
        ground_y = rng.uniform(70, 140) + rng.uniform(18, 30) * detail + 20 * coarse
        y = np.where(ground, ground_y, sky_y)
        # chroma (half resolution): bluish sky, a random earth tone below, slow variation
        ch, cw = bh // 2, bw // 2
        cground = ground[::2, ::2]
        cu = _noise(gen, ch, cw, cell=cw / 3, finest=4 * s, persistence=0.7)
        cv = _noise(gen, ch, cw, cell=cw / 3, finest=4 * s, persistence=0.7)
        du, dv = rng.uniform(-18, 8), rng.uniform(-10, 22)
        u = np.where(cground, 128 + du + 7 * cu, 128 + rng.uniform(8, 24) + 4 * cu)
        v = np.where(cground, 128 + dv + 7 * cv, 128 - rng.uniform(4, 16) + 4 * cv)
        # static shapes standing on the ground (buildings with windows, rocks, signs, trunks),
        # a few in the sky: gradient fills with the ground's own texture
        yy, xx = np.mgrid[0:bh, 0:bw]
        for _ in range(int(rng.integers(20, 45))):
            sh, sw = 2 * int(rng.integers(10, 150) * s), 2 * int(rng.integers(8, 130) * s)
            sh, sw = max(sh, 4), max(sw, 4)
            px = 2 * int(rng.integers(0, (bw - sw) // 2 + 1))
            if rng.random() < 0.8:       # standing on the ground line
                foot = ridge[min(px + sw // 2, bw - 1)] + rng.uniform(0, 0.5) * (bh - horizon)
                py = int(np.clip(foot - sh, 0, bh - sh)) // 2 * 2
            else:
                py = 2 * int(rng.integers(0, (bh - sh) // 2 + 1))
            mask = _ellipse(sh, sw) if rng.random() < 0.35 else np.ones((sh, sw), bool)
            tex = detail[py:py + sh, px:px + sw]
            grad = np.linspace(0, rng.uniform(-30, 30), sh, dtype=np.float32)[:, None]
            fill = rng.uniform(40, 220) + grad + rng.uniform(5, 16) * tex
            if mask.all() and sh > 24 * s and sw > 24 * s and rng.random() < 0.6:   # windows / bricks
                cy, cx = rng.uniform(6, 20, 2) * s
                wy, wx = cy * rng.uniform(0.3, 0.7), cx * rng.uniform(0.3, 0.7)
                win = ((yy[:sh, :sw] % cy) < wy) & ((xx[:sh, :sw] % cx) < wx)
                fill = fill + win * rng.choice([-1, 1]) * rng.uniform(25, 60)
            _paint(y, py, px, fill, mask)
            _paint(u, py // 2, px // 2, np.full((sh // 2, sw // 2), 128 + rng.uniform(-25, 25)), mask[::2, ::2])
            _paint(v, py // 2, px // 2, np.full((sh // 2, sw // 2), 128 + rng.uniform(-25, 25)), mask[::2, ::2])
        self.y = _phases(y)                                  # [fy][fx] -> [bh-1, bw-1]
        self.u, self.v = _to_u8(u), _to_u8(v)

        # a moving texture (water, foliage in wind) over blobs of the scene: DYN_STEPS frames of
        # a looping animation (two noise fields rotated into each other), shown forwards and back
        blobs = _noise(gen, bh, bw, cell=bw / 4, finest=60 * s)
        self.dmask = blobs > np.quantile(blobs, 1 - rng.uniform(0.15, 0.35))
        rows = np.flatnonzero(self.dmask.any(1))
        self.drows = (int(rows[0]), int(rows[-1]) + 1)
        band = slice(*self.drows)
        self.dmask = self.dmask[band]
        fa = _noise(gen, *self.dmask.shape, cell=40 * s, finest=2.0, persistence=0.8)
        fb = _noise(gen, *self.dmask.shape, cell=40 * s, finest=2.0, persistence=0.8)
        base = y[band] * 0.6 + rng.uniform(20, 60)
        amp = rng.uniform(10, 22)
        self.dyn = [_to_u8(base + amp * (np.cos(a) * fa + np.sin(a) * fb))
                    for a in np.linspace(0, np.pi / 2, DYN_STEPS)]
        # lighting: a slow drift of the exposure, a few levels (clouds, auto exposure)
        self.light = (rng.uniform(0, 6), 2 * np.pi / (rng.uniform(3, 10) * fps), rng.uniform(0, 2 * np.pi))

        # camera: a slow smooth pan (two sines per axis) inside the background, plus a little
        # hand-held shake (faster sines, about a pixel); positions in quarter pixels
        self.cam = []
        for span in (bw - 2 - width, bh - 2 - height):
            periods = np.concatenate([rng.uniform(15, 60, 2), rng.uniform(0.4, 2.0, 2)]) * fps
            amps = np.array([0.3 * span, 0.2 * span, *rng.uniform(0.3, 1.2, 2) * s])
            self.cam.append((span, 2 * np.pi / periods, rng.uniform(0, 2 * np.pi, 4), amps))

        self.objects: list[_Object] = []
        self.n_objects = int(rng.integers(4, 10))
        self.t = 0

    def camera(self, t: int) -> tuple[float, float]:
        out = []
        for span, omega, phase, amps in self.cam:
            v = span / 2 + float(np.dot(amps, np.sin(omega * t + phase)))
            out.append(min(max(v, 0.0), span))
        return out[0], out[1]

    def render(self, buf_y: np.ndarray, buf_u: np.ndarray, buf_v: np.ndarray) -> None:
        t, h, w = self.t, self.h, self.w
        x, y = self.camera(t)
        (ix, fx), (iy, fy) = _subpel(x), _subpel(y)
        np.copyto(buf_y, self.y[fy][fx][iy:iy + h, ix:ix + w])
        cx, cy = int(round(x / 2)), int(round(y / 2))
        np.copyto(buf_u, self.u[cy:cy + h // 2, cx:cx + w // 2])
        np.copyto(buf_v, self.v[cy:cy + h // 2, cx:cx + w // 2])
        r0, r1 = max(iy, self.drows[0]), min(iy + h, self.drows[1])
        if r0 < r1:
            k = t % (2 * DYN_STEPS - 2)
            k = k if k < DYN_STEPS else 2 * DYN_STEPS - 2 - k
            band = slice(r0 - self.drows[0], r1 - self.drows[0])
            np.copyto(buf_y[r0 - iy:r1 - iy], self.dyn[k][band, ix:ix + w], where=self.dmask[band, ix:ix + w])
        self.objects = [o for o in self.objects if o.alive(t)]
        while len(self.objects) < self.n_objects:
            self.objects.append(_Object(self.rng, w, h, self.fps, t, fresh=t > 0))
        for o in self.objects:
            o.render(t, buf_y, buf_u, buf_v)
        amp, omega, phase = self.light
        if (shift := int(round(amp * math.sin(omega * t + phase)))) != 0:
            np.add(buf_y, np.uint8(shift % 256), out=buf_y)   # wraps to a subtraction when < 0
        self.t += 1


class _Object:
    """A textured sprite moving across the frame (with a wobble) for a random lifetime."""

    def __init__(self, rng: np.random.Generator, width: int, height: int, fps: int, t0: int, fresh: bool):
        s = height / 720
        oh, ow = 2 * max(4, int(rng.uniform(20, 110) * s)), 2 * max(4, int(rng.uniform(20, 140) * s))
        gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
        tex = _noise(gen, oh + 1, ow + 1, cell=max(oh, ow) / 2, finest=2.0, persistence=0.8)
        gy = np.linspace(-1, 1, oh + 1, dtype=np.float32)[:, None] * rng.uniform(-40, 40)
        gx = np.linspace(-1, 1, ow + 1, dtype=np.float32)[None, :] * rng.uniform(-40, 40)
        self.y = _phases(rng.uniform(40, 220) + gy + gx + rng.uniform(8, 25) * tex)   # [fy][fx] -> [oh, ow]
        self.u = _to_u8(np.full((oh // 2, ow // 2), 128 + rng.uniform(-50, 50)) + 5 * tex[:-1:2, :-1:2])
        self.v = _to_u8(np.full((oh // 2, ow // 2), 128 + rng.uniform(-50, 50)) + 5 * tex[:-1:2, :-1:2])
        if rng.random() < 0.5:
            self.mask = _ellipse(oh, ow)
        else:
            self.mask = np.ones((oh, ow), bool)
            self.mask[: max(2, oh // 8), : max(2, ow // 8)] = False    # a notched rectangle
        self.cmask = self.mask[::2, ::2]
        # start anywhere (or just off an edge for objects that enter later), move 0.5-5 px/frame
        speed = rng.uniform(0.5, 5.0) * s
        angle = rng.uniform(0, 2 * np.pi)
        self.vx, self.vy = speed * np.cos(angle), speed * np.sin(angle)
        self.x0, self.y0 = rng.uniform(-ow / 2, width - ow / 2), rng.uniform(-oh / 2, height - oh / 2)
        if fresh and rng.random() < 0.6:          # enter from the edge it is moving away from
            if abs(self.vx) > abs(self.vy):
                self.x0 = -ow if self.vx > 0 else width
            else:
                self.y0 = -oh if self.vy > 0 else height
        self.wobble = rng.uniform(0, 12) * s
        self.wperiod = rng.uniform(1, 4) * fps
        self.t0 = t0
        self.t1 = t0 + int(rng.uniform(2, 12) * fps)
        self.width, self.height, self.oh, self.ow = width, height, oh, ow

    def pos(self, t: int) -> tuple[float, float]:
        dt = t - self.t0
        return (self.x0 + self.vx * dt,
                self.y0 + self.vy * dt + self.wobble * math.sin(2 * math.pi * dt / self.wperiod))

    def alive(self, t: int) -> bool:
        if t >= self.t1:
            return False
        x, y = self.pos(t)
        return -self.ow * 2 < x < self.width + self.ow and -self.oh * 2 < y < self.height + self.oh

    def render(self, t: int, buf_y, buf_u, buf_v) -> None:
        x, y = self.pos(t)
        (ix, fx), (iy, fy) = _subpel(x), _subpel(y)
        _paint(buf_y, iy, ix, self.y[fy][fx], self.mask)
        cx, cy = int(round(x / 2)), int(round(y / 2))
        _paint(buf_u, cy, cx, self.u, self.cmask)
        _paint(buf_v, cy, cx, self.v, self.cmask)


def render_frames(n: int, width: int, height: int, fps: int, seed: int = 0):
    """Yields `n` frames as yuv420p arrays [height * 3 // 2, width] (PyAV's layout). The same
    array is reused: copy it (av.VideoFrame.from_ndarray does) before asking for the next one."""
    rng = np.random.default_rng([seed, 0])
    noise = np.clip(np.round(rng.normal(0, NOISE_SIGMA, size=(NOISE_PLANES, height, width))), -4, 4)
    noise = noise.astype(np.int8).view(np.uint8)           # added with uint8 wrap-around = ±4
    buf = np.empty((height * 3 // 2, width), np.uint8)
    flat = buf.reshape(-1)
    q = width * height // 4
    buf_y = flat[: 4 * q].reshape(height, width)
    buf_u = flat[4 * q: 5 * q].reshape(height // 2, width // 2)
    buf_v = flat[5 * q:].reshape(height // 2, width // 2)
    t, scene_no, scene, scene_end = 0, 0, None, 0
    last = -1
    while t < n:
        if t >= scene_end:
            srng = np.random.default_rng([seed, 1, scene_no])
            scene_end = t + int(srng.uniform(20, 40) * fps)
            scene = _Scene(srng, width, height, fps)
            scene_no += 1
        scene.render(buf_y, buf_u, buf_v)
        j = int(rng.integers(NOISE_PLANES - 1))
        last = j = j + (j >= last)                          # never the same noise twice in a row
        np.add(buf_y, noise[j], out=buf_y)
        yield buf
        t += 1
