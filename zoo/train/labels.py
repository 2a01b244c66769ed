"""Training-only targets of the toy recipe, computed from a world's exact truth: what is on each
visual token's cell (`cell_labels`), what changed there (`event_labels`), which visual tokens show
each event (`event_tokens`), and the attention masks of the two looking losses (`grounding_mask`,
`chain_mask`). None of them is part of a saved model.

A visual token is one cell of the 3x3 board in one temporal step; tokens are numbered row-major
cell by cell, step after step, as the video's placeholders sit in the prompt.
"""

from __future__ import annotations

import math

import torch

from zoo import captions
from zoo import world as toy

# What each visual token should be able to tell (`aux_weight`): the object on its cell of the 3x3
# board (shape, color, size; 0 = none), the background, and where the cell is (row, column).
# Where, because Qwen2.5-VL's MRoPE gives the height and width positions the lowest rotary
# frequencies (its sections are contiguous, time first): a cell's row and column barely turn a
# head's query, so the language model cannot read them from the positions (`python -m
# tools.locations` probes for them). Real Qwen2.5-VL checkpoints learn to put the location into
# the token's content from grounding data; this probe is the toy's grounding data.
AUX = {"shape": (None, *toy.SHAPES), "color": (None, *toy.COLORS), "size": (None, *toy.SIZES),
       "background": toy.BACKGROUNDS, "row": ("top", "middle", "bottom"), "column": ("left", "middle", "right")}


def cell_labels(world: toy.World, fps: float, n_frames: int, frames_per_token: int) -> torch.Tensor:
    """int64 [ceil(n_frames / frames_per_token) * 9, len(AUX)]: for each visual token (row-major
    cells of each temporal step), what is on its cell in the step's last frame and where the cell
    is, as indices into AUX."""
    steps = math.ceil(n_frames / frames_per_token)
    times = [min(k * frames_per_token + frames_per_token - 1, n_frames - 1) / fps for k in range(steps)]
    rows = []
    for scene in toy._scenes(world, times):
        cells = [[0, 0, 0] for _ in range(toy.GRID * toy.GRID)]
        for sp in scene.sprites:
            r, c = min(int(sp.y), toy.GRID - 1), min(int(sp.x), toy.GRID - 1)
            cells[r * toy.GRID + c] = [AUX["shape"].index(sp.shape), AUX["color"].index(sp.color),
                                       AUX["size"].index(sp.size)]
        rows += [[*cell, AUX["background"].index(scene.background), i // toy.GRID, i % toy.GRID]
                 for i, cell in enumerate(cells)]
    return torch.tensor(rows)


# What changed on each visual token's cell during its temporal step (`event_weight`, read from a
# middle layer of the language model, where a token can compare itself with the same cell one
# step earlier): describing a video is change detection over time (which way a move went, whether
# an event happened once or twice), which the per-frame probe above does not teach. A move marks
# its source cell ("leave") when the glide starts and its destination cell with its direction when
# the glide ends; a background change marks every cell.
EVENT_CLASSES = ("none", "appear", "disappear", *toy.DIRECTIONS, "leave", "recolor", "grow", "shrink", "background")


def _first_step(t: float, fps: float, frames_per_token: int) -> int:
    """The temporal step of the first frame that shows the world at `t` s or later (frame k shows k / fps s)."""
    return math.ceil(round(t * fps, 6)) // frames_per_token


def event_labels(world: toy.World, fps: float, n_frames: int, frames_per_token: int) -> torch.Tensor:
    """int64 [ceil(n_frames / frames_per_token) * 9]: for each visual token (row-major cells of each
    temporal step), the index in EVENT_CLASSES of what changed on its cell in that step: the step of
    the first frame that shows the event (frame k shows the world at k / fps s)."""
    steps = math.ceil(n_frames / frames_per_token)
    labels = torch.zeros(steps, toy.GRID * toy.GRID, dtype=torch.int64)

    def mark(t: float, cell, name: str) -> None:
        step = _first_step(t, fps, frames_per_token)
        if step < steps:
            cells = range(toy.GRID * toy.GRID) if cell is None else [cell[1] * toy.GRID + cell[0]]
            for c in cells:
                if labels[step, c] == 0:
                    labels[step, c] = EVENT_CLASSES.index(name)

    where: dict[int, tuple[int, int]] = {}
    for e, cell in zip(world.truth.events, world.cells):
        if e.kind == "background":
            if e.time > 0:
                mark(e.time, None, "background")
        elif e.kind == "appear":
            where[e.obj] = cell
            mark(e.time, cell, "appear")
        elif e.kind == "move":
            mark(e.time, where[e.obj], "leave")
            mark(e.time + toy.MOVE_S, cell, e.change)
            where[e.obj] = cell
        else:
            mark(e.time, where[e.obj], e.kind)
            if e.kind == "disappear":
                del where[e.obj]
    return labels.reshape(-1)


# Where the answer should look (`ground_weight`): knowing what is on each cell and what changed
# there is not enough if the text does not find the event it is describing; the typical failure
# is naming the wrong object or direction. So one head of one upper layer is told where that is:
# while the answer states event j, the head should put its attention on the visual tokens that show
# event j (temporal grounding, the kind of data real Video-LLMs are trained on).

def event_tokens(world: toy.World, fps: float, n_frames: int, frames_per_token: int, *,
                 before: bool = False) -> list[list[int]]:
    """For each event of the world's truth (in order), the indices among the video's visual tokens
    (row-major cells of each temporal step) that show it: the object's cell in the step of the
    first frame showing the event (for a move, the cell it leaves and, when the glide ends, the
    cell it reaches); every cell for a background change. Empty when it falls after the last step.
    `before`: for a disappearance, recolor or size change, also the cell one step earlier, which
    still shows the object as the clause names it (the step of the change shows it gone or changed)."""
    steps = math.ceil(n_frames / frames_per_token)
    cells_per_step = toy.GRID * toy.GRID

    def at(t: float, cell) -> list[int]:
        step = _first_step(t, fps, frames_per_token)
        if step >= steps:
            return []
        where = range(cells_per_step) if cell is None else [cell[1] * toy.GRID + cell[0]]
        return [step * cells_per_step + c for c in where]

    where: dict[int, tuple[int, int]] = {}
    out = []
    for e, cell in zip(world.truth.events, world.cells):
        if e.kind == "background":
            out.append(at(e.time, None))
        elif e.kind == "appear":
            where[e.obj] = cell
            out.append(at(e.time, cell))
        elif e.kind == "move":
            out.append(at(e.time, where[e.obj]) + at(e.time + toy.MOVE_S, cell))
            where[e.obj] = cell
        else:
            shown = at(e.time, where[e.obj])
            earlier = [i - cells_per_step for i in shown if i >= cells_per_step] if before else []
            out.append(earlier + shown)
            if e.kind == "disappear":
                del where[e.obj]
    return out


def answer_events(truth: toy.Truth, answer: str) -> list[int] | None:
    """The events an answer's clauses state, in order, when the answer is a description of the
    events from some point on (the description, "what happened after ..."); None otherwise."""
    for first in range(len(truth.events)):
        if answer == captions.caption(toy.Truth(truth.seconds, truth.events[first:])):
            return list(range(first, len(truth.events)))
    return None


def grounding_mask(truth: toy.Truth, answer: str, tokens: list[list[int]], answer_at: int, video_at: int,
                   width: int) -> torch.Tensor:
    """bool [width, width]: row q marks the positions the grounding head should attend to from
    position q, i.e. where the event is shown whose clause the token at q + 1 belongs to (the
    logits at q predict it). All False where the answer is not a description."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    stated = answer_events(truth, answer)
    if stated is None:
        return mask
    offset = answer_at
    for i in stated:
        n = len(captions.clause(truth.events[i]).split())
        if tokens[i]:
            where = torch.tensor(tokens[i]) + video_at
            for q in range(offset - 1, offset + n - 1):
                mask[q, where] = True
        offset += n
    return mask


# Keeping its place (`chain_weight`, with the data's `text_shift` and `clause_gap` and the losses'
# `ground_margin`): a grounding head that finds event j from where the text is learns a distance
# that only holds for the numbers of events it was trained on, and on longer videos it looks ever
# further ahead of the event it should state (`python -m tools.grounding` measures it by clause).
# What holds at any length is content: event j is the one that follows the event just stated. So
# one head of a middle layer is told to look, from the tokens showing event j, at the tokens
# showing event j - 1 (a few steps back: a short relative distance, the same in any video), which
# can put "what came before me" into event j's tokens, where the text's query (the clause it just
# wrote) can find it; and the text's positions are moved on at random (after the video, and after
# each clause: data.position_offsets), so that no distance says which event is next.

def chain_mask(tokens: list[list[int]], video_at: int, width: int) -> torch.Tensor:
    """bool [width, width]: row q (a visual token showing event j >= 1) marks the visual tokens
    showing event j - 1 that come before q (and do not also show event j); no target elsewhere."""
    mask = torch.zeros(width, width, dtype=torch.bool)
    for j in range(1, len(tokens)):
        mine = set(tokens[j])
        before = [i for i in tokens[j - 1] if i not in mine]
        for q in tokens[j]:
            cols = [video_at + i for i in before if i < q]
            if cols:
                mask[video_at + q, cols] = True
    return mask
