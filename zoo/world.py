"""The toy video world: procedural worlds of objects and events with exact ground truth.

No model weights can be downloaded here, so reelflow trains its own small Video-LLMs on this world.
This module holds what happens and when; `zoo.render` turns a world into frames and H.264 videos,
`zoo.captions` describes it (the caption grammar) and scores a description against its truth:

    world = make_world(seed=3, seconds=30)
    truth = make_video(seed=3, seconds=30, fps=2, size=112, path="toy.mp4")      # zoo.render
    caption(truth)    # "the background is striped . a large red circle appears . ..."   zoo.captions
    score(generated_text, truth)         # {"precision": .., "recall": .., "f1": .., ...}

The world (all of it from `seed`): a grey background that is plain, striped or checkered and may
change (a scene boundary), and at most three objects, each on its own cell of a 3x3 grid, each a
shape (circle, square, triangle, star, ring), a color and a size (small or large). Events come
one every 2-6 s over the whole timeline (about 9 in 30 s, 32 in 2 min, 150 in 10 min): an object
appears, disappears, moves one cell (left, right, up, down), changes color, grows or shrinks, or
the background changes. Objects on screen always have different shapes, so "the <color> <shape>"
names exactly one object. The gaps are drawn before anything is known about the end, so a
shorter video's events are a prefix of a longer one's from the same seed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

__all__ = ["Event", "Truth", "World", "Sprite", "Scene", "make_world", "scene_at", "SHAPES", "COLORS", "SIZES",
           "BACKGROUNDS", "DIRECTIONS"]

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
