"""The toy video world: procedural videos with exact ground truth, the caption grammar that
describes them, and the scorer that checks a generated description against the truth.

No model weights can be downloaded here, so reelflow trains its own small Video-LLMs on this world:

    truth = make_video(seed=3, seconds=30, fps=2, size=112, path="toy.mp4")
    caption(truth)    # "the background is striped . a large red circle appears . the red circle moves left . ..."
    prompts(truth, rng)                  # [("describe the video .", caption), ("what happened after ...", ...), ...]
    score(generated_text, truth)         # {"precision": .., "recall": .., "f1": .., ...}

The world (all of it from `seed`): a grey background that is plain, striped or checkered and may
change (a scene boundary), and at most three objects, each on its own cell of a 3x3 grid, each a
shape (circle, square, triangle, star, ring), a color and a size (small or large). Events come
one every 2-6 s over the whole timeline (about 9 in 30 s, 32 in 2 min, 150 in 10 min): an object
appears, disappears, moves one cell (left, right, up, down), changes color, grows or shrinks, or
the background changes. Objects on screen always have different shapes, so "the <color> <shape>"
names exactly one object. The gaps are drawn before anything is known about the end, so a
shorter video's events are a prefix of a longer one's from the same seed.

Rendering is a pure function of (world, fps, size): frame k shows the world at k / fps s, each
object pasted (anti-aliased) over a precomputed background; `make_video` encodes with libx264.

The caption is one clause per event, in time order, from this grammar (`vocabulary()` lists
every word it and the prompts use; 44 words):

    the background is|turns <plain|striped|checkered> .
    a <small|large> <color> <shape> appears .
    the <color> <shape> disappears|grows|shrinks .
    the <color> <shape> moves <left|right|up|down> .
    the <color> <shape> turns <color> .

There are no time words ("then", "in the middle"): clause order already carries the order, which
is all the scorer checks, and coarse time words would depend on the video's length (the middle of
30 s and of 10 min), so a model would have to count frames to place them; they would cost tokens
on every clause without adding anything a scorer can check.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import numpy as np

__all__ = ["Event", "Truth", "World", "Sprite", "Scene", "make_world", "scene_at", "render", "make_video",
           "caption", "prompts", "parse", "score", "vocabulary", "SHAPES", "COLORS", "SIZES", "BACKGROUNDS",
           "DIRECTIONS"]

SHAPES = ("circle", "square", "triangle", "star", "ring")
# RGB, far apart in luma as well as chroma, so that 4:2:0 and a low bitrate at 64x64 cannot merge
# two of them (red/orange/yellow differ mostly in luma, blue/purple in red-difference chroma);
# all far from the grey backgrounds (100-145).
COLORS = {
    "red": (220, 30, 30),
    "green": (30, 170, 50),
    "blue": (30, 60, 230),
    "yellow": (245, 225, 20),
    "purple": (150, 40, 190),
    "orange": (255, 140, 0),
    "white": (250, 250, 250),
    "black": (10, 10, 10),
}
SIZES = ("small", "large")
BACKGROUNDS = ("plain", "striped", "checkered")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}   # (columns, rows)

GRID = 3                      # objects live on a GRID x GRID board of cells, one object a cell
# How likely an object appears / disappears, by how many are on screen (0..3): this keeps two or
# three there with steady churn, and never more than three ("a few"; appearing has weight 0 there).
# The other kinds weigh the same whatever the count (see make_world).
APPEAR_WEIGHT = (1.0, 0.6, 0.35, 0.0)
DISAPPEAR_WEIGHT = (0.0, 0.08, 0.15, 0.3)
GAP_S = (2.0, 6.0)            # between events; the shortest gap is what every state is shown for
END_S = 2.0                   # no event in the last 2 s, so each one's result is on screen at >= 0.5 fps
MOVE_S = 1.0                  # a move glides for this long (shorter than any gap: moves never overlap)
BACKGROUND_EVERY_S = 15.0     # at least this long between background changes (scenes, not flicker)
SIZE_OF = {"small": 0.18, "large": 0.30}   # sprite side / min(H, W); a cell is 1/3, so a large one fits


# ------------------------------------------------------------------------------------- truth

@dataclass(frozen=True)
class Event:
    """One thing that happens. For object events, `shape`, `color` and `size` are the object's
    before the event; `change` is what the event sets: the background kind, the direction of a
    move, or the new color."""

    time: float
    kind: str                     # background, appear, disappear, move, recolor, grow, shrink
    shape: str | None = None
    color: str | None = None
    size: str | None = None
    change: str | None = None
    obj: int = -1                 # which object (-1: the background); the caption does not say it

    def key(self) -> tuple[str, ...]:
        """What the event's clause states; a generated clause matches the event when keys are equal."""
        if self.kind == "background":
            return ("background", self.change)
        if self.kind == "appear":
            return ("appear", self.size, self.color, self.shape)
        if self.kind in ("move", "recolor"):
            return (self.kind, self.color, self.shape, self.change)
        return (self.kind, self.color, self.shape)


@dataclass(frozen=True)
class Truth:
    """What happens in a video: its length and its events in time order."""

    seconds: float
    events: tuple[Event, ...]

    def to_dict(self) -> dict:
        return {"seconds": self.seconds,
                "events": [{k: v for k, v in asdict(e).items() if v is not None} for e in self.events]}

    @classmethod
    def from_dict(cls, d: dict) -> Truth:
        return cls(float(d["seconds"]), tuple(Event(**e) for e in d["events"]))


@dataclass(frozen=True)
class World:
    """The truth plus what only rendering needs: each event's cell (column, row) for the object
    after it (None for background events and the rest, which stay where they are)."""

    seed: int
    seconds: float
    truth: Truth
    cells: tuple[tuple[int, int] | None, ...]


def make_world(seed: int, seconds: float, gap_s: tuple[float, float] = GAP_S) -> World:
    """A world of `seconds` s, deterministic in `seed` (and a prefix of any longer one from it).
    `gap_s`: the range the time between two events is drawn from (training draws denser worlds
    with it; everything else uses GAP_S)."""
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    if not MOVE_S <= gap_s[0] <= gap_s[1]:
        raise ValueError(f"gap_s={tuple(gap_s)}: need {MOVE_S} <= low <= high (a move glides for {MOVE_S} s, "
                         "and moves must not overlap)")
    rng = np.random.default_rng(seed)
    events: list[Event] = []
    cells: list[tuple[int, int] | None] = []
    objects: dict[int, dict] = {}         # on screen: id -> {"shape", "color", "size", "cell"}
    ids = itertools.count()

    def emit(t: float, kind: str, obj: int = -1, change: str | None = None, cell=None) -> None:
        o = objects.get(obj, {})
        events.append(Event(t, kind, o.get("shape"), o.get("color"), o.get("size"), change, obj))
        cells.append(cell)

    def appear(t: float) -> None:
        taken = {o["shape"] for o in objects.values()}
        occupied = {o["cell"] for o in objects.values()}
        shape = _pick(rng, [s for s in SHAPES if s not in taken])
        cell = _pick(rng, [(c, r) for r in range(GRID) for c in range(GRID) if (c, r) not in occupied])
        obj = next(ids)
        objects[obj] = {"shape": shape, "color": _pick(rng, list(COLORS)), "size": _pick(rng, SIZES), "cell": cell}
        emit(t, "appear", obj, cell=cell)

    background = _pick(rng, BACKGROUNDS)
    emit(0.0, "background", change=background)
    appear(0.0)
    t, last_background = 0.0, 0.0
    while True:
        t = round(t + rng.uniform(*gap_s), 2)
        if t > seconds - END_S:
            break
        occupied = {o["cell"] for o in objects.values()}
        moves = [(obj, d, cell) for obj, o in sorted(objects.items()) for d, cell in _neighbours(o["cell"])
                 if cell not in occupied]
        n = len(objects)
        weights = {
            "appear": APPEAR_WEIGHT[n],
            "disappear": DISAPPEAR_WEIGHT[n],
            "move": 0.3 if moves else 0.0,
            "recolor": 0.18 if n else 0.0,
            "resize": 0.12 if n else 0.0,
            "background": 0.07 if t - last_background >= BACKGROUND_EVERY_S else 0.0,
        }
        p = np.array(list(weights.values()))
        kind = list(weights)[rng.choice(len(p), p=p / p.sum())]
        if kind == "appear":
            appear(t)
        elif kind == "background":
            background = _pick(rng, [b for b in BACKGROUNDS if b != background])
            last_background = t
            emit(t, "background", change=background)
        elif kind == "move":
            obj, direction, cell = moves[rng.integers(len(moves))]
            emit(t, "move", obj, direction, cell)
            objects[obj]["cell"] = cell
        else:
            obj = _pick(rng, sorted(objects))
            o = objects[obj]
            if kind == "disappear":
                emit(t, "disappear", obj)
                del objects[obj]
            elif kind == "recolor":
                color = _pick(rng, [c for c in COLORS if c != o["color"]])
                emit(t, "recolor", obj, color)
                o["color"] = color
            else:
                kind = "grow" if o["size"] == "small" else "shrink"
                emit(t, kind, obj)
                o["size"] = "large" if kind == "grow" else "small"
    return World(seed, float(seconds), Truth(float(seconds), tuple(events)), tuple(cells))


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def _neighbours(cell: tuple[int, int]) -> list[tuple[str, tuple[int, int]]]:
    c, r = cell
    return [(d, (c + dc, r + dr)) for d, (dc, dr) in DIRECTIONS.items() if 0 <= c + dc < GRID and 0 <= r + dr < GRID]


# ------------------------------------------------------------------------------------ scenes

@dataclass(frozen=True)
class Sprite:
    """An object as it is on screen: `x`, `y` its centre in cell units (0..GRID; fractional
    while it moves)."""

    obj: int
    shape: str
    color: str
    size: str
    x: float
    y: float


@dataclass(frozen=True)
class Scene:
    background: str
    sprites: tuple[Sprite, ...]


def scene_at(world: World, t: float) -> Scene:
    """What is on screen at `t` s."""
    return next(_scenes(world, [t]))


def _scenes(world: World, times) -> Iterator[Scene]:
    """The scene at each of `times` (ascending), replaying the events once."""
    events, cells = world.truth.events, world.cells
    i, background = 0, None
    state: dict[int, dict] = {}            # id -> shape, color, size, cell, came_from, moved_at
    for t in times:
        while i < len(events) and events[i].time <= t:
            e, cell = events[i], cells[i]
            if e.kind == "background":
                background = e.change
            elif e.kind == "appear":
                state[e.obj] = {"shape": e.shape, "color": e.color, "size": e.size, "cell": cell,
                                "came_from": cell, "moved_at": -math.inf}
            elif e.kind == "disappear":
                del state[e.obj]
            elif e.kind == "move":
                o = state[e.obj]
                o.update(came_from=o["cell"], cell=cell, moved_at=e.time)
            elif e.kind == "recolor":
                state[e.obj]["color"] = e.change
            else:
                state[e.obj]["size"] = "large" if e.kind == "grow" else "small"
            i += 1
        sprites = []
        for obj, o in sorted(state.items()):
            a = min(max((t - o["moved_at"]) / MOVE_S, 0.0), 1.0)
            a = a * a * (3 - 2 * a)        # smoothstep: starts and stops gently, like a real glide
            (c0, r0), (c1, r1) = o["came_from"], o["cell"]
            sprites.append(Sprite(obj, o["shape"], o["color"], o["size"],
                                  c0 + a * (c1 - c0) + 0.5, r0 + a * (r1 - r0) + 0.5))
        yield Scene(background, tuple(sprites))


# --------------------------------------------------------------------------------- rendering

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
        encode_h264(render(world, fps, (h, w)), fps, str(path), crf=crf, gop_s=gop_s)
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
    encode_h264(render(make_world(seed, seconds), fps, hw, frames), fps, out, crf=crf, gop_s=gop_s,
                first_pts=frames.start, threads=1)
    return out


def _encode_pieces(seed, seconds, fps, hw, pieces: list[range], path: Path, *, crf, gop_s, workers: int) -> None:
    """Encodes each piece to its own mp4 in a temporary folder beside `path` (in `workers`
    processes), then copies their packets, in order, into `path`."""
    import concurrent.futures
    import multiprocessing
    import shutil
    import tempfile

    import av
    from tqdm import tqdm

    tmp = Path(tempfile.mkdtemp(prefix=f".{path.stem}.", dir=path.parent))
    try:
        jobs = [(seed, seconds, fps, hw, r, str(tmp / f"{i:05d}.mp4"), crf, gop_s) for i, r in enumerate(pieces)]
        # spawn, not fork: the caller may hold threads (torch, the engine's workers)
        with concurrent.futures.ProcessPoolExecutor(max(1, workers), mp_context=multiprocessing.get_context("spawn")) as pool:
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


def encode_h264(frames, fps: float, out, *, crf: int = 18, gop_s: float = 2.0, first_pts: int = 0,
                threads: int | None = None) -> None:
    """Encodes RGB frames (uint8 [H, W, 3] each) as H.264 (yuv420p, a keyframe every `gop_s` s, no
    scene-cut keyframes) into an mp4 at `out`, a path or a writable binary file. The first frame is
    shown at `first_pts` / fps s (a piece of a longer video); threads: libx264's (None: its own choice)."""
    import av

    rate = Fraction(fps).limit_denominator(1001)
    gop = max(1, round(gop_s * fps))
    with av.open(out, "w", format="mp4") as container:
        stream = None
        for i, rgb in enumerate(frames):
            if stream is None:
                stream = container.add_stream("libx264", rate=rate)
                stream.width, stream.height, stream.pix_fmt = rgb.shape[1], rgb.shape[0], "yuv420p"
                stream.options = {"preset": "veryfast", "crf": str(crf),
                                  "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0"}
                if threads is not None:
                    stream.options |= {"threads": str(threads)}
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")   # converted to yuv420p by the encoder
            frame.pts, frame.time_base = first_pts + i, 1 / rate
            container.mux(stream.encode(frame))
        if stream is not None:
            container.mux(stream.encode(None))


# ----------------------------------------------------------------------------------- grammar

_VERB = {"appear": "appears", "disappear": "disappears", "move": "moves", "recolor": "turns",
         "grow": "grows", "shrink": "shrinks"}
_KIND = {verb: kind for kind, verb in _VERB.items()}
_PROMPT_WORDS = ("describe", "video", "what", "happened", "after", "appeared", "color", "at", "end", "nothing")


def vocabulary() -> list[str]:
    """Every word the captions, prompts and answers can contain, '.' and '?' included."""
    words = ["the", "a", "background", "is", *_VERB.values(), *SIZES, *COLORS, *SHAPES, *BACKGROUNDS,
             *DIRECTIONS, *_PROMPT_WORDS, ".", "?"]
    assert len(set(words)) == len(words)
    return words


def _clause(e: Event) -> str:
    if e.kind == "background":   # the first background is stated, later ones are changes
        return f"the background {'is' if e.time == 0 else 'turns'} {e.change} ."
    if e.kind == "appear":
        return f"a {e.size} {e.color} {e.shape} appears ."
    return " ".join(["the", e.color, e.shape, _VERB[e.kind], *([e.change] if e.change else []), "."])


def caption(truth: Truth) -> str:
    """The reference description: one clause per event, in time order ('' when there are none)."""
    return " ".join(_clause(e) for e in truth.events)


def prompts(truth: Truth, rng) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs: the description, what happened after one appearance
    (one whose color and shape no other appearance has, so the question names one event), and
    the color of one object on screen at the end (when there is one). `rng`: a seed or a
    numpy Generator."""
    rng = np.random.default_rng(rng)
    events = truth.events
    pairs = [("describe the video .", caption(truth))]
    appearances = Counter((e.color, e.shape) for e in events if e.kind == "appear")
    unique = [i for i, e in enumerate(events) if e.kind == "appear" and appearances[e.color, e.shape] == 1]
    if unique:
        i = _pick(rng, unique)
        rest = caption(Truth(truth.seconds, events[i + 1:]))
        pairs.append((f"what happened after the {events[i].color} {events[i].shape} appeared ?", rest or "nothing ."))
    final = _colors_at_end(truth)
    if final:
        shape = _pick(rng, sorted(final))
        pairs.append((f"what color is the {shape} at the end ?", f"{final[shape]} ."))
    return pairs


def _colors_at_end(truth: Truth) -> dict[str, str]:
    """shape -> color of each object on screen at the end (shapes on screen are distinct)."""
    on_screen: dict[int, list[str]] = {}
    for e in truth.events:
        if e.kind == "appear":
            on_screen[e.obj] = [e.shape, e.color]
        elif e.kind == "disappear":
            del on_screen[e.obj]
        elif e.kind == "recolor":
            on_screen[e.obj][1] = e.change
    return dict(on_screen.values())


# ------------------------------------------------------------------------------------ scorer

def parse(text: str) -> list[tuple[str, ...]]:
    """The event keys (see Event.key) a text states, in order. Clauses end at '.', '?', '!', ';'
    or ','; a clause that is not exactly one of the grammar's forms (an unknown word, a missing
    or extra word) states nothing."""
    keys = []
    for clause in re.split(r"[.?!;,]", text.lower()):
        match clause.split():
            case ["the", "background", "is" | "turns", kind] if kind in BACKGROUNDS:
                keys.append(("background", kind))
            case ["a", size, color, shape, "appears"] if size in SIZES and color in COLORS and shape in SHAPES:
                keys.append(("appear", size, color, shape))
            case ["the", color, shape, "disappears" | "grows" | "shrinks" as verb] if color in COLORS and shape in SHAPES:
                keys.append((_KIND[verb], color, shape))
            case ["the", color, shape, "moves", direction] if color in COLORS and shape in SHAPES and direction in DIRECTIONS:
                keys.append(("move", color, shape, direction))
            case ["the", color, shape, "turns", new] if color in COLORS and shape in SHAPES and new in COLORS:
                keys.append(("recolor", color, shape, new))
    return keys


def score(text: str, truth: Truth) -> dict:
    """Event-level precision, recall and F1 of `text` against the truth.

    A generated event matches a true one when its kind and the object's attributes agree (equal
    keys). The matching is the longest common subsequence of the two event sequences: the most
    pairs that keep both time orders. Greedy in-order matching could let one early false match
    use up a true event that a later clause should have taken; order-free (bag) matching would
    credit a right event told in the wrong place ('turns green' before 'appears'). Clauses that
    do not parse are not counted at all; nothing parsed gives 0 (unless the truth has no events
    either)."""
    generated, reference = parse(text), [e.key() for e in truth.events]
    matched = _lcs_length(generated, reference)
    if not generated or not reference:
        p = r = f1 = float(not generated and not reference)
    else:
        p, r = matched / len(generated), matched / len(reference)
        f1 = 2 * p * r / (p + r) if matched else 0.0
    return {"precision": p, "recall": r, "f1": f1, "matched": matched,
            "generated": len(generated), "reference": len(reference)}


def _lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence, bit-parallel (Allison & Dix 1986; Hyyrö 2004):
    one Python int holds a whole DP column, so a 10-min video's 150 events cost 150 big-int
    steps, not 150 x 150 Python ones."""
    positions: dict = {}
    for i, x in enumerate(a):
        positions[x] = positions.get(x, 0) | (1 << i)
    everything = (1 << len(a)) - 1
    v = everything
    for y in b:
        u = v & positions.get(y, 0)
        v = ((v + u) | (v - u)) & everything
    return len(a) - v.bit_count()


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
