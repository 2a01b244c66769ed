"""Trains a toy-zoo model on the toy world and saves it as a transformers checkpoint (bf16
safetensors + tokenizer + preprocessor config), the way a real checkpoint is saved:

    python -m run +experiment=train_toy train.model=qwen-target          # one model
    python -m run -m +experiment=train_toy train.model=qwen-target,qwen-draft,llava-target,llava-draft

Each step draws a batch of fresh worlds (training seeds start at TRAIN_SEED0; held-out seeds
are below it) of one length drawn from a range that starts short (`warm_seconds`: one to three
events, so the model first learns to look at the video: trained on 8-32 s from the start, a 6 M
model sat on the video-blind loss plateau for 500+ steps, measured) and widens to `seconds`, renders
them to frames (straight, or through H.264 with `codec`: the round trip changes pixels by only
~0.5/255 on average, yet the LLaVA target trained without it lost F1 on decoded videos, measured;
`dense_gap` draws a share of the worlds with events closer together), and asks a
prompt from `zoo.world.prompts`: the description most of the time, a follow-up question
otherwise. Loss is next-token cross-entropy on the answer and its closing <|im_end|>, plus (training only,
`aux_weight`) a linear probe on every visual token predicting what is on its cell of the 3x3 board
(shape, color, size, background; `cell_labels`): a dense perception signal, since the caption
loss alone reaches the vision tower only through a few content words per event (measured: the
probe's loss falls to ~0.06 within 400 draft steps while the caption loss is still high). Two more
training-only targets: an event probe at the middle layer (what changed on each token's cell) and a
grounding loss on one upper-layer head (while the answer states an event, look where it is shown);
see EVENT_CLASSES and event_tokens. None of them is part of the saved model.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from models.preprocess import (
    CLIP_MEAN,
    CLIP_STD,
    SIGLIP_MEAN,
    SIGLIP_STD,
    qwen_video_patches,
    siglip_video_pixels,
)
from models.prompt import video_prompt_ids
from video import h264
from zoo import WEIGHTS, captions, videos
from zoo import world as toy
from zoo.shapes import FPS, FRAME_SIZE, SHAPES, zoo_config
from zoo.tokenizer import build_tokenizer

log = logging.getLogger("reelflow.train")

TRAIN_SEED0 = 1_000_000       # training worlds use seeds >= this; evaluation uses seeds below
MAX_CLAUSES = 64              # more than any training answer states (a 32-s video has ~12 events)


@dataclass
class Example:
    frames: torch.Tensor      # uint8 [n, 3, H, W]
    prompt: str
    answer: str | None
    truth: toy.Truth
    world: toy.World | None = None
    fps: float | None = None  # the frame rate it was rendered at (None: the zoo's, FPS)


def example(seed: int, seconds: float, fps: float, rng: np.random.Generator | None = None, *,
            describe_share: float = 0.7, codec: bool = False, gap_s: tuple[float, float] = toy.GAP_S) -> Example:
    """World `seed` rendered at `fps`; with `rng`, a prompt drawn from the world's prompts
    (the description with probability `describe_share`), else the description. `codec`: the frames
    as decoded from an H.264 file of them (make_video's settings) instead of as rendered. `gap_s`:
    the range of times between events (see Batches.gaps)."""
    world = toy.make_world(seed, seconds, gap_s)
    rendered = np.stack(list(videos.render(world, fps, FRAME_SIZE)))
    frames = torch.from_numpy(h264_round_trip(rendered, fps) if codec else rendered).permute(0, 3, 1, 2).contiguous()
    pairs = captions.prompts(world.truth, rng if rng is not None else seed)
    if rng is not None and len(pairs) > 1 and rng.random() > describe_share:
        prompt, answer = pairs[1 + int(rng.integers(len(pairs) - 1))]
    else:
        prompt, answer = pairs[0]
    return Example(frames, prompt, answer, world.truth, world, fps)


def h264_round_trip(frames: np.ndarray, fps: float) -> np.ndarray:
    """uint8 [n, H, W, 3] frames as they come back from an H.264 mp4 of them (4:2:0 chroma and
    compression artifacts, what a model sees at inference): measured, the LLaVA target trained on
    rendered frames scored F1 0.889 / 0.941 on two videos rendered, 0.667 / 0.353 decoded."""
    import io

    import av

    buffer = io.BytesIO()
    h264.encode_h264(iter(frames), fps, buffer)
    buffer.seek(0)
    with av.open(buffer) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


# What each visual token should be able to tell (a training-only auxiliary target): the object
# on its cell of the 3x3 board (shape, color, size; 0 = none), the background, and where the cell
# is (row, column). Where: Qwen2.5-VL's MRoPE gives the height and width positions the lowest
# rotary frequencies (its sections are contiguous, time first), so a cell's row and column turn a
# head's query by at most 0.2 and 0.007 rad in the toy target: the language model cannot read
# them from the positions, and a linear probe on the shipped target's visual tokens finds an
# object's row / column at chance (0.32 / 0.25; `python -m tools.locations`). Real Qwen2.5-VL checkpoints learn to put the
# location into the token's content from grounding data; this probe is the toy's grounding data.
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


# What changed on each visual token's cell during its temporal step (a second training-only target,
# read from a middle layer of the language model, where a token can compare itself with the same
# cell one step earlier): caption errors of the first zoo were mostly wrong move directions and
# repeated or skipped events, i.e. change detection over time, which the per-frame probe above
# does not teach. A move marks its source cell ("leave") when the glide starts and its destination
# cell with its direction when the glide ends; a background change marks every cell.
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


# Where the answer should look (a third training-only target, `ground_weight`): with the two probes
# above the visual tokens know what is on their cell and what changed there, yet the descriptions
# still named the wrong object or direction (a target trained with both: F1 0.94 on 10-s videos,
# 0.64 on 30-s ones, "moves right" for most moves): the text does not find the event it is
# describing. So one head of one upper layer is told where that is: while the answer states event
# j, the head should put its attention on the visual tokens that show event j (temporal grounding,
# the kind of data real Video-LLMs are trained on).

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
        n = len(captions._clause(truth.events[i]).split())
        if tokens[i]:
            where = torch.tensor(tokens[i]) + video_at
            for q in range(offset - 1, offset + n - 1):
                mask[q, where] = True
        offset += n
    return mask


def model_inputs(config, tokenizer, examples: list[Example], *, with_answers: bool,
                 stretch: list[float] | None = None, moves: list[tuple[int, list[int]]] | None = None,
                 ground_before: bool = False) -> dict:
    """The batch as the transformers model's forward takes it: right-padded ids, the video's
    pixels, and (with answers) labels that score only the answer and its <|im_end|>, plus the
    training-only per-token targets. `stretch` (Qwen2.5-VL, training only): per example, a factor
    on the seconds each temporal patch spans, which spreads the video's temporal positions over a
    longer range (see Batches); `moves` (training only): per example, how far the positions of its
    text after the video move on, and how much further after each clause of its answer (see
    chain_mask); the batch's `position_offset` [batch, seq] carries them to step_losses.
    `ground_before`: the grounding targets include the step before a change (event_tokens)."""
    arch = config.model_type
    rows, labels, pixels, grids, cells, events, grounds, chains, afters = [], [], [], [], [], [], [], [], []
    rates = [ex.fps or FPS[arch] for ex in examples]
    for ex, fps in zip(examples, rates):
        step = config.vision_config.temporal_patch_size if arch == "qwen2_5_vl" else 1
        if with_answers and ex.world is not None:
            cells.append(cell_labels(ex.world, fps, ex.frames.shape[0], step))
            events.append(event_labels(ex.world, fps, ex.frames.shape[0], step))
        if arch == "qwen2_5_vl":
            flat, (t, h, w) = qwen_video_patches(ex.frames, CLIP_MEAN, CLIP_STD)
            pixels.append(flat)
            grids.append((t, h, w))
            n_video, placeholder = t * h * w // 4, config.video_token_id
        else:
            pixels.append(siglip_video_pixels(ex.frames, SIGLIP_MEAN, SIGLIP_STD))
            side = math.ceil(config.vision_config.image_size // config.vision_config.patch_size / 2)
            n_video, placeholder = ex.frames.shape[0] * side * side + 1, config.video_token_index
        ids, video_at = video_prompt_ids(tokenizer, ex.prompt, placeholder, n_video)
        if with_answers and ex.world is not None:
            tokens = event_tokens(ex.world, fps, ex.frames.shape[0], step)
            shown = event_tokens(ex.world, fps, ex.frames.shape[0], step, before=True) if ground_before else tokens
            grounds.append((ex.truth, ex.answer, shown, len(ids), video_at))
            chains.append((tokens, video_at))
        afters.append((video_at + n_video, len(ids)))
        target = []
        if with_answers:
            target = tokenizer(ex.answer, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        rows.append(ids + target)
        labels.append([-100] * len(ids) + target)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    batch = {"input_ids": input_ids, "attention_mask": mask}
    if with_answers:
        batch["labels"] = torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels])
        if len(cells) == len(rows):
            batch["cell_labels"] = torch.stack(cells) if arch != "qwen2_5_vl" else torch.cat(cells)
            batch["event_labels"] = torch.cat(events)
            batch["ground_mask"] = torch.stack([grounding_mask(*g, width) for g in grounds])
            batch["chain_mask"] = torch.stack([chain_mask(*c, width) for c in chains])
    if moves is not None:
        dot = tokenizer.convert_tokens_to_ids(".")
        batch["position_offset"] = torch.tensor([
            position_offsets(row, after, answer_at, dot, shift, gaps) + [0] * (width - len(row))
            for row, (after, answer_at), (shift, gaps) in zip(rows, afters, moves)])
    if arch == "qwen2_5_vl":
        batch["pixel_values_videos"] = torch.cat(pixels)
        batch["video_grid_thw"] = torch.tensor(grids)
        patch = config.vision_config.temporal_patch_size
        batch["second_per_grid_ts"] = torch.tensor([patch / fps * f for fps, f in zip(rates, stretch or [1.0] * len(rows))])
        batch["mm_token_type_ids"] = (input_ids == config.video_token_id).int() * 2
    else:
        batch["pixel_values_videos"] = torch.stack(pixels)
    return batch


# Keeping its place (the fourth training-only target, `chain_weight`, with `text_shift`, `clause_gap`
# and `ground_margin`): trained on videos of <= 32 s, the target states <= ~12 events per answer, and
# on 120-s videos its grounding head followed the first events and then looked ever further ahead
# of the event it should state (`python -m tools.grounding`: mass on the right event 0.65 over
# clauses 1-12, 0.03 from the 13th). It found event j from where the text is, a distance that only
# holds for the lengths it was trained on. What holds at any length is content: event j is the one
# that follows the event just stated. So one head of a middle layer is told to look, from the tokens
# showing event j, at the tokens showing event j - 1 (a few steps back: a short relative distance,
# the same in any video), which can put "what came before me" into event j's tokens, where the
# text's query (the clause it just wrote) can find it; and the text's positions are moved on at
# random (after the video, and after each clause), so that no distance says which event is next.

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


def position_offsets(row: list[int], after_video: int, answer_at: int, dot: int, shift: int,
                     gaps: list[int]) -> list[int]:
    """Per token of `row`, what to add to its position: `shift` from `after_video` on, and from the
    answer (at `answer_at`) on, gaps[k] more after its k-th clause (the k-th `dot`) and later."""
    out = [0] * after_video + [shift] * (len(row) - after_video)
    extra, clause = 0, 0
    for i in range(answer_at, len(row)):
        out[i] += extra
        if row[i] == dot and clause < len(gaps):
            extra += gaps[clause]
            clause += 1
    return out


def shifted_positions(net, batch: dict, add: torch.Tensor) -> torch.Tensor:
    """The positions the model would give `batch`, plus `add` [batch, seq] (Qwen2.5-VL: its 3-D
    MRoPE ids [3, batch, seq], the same added to all three; LLaVA: 1-D ids [batch, seq])."""
    ids, attention = batch["input_ids"], batch["attention_mask"]
    qwen = net.config.model_type == "qwen2_5_vl"
    if qwen:
        positions, _ = net.model.get_rope_index(ids, batch["mm_token_type_ids"], video_grid_thw=batch["video_grid_thw"],
                                                second_per_grid_ts=batch["second_per_grid_ts"], attention_mask=attention)
        return positions + add[None].to(positions.dtype)
    return (attention.long().cumsum(-1) - 1).clamp_min(0) + add


class Batches(torch.utils.data.IterableDataset):
    """Endless training batches; each DataLoader worker draws its own seeds."""

    def __init__(self, name: str, batch_size: int, seconds: tuple[float, float], seed: int,
                 warm_seconds: tuple[float, float] | None = None, ramp_batches: int = 0, stretch: float = 1.0,
                 text_shift: int = 0, clause_gap: int = 0, ground_before: bool = False, codec: bool = False,
                 dense_gap: tuple[float, float] | None = None, dense_share: float = 0.5,
                 fps_scale: tuple[int, int] | None = None, fps_share: float = 0.5):
        self.name, self.batch_size, self.seconds, self.seed = name, batch_size, seconds, seed
        self.warm_seconds, self.ramp_batches, self.stretch = warm_seconds or seconds, ramp_batches, stretch
        self.text_shift, self.clause_gap, self.ground_before = text_shift, clause_gap, ground_before
        self.codec, self.dense_gap, self.dense_share = codec, dense_gap, dense_share
        self.fps_scale, self.fps_share = fps_scale, fps_share

    def frame_rate(self, rng: np.random.Generator, fps: float) -> float:
        """The batch's frame rate: the zoo's `fps`, or for a `fps_share` of the batches that times
        an integer drawn from `fps_scale` (dynamic frame rates, as Qwen2.5-VL is trained with).
        Why: a 30-s video at 4x the frame rate has as many visual tokens as a 120-s one at the
        zoo's, and the Qwen target of stage 8, shown either, wrote runs of "." where its first
        event should be (README, "More frames, same video"): it failed on the number of tokens as
        well as on the number of events. The video stays of training length, with its events."""
        if self.fps_scale is None or rng.random() >= self.fps_share:
            return fps
        return fps * int(rng.integers(self.fps_scale[0], self.fps_scale[1] + 1))

    def gaps(self, rng: np.random.Generator) -> list[tuple[float, float]]:
        """Per example, the range its world's times between events are drawn from: `dense_gap` for a
        `dense_share` of them, else the world's own. Why: an answer states one clause per event, and
        a model trained on <= 32-s worlds (<= ~12 events) has never written a 13th clause, which a
        2-min video needs ~30 of (measured: the grammar itself broke down after ~10 clauses at
        120 s). A denser world of training length gives long answers without long videos. Measured
        (README, "Keeping its place"): 1.5-3 s for 30 % helped at 30 s and 120 s; 1-1.5 s for half,
        or 1.25-2.5 s for 40 %, broke the greedy description of long videos."""
        if self.dense_gap is None:
            return [toy.GAP_S] * self.batch_size
        return [tuple(self.dense_gap) if rng.random() < self.dense_share else toy.GAP_S for _ in range(self.batch_size)]

    def stretches(self, rng: np.random.Generator) -> list[float] | None:
        """Per example, the factor on its temporal position spacing: 1 for half the examples, else
        uniform in [1, stretch]. Why: RoPE attention depends on relative positions, and a model
        trained on videos up to 32 s never sees a question 100 temporal positions after the first
        frame, which a 2-min video puts there (measured: the first zoo's target broke down from the
        first clause on 120-s videos). Stretching shows it those distances at the cost of a short
        video, as randomized positional encodings do for length generalization (Ruoss et al. 2023)."""
        if self.stretch <= 1.0 or SHAPES[self.name][0] != "qwen2_5_vl":
            return None
        return [1.0 if rng.random() < 0.5 else float(rng.uniform(1.0, self.stretch)) for _ in range(self.batch_size)]

    def moves(self, rng: np.random.Generator) -> list[tuple[int, list[int]]] | None:
        """Per example, how far its text's positions move on (chain_mask says why): nothing for half
        the examples; for the others a shift uniform in 1..text_shift after the video and a jump
        uniform in 0..clause_gap after each clause of the answer, so that neither the distance to
        the video nor the one to the answer's start says how many events have been stated."""
        if self.text_shift <= 0 and self.clause_gap <= 0:
            return None
        out = []
        for _ in range(self.batch_size):
            if rng.random() < 0.5:
                out.append((0, []))
            else:
                shift = int(rng.integers(1, self.text_shift + 1)) if self.text_shift > 0 else 0
                out.append((shift, rng.integers(0, self.clause_gap + 1, MAX_CLAUSES).tolist()))
        return out

    def lengths(self, batch: int) -> tuple[float, float]:
        """The video-length range for batch number `batch`: a curriculum from `warm_seconds`
        (short videos, few events: the model first learns to look) widening linearly to
        `seconds` over `ramp_batches` batches."""
        f = min(1.0, batch / self.ramp_batches) if self.ramp_batches else 1.0
        return tuple(a + f * (b - a) for a, b in zip(self.warm_seconds, self.seconds))

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info is not None:        # in the loader's own process (loader_workers=0) training keeps its threads
            torch.set_num_threads(1)
        rng = np.random.default_rng([self.seed, worker])
        config, tokenizer = zoo_config(self.name), build_tokenizer(SHAPES[self.name][0])
        fps = FPS[config.model_type]
        batch = 0
        while True:
            # the DataLoader takes batches from its workers in turn, so this worker's k-th batch is
            # the loader's (k * workers + worker)-th: the curriculum follows the training steps
            low, high = self.lengths(batch * workers + worker)
            batch += 1
            seconds = float(rng.integers(round(low), round(high) + 1))
            seeds = TRAIN_SEED0 + rng.integers(0, 1 << 40, self.batch_size)
            rate = self.frame_rate(rng, fps)
            examples = [example(int(s), seconds, rate, rng, codec=self.codec, gap_s=g) for s, g in zip(seeds, self.gaps(rng))]
            yield model_inputs(config, tokenizer, examples, with_answers=True,
                               stretch=self.stretches(rng), moves=self.moves(rng), ground_before=self.ground_before)


def step_losses(net, heads: dict, batch: dict, teacher=None, ground_layer: int | None = None,
                chain_layer: int | None = None, margin: float = 1.0) -> dict[str, torch.Tensor]:
    """{"lm": language-model loss, "cells": cell-content loss, "events": event loss, "distill":
    KL(teacher ‖ model) on the answer's positions, "ground": grounding loss, "chain": the chain
    loss}, each but the first only with its head, labels, teacher or layer (`ground_layer`,
    `chain_layer`: the layers whose first head is trained where to look; they need eager
    attention, which returns the weights; `margin`: see grounding_loss). A batch's
    `position_offset` moves its text's positions. The video is encoded once; the cell probe
    reads each visual token as it enters the language model, the event probe reads it at the middle
    layer; the same features go into the language model through `mm_encoder_outputs`."""
    batch = dict(batch)
    cells, events = batch.pop("cell_labels", None), batch.pop("event_labels", None)
    ground_mask, chain_target = batch.pop("ground_mask", None), batch.pop("chain_mask", None)
    offset = batch.pop("position_offset", None)
    teacher_batch = dict(batch)            # the teacher sees the positions it would at inference
    if offset is not None and bool(offset.any()):
        batch["position_ids"] = shifted_positions(net, batch, offset)
    ground = ground_layer is not None and ground_mask is not None
    chain = chain_layer is not None and chain_target is not None

    def looking(out) -> dict:
        return (({"ground": grounding_loss(out.attentions[ground_layer], ground_mask, margin)} if ground else {})
                | ({"chain": grounding_loss(out.attentions[chain_layer], chain_target, margin)} if chain else {}))
    if not heads or cells is None:
        out = net(**batch, output_attentions=ground or chain)
        losses = {"lm": out.loss} | ({"distill": distill_loss(out.logits, teacher, teacher_batch)} if teacher is not None else {})
        return losses | looking(out)
    pixels = batch.pop("pixel_values_videos")
    qwen = net.config.model_type == "qwen2_5_vl"
    if qwen:
        feats = net.model.get_video_features(pixels, batch["video_grid_thw"])
        tokens = torch.cat(feats.pooler_output)                        # [n_tokens, d]
    else:
        feats = net.model.get_video_features(pixels)
        tokens = feats.pooler_output[:, :-1].reshape(-1, feats.pooler_output.shape[-1])   # newline dropped
    out = net(**batch, mm_encoder_outputs={"video": feats}, output_hidden_states="events" in heads,
              output_attentions=ground or chain)
    losses = {"lm": out.loss} | looking(out)
    if teacher is not None:
        losses["distill"] = distill_loss(out.logits, teacher, teacher_batch)
    if "cells" in heads:
        cells = cells.reshape(-1, len(AUX))
        logits = heads["cells"](tokens).split([len(v) for v in AUX.values()], dim=-1)
        losses["cells"] = sum(torch.nn.functional.cross_entropy(lg, cells[:, i]) for i, lg in enumerate(logits)) / len(AUX)
    if "events" in heads and events is not None:
        middle = out.hidden_states[len(out.hidden_states) // 2]          # [batch, seq, d]
        video_id = net.config.video_token_id if qwen else net.config.video_token_index
        is_video = batch["input_ids"] == video_id
        if not qwen:                                                      # each row's last one is the newline
            last = is_video.int().cumsum(1) == is_video.sum(1, keepdim=True)
            is_video = is_video & ~last
        logits = heads["events"](middle[is_video])
        # most tokens see no change: weigh "none" down so that the rare events carry the loss
        weight = torch.ones(len(EVENT_CLASSES), device=logits.device)
        weight[0] = 0.1
        losses["events"] = torch.nn.functional.cross_entropy(logits, events, weight=weight)
    return losses


def grounding_loss(attention: torch.Tensor, mask: torch.Tensor, margin: float = 1.0) -> torch.Tensor:
    """-log of the attention mass the first head puts where `mask` says, averaged over the positions
    that have a target (attention: [batch, heads, queries, keys]; mask: bool [batch, queries, keys]).
    With `margin` m > 1 the mass is that of the head's attention logits divided by m (the weights
    raised to 1/m, renormalised): it takes logit gaps m times those that suffice here, so that the
    head still finds its event among the more events of a longer video."""
    has_target = mask.any(-1)
    if not has_target.any():
        return attention.sum() * 0.0
    weights = attention[:, 0].float()
    if margin != 1.0:
        weights = torch.where(weights > 0, weights.clamp_min(1e-30) ** (1.0 / margin), 0.0)
        weights = weights / weights.sum(-1, keepdim=True)
    mass = (weights * mask).sum(-1)[has_target]
    return -torch.log(mass.clamp_min(1e-6)).mean()


def distill_loss(logits: torch.Tensor, teacher, batch: dict) -> torch.Tensor:
    """KL(teacher ‖ student) per answer token, averaged: the draft learns the target's whole next-
    token distribution where it is trained, not only the reference token (DistillSpec, Zhou et al.
    2024: a draft distilled from its target agrees with it more, which is what speculative
    decoding's acceptance counts)."""
    with torch.no_grad():
        target = teacher(**{k: v for k, v in batch.items() if k != "labels"}).logits[:, :-1]
    where = batch["labels"][:, 1:] != -100                     # logits at t predict the label at t + 1
    vocab = min(logits.shape[-1], target.shape[-1])
    student = torch.log_softmax(logits[:, :-1][where][:, :vocab].float(), -1)
    teacher_logp = torch.log_softmax(target[where][:, :vocab].float(), -1)
    return torch.nn.functional.kl_div(student, teacher_logp, log_target=True, reduction="batchmean")


@torch.no_grad()
def caption_f1(model, tokenizer, seeds, seconds: float) -> float:
    """Mean event F1 of greedy descriptions of held-out worlds `seeds` of `seconds` s."""
    model.eval()
    f1 = []
    device = next(model.parameters()).device
    for seed in seeds:
        ex = example(int(seed), seconds, FPS[model.config.model_type])
        batch = to_device(model_inputs(model.config, tokenizer, [ex], with_answers=False), device)
        budget = 8 * len(ex.truth.events) + 16
        out = model.generate(**batch, max_new_tokens=budget, do_sample=False)
        text = tokenizer.decode(out[0, batch["input_ids"].shape[1]:].cpu(), skip_special_tokens=True)
        f1.append(captions.score(text, ex.truth)["f1"])
    model.train()
    return float(np.mean(f1))


# each loss's name in the log and in training.json's history
LOSS_NAMES = {"lm": "loss", "cells": "aux_loss", "events": "event_loss", "distill": "distill_loss",
              "ground": "ground_loss", "chain": "chain_loss"}


def train(model: str, steps: int = 2000, batch_size: int = 8, lr: float = 5e-4, warmup: int = 100,
          seconds: tuple = (8, 32), warm_seconds: tuple = (2, 12), ramp: float = 0.5, seed: int = 0, eval_seconds: float = 30.0, eval_videos: int = 8,
          aux_weight: float = 1.0, event_weight: float = 0.0, stretch: float = 1.0, init: str | None = None,
          teacher: str | None = None, distill_weight: float = 1.0, rope_theta: float | None = None,
          precision: str = "bf16", ground_weight: float = 0.0, ground_layer: int | None = None,
          chain_weight: float = 0.0, chain_layer: int | None = None, text_shift: int = 0, clause_gap: int = 0,
          ground_margin: float = 1.0, ground_before: bool = False, codec: bool = False,
          dense_gap: tuple | None = None, dense_share: float = 0.5, device: str = "auto",
          loader_workers: int | None = None, max_minutes: float | None = None,
          fps_scale: tuple | None = None, fps_share: float = 0.5,
          log_every: int = 50, eval_every: int = 250, out: str | None = None, progress: bool | None = None) -> dict:
    """Trains zoo model `model` and saves it under `out` (default zoo/weights/<model>).
    The training-only parts are off here; conf/experiment/train_toy.yaml turns on the zoo's recipe.
    `device`: where the model trains (resolve_device); `loader_workers`: the processes making
    batches (loader_workers_for). `max_minutes`: stop after this much training time and save what
    is there (a lent GPU's commands end at 10 minutes, and a killed run saves nothing); the learning
    rate still follows the schedule for `steps`, and training.json records the steps done."""
    from tqdm import tqdm
    from transformers import AutoModelForImageTextToText

    if precision not in ("bf16", "fp32"):
        raise ValueError(f"precision={precision!r}: bf16 (autocast, fp32 master weights) or fp32")
    device = resolve_device(device)
    loader_workers = loader_workers_for(device, loader_workers)
    torch.manual_seed(seed)
    config = zoo_config(model, rope_theta)
    tokenizer = build_tokenizer(config.model_type)
    if init:     # go on from a saved checkpoint (same zoo shape) instead of random weights
        net = AutoModelForImageTextToText.from_pretrained(init, dtype=torch.float32, use_safetensors=True)
        a, b = net.config, config
        if (a.model_type, a.text_config.hidden_size, a.text_config.num_hidden_layers) != (
                b.model_type, b.text_config.hidden_size, b.text_config.num_hidden_layers):
            raise ValueError(f"init={init} is not a {model} checkpoint ({a.model_type}, "
                             f"{a.text_config.num_hidden_layers} layers of {a.text_config.hidden_size})")
        theta = a.text_config.rope_parameters["rope_theta"]
        if rope_theta is not None and float(rope_theta) != theta:
            raise ValueError(f"rope_theta={rope_theta} but init={init} was trained with {theta:g}: "
                             "the rotary base is part of the checkpoint; leave rope_theta unset")
    else:
        net = AutoModelForImageTextToText.from_config(config)
    layers = net.config.text_config.num_hidden_layers
    ground_layer = _looking_layer("ground_layer", ground_layer, max(1, layers - 2), ground_weight, model, layers)
    chain_layer = _looking_layer("chain_layer", chain_layer, layers // 2, chain_weight, model, layers)
    if ground_layer is not None or chain_layer is not None:
        net.set_attn_implementation("eager")   # these losses read attention weights, which only eager returns
    if not ground_margin >= 1.0:
        raise ValueError(f"ground_margin={ground_margin}: >= 1 (1: the plain attention mass)")
    if text_shift < 0 or clause_gap < 0:
        raise ValueError(f"text_shift={text_shift}, clause_gap={clause_gap}: the most positions the text "
                         "may move on, each >= 0")
    if dense_gap is not None:
        dense_gap = tuple(float(g) for g in dense_gap)
        if len(dense_gap) != 2 or not toy.MOVE_S <= dense_gap[0] <= dense_gap[1]:
            raise ValueError(f"dense_gap={list(dense_gap)}: [low, high] s between events, "
                             f"{toy.MOVE_S} <= low <= high (a move glides for {toy.MOVE_S} s)")
    if max_minutes is not None and not max_minutes > 0:
        raise ValueError(f"max_minutes={max_minutes}: the training time allowed, > 0 (null: no limit)")
    if fps_scale is not None:
        fps_scale = tuple(fps_scale)
        if len(fps_scale) != 2 or not all(isinstance(k, int) and not isinstance(k, bool) for k in fps_scale) \
                or not 1 <= fps_scale[0] <= fps_scale[1]:
            raise ValueError(f"fps_scale={list(fps_scale)}: [low, high] integers, 1 <= low <= high, that multiply "
                             f"the zoo's frame rate")
    if not 0.0 <= fps_share <= 1.0:
        raise ValueError(f"fps_share={fps_share}: the fraction of batches at a scaled frame rate, in [0, 1]")
    if not 0.0 <= dense_share <= 1.0:
        raise ValueError(f"dense_share={dense_share}: the fraction of examples from the denser world, in [0, 1]")
    n_params = sum(p.numel() for p in net.parameters())
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    log.info("training %s: %s, %.2f M parameters, %d steps of %d videos of %s s, on %s%s with %d loader workers",
             model, type(net).__name__, n_params / 1e6, steps, batch_size, seconds, device,
             f" ({device_name})" if device_name else "", loader_workers)
    hidden = config.text_config.hidden_size
    heads = {}
    if aux_weight > 0:
        heads["cells"] = torch.nn.Linear(hidden, sum(len(v) for v in AUX.values())).to(device)
    if event_weight > 0:
        heads["events"] = torch.nn.Linear(hidden, len(EVENT_CLASSES)).to(device)
    weights = {"lm": 1.0, "cells": aux_weight, "events": event_weight, "distill": distill_weight, "ground": ground_weight,
               "chain": chain_weight}
    if teacher:     # a trained target of the same architecture and tokenizer, frozen
        teacher_net = AutoModelForImageTextToText.from_pretrained(teacher, dtype=torch.float32, use_safetensors=True)
        if teacher_net.config.model_type != config.model_type:
            raise ValueError(f"teacher={teacher} is a {teacher_net.config.model_type} model; {model} is {config.model_type}")
        teacher_net.eval().requires_grad_(False).to(device)
    else:
        teacher_net = None
    net.to(device)         # after every random initialisation, which stays on the CPU: same weights anywhere
    params = list(net.parameters()) + [p for h in heads.values() for p in h.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    loader = torch.utils.data.DataLoader(Batches(model, batch_size, tuple(seconds), seed, tuple(warm_seconds),
                                                 int(ramp * steps), stretch, text_shift, clause_gap, ground_before, codec,
                                                 dense_gap, dense_share, fps_scale, fps_share),
                                         batch_size=None, num_workers=loader_workers,
                                         prefetch_factor=4 if loader_workers else None, persistent_workers=False,
                                         pin_memory=device.type == "cuda")
    history, t0 = [], time.perf_counter()
    net.train()
    bar = tqdm(zip(range(steps), loader), total=steps, desc=f"train {model}", disable=progress is False,
               mininterval=5)
    running: dict[str, float] = {}
    steps_done = 0
    for step, batch in bar:
        batch = to_device(batch, device)
        # bf16 autocast: matmuls in bf16, weights and optimizer in fp32; on these 2 cores (AVX512-BF16)
        # target steps on 8 videos of 32 s run 1.7x faster (README, "bf16 autocast")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            losses = step_losses(net, heads, batch, teacher_net, ground_layer, chain_layer, ground_margin)
        sum(weights[k] * v for k, v in losses.items()).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        for k, v in losses.items():
            running[k] = v.item() if k not in running else 0.95 * running[k] + 0.05 * v.item()
        bar.set_postfix(loss=f"{running['lm']:.3f}", refresh=False)   # drawn at the bar's own pace
        if (step + 1) % log_every == 0 or step + 1 == steps:
            history.append({"step": step + 1, "s": round(time.perf_counter() - t0, 1)}
                           | {LOSS_NAMES[k]: round(v, 4) for k, v in running.items()})
            log.info("step %d %s (%.0f s)", step + 1, " ".join(f"{LOSS_NAMES[k]} {v:.4f}" for k, v in running.items()),
                     time.perf_counter() - t0)
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            # a quick look on short held-out videos: is the model using the video yet?
            quick = caption_f1(net, tokenizer, range(100, 104), 10.0)
            if not history or history[-1]["step"] != step + 1:
                history.append({"step": step + 1, "loss": round(running["lm"], 4), "s": round(time.perf_counter() - t0, 1)})
            history[-1]["f1_at_10s"] = round(quick, 4)
            log.info("step %d: caption F1 %.3f on 4 held-out 10-s videos", step + 1, quick)
        steps_done = step + 1
        if max_minutes is not None and time.perf_counter() - t0 > 60 * max_minutes and steps_done < steps:
            log.warning("max_minutes=%g reached after %d of %d steps: saving what is there", max_minutes,
                        steps_done, steps)
            if not history or history[-1]["step"] != steps_done:
                history.append({"step": steps_done, "s": round(time.perf_counter() - t0, 1)}
                               | {LOSS_NAMES[k]: round(v, 4) for k, v in running.items()})
            break
    bar.close()
    net.set_attn_implementation("sdpa")   # what the saved checkpoint is loaded with by default
    net = net.to(torch.bfloat16)   # what is shipped is what is evaluated
    out_dir = Path(out) if out else WEIGHTS / model
    save(net.cpu(), tokenizer, out_dir)   # the checkpoint is written from the CPU, whatever trained it
    eval_seeds = range(eval_videos)
    f1 = caption_f1(net.to(device).float(), tokenizer, eval_seeds, eval_seconds)
    result = {"model": model, "parameters": n_params, "steps": steps_done, "steps_planned": steps,
              "max_minutes": max_minutes, "batch_size": batch_size, "lr": lr,
              "aux_weight": aux_weight, "event_weight": event_weight, "stretch": stretch, "init": init,
              "teacher": teacher, "distill_weight": distill_weight if teacher else None,
              "rope_theta": net.config.text_config.rope_parameters["rope_theta"], "precision": precision,
              "ground_weight": ground_weight, "ground_layer": ground_layer,
              "chain_weight": chain_weight, "chain_layer": chain_layer, "text_shift": text_shift,
              "clause_gap": clause_gap, "ground_margin": ground_margin, "ground_before": ground_before, "codec": codec,
              "dense_gap": list(dense_gap) if dense_gap else None, "dense_share": dense_share if dense_gap else None,
              "fps_scale": list(fps_scale) if fps_scale else None, "fps_share": fps_share if fps_scale else None,
              "device": str(device), "device_name": device_name, "loader_workers": loader_workers,
              "seconds": list(seconds), "warm_seconds": list(warm_seconds), "ramp": ramp, "train_s": round(time.perf_counter() - t0, 1), "history": history,
              f"f1_at_{eval_seconds:g}s": round(f1, 4), "eval_seeds": list(eval_seeds)}
    if init and (Path(init) / "training.json").is_file():   # keep the whole recipe: earlier stages first
        result["init_training"] = json.loads((Path(init) / "training.json").read_text())
    (out_dir / "training.json").write_text(json.dumps(result, indent=1) + "\n")
    log.info("%s: caption F1 %.3f on %d held-out %g-s videos; saved to %s", model, f1, eval_videos, eval_seconds, out_dir)
    return result


def resolve_device(device: str) -> torch.device:
    """The device `device` names: "auto" (the GPU when CUDA has one, else the CPU), "cpu", "cuda" or
    "cuda:N". A ValueError naming the setting for anything else, or for a GPU this machine lacks."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA has no GPU here (torch {torch.__version__}); "
                             "use device=cpu, or auto")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this machine has GPUs 0..{torch.cuda.device_count() - 1}")
    return resolved


def loader_workers_for(device: torch.device, loader_workers: int | None) -> int:
    """The DataLoader processes that make batches: `loader_workers`, or by default 1 on the CPU (the
    training itself needs the cores) and on a GPU all cores but two (the training loop and the
    pinning thread): a batch of 8 32-s target videos takes ~0.1 s of one core to render, ~0.5 s
    through H.264 (`codec`), longer than a toy model's step on a GPU."""
    if loader_workers is None:
        if device.type == "cpu":
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(16, cores - 2))
    if isinstance(loader_workers, bool) or not isinstance(loader_workers, int) or loader_workers < 0:
        raise ValueError(f"loader_workers={loader_workers!r}: the processes making batches, an int >= 0 "
                         "(0: in the training process), or null for the device's default")
    return loader_workers


def to_device(x, device: torch.device):
    """`x` with every tensor in it (through dicts, lists and tuples) on `device`, dtype kept; one
    already there is returned as is, a pinned one is copied without waiting for the copy."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=x.device.type == "cpu" and device.type == "cuda" and x.is_pinned())
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):      # a namedtuple
        return type(x)(*(to_device(v, device) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(v, device) for v in x)
    return x


def _looking_layer(name: str, layer: int | None, default: int, weight: float, model: str, layers: int) -> int | None:
    """The layer whose first head a `weight`-ed attention target trains (None: that target is off)."""
    if weight <= 0:
        return None
    layer = default if layer is None else int(layer)
    if not 0 <= layer < layers:
        raise ValueError(f"{name}={layer}: {model} has layers 0..{layers - 1}")
    return layer


def save(net, tokenizer, out_dir: Path) -> None:
    """A checkpoint any transformers user can load: safetensors weights, config, tokenizer with its
    chat template, and the preprocessing the model was trained with (frame rate and size included)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    arch = net.config.model_type
    mean, std = (CLIP_MEAN, CLIP_STD) if arch == "qwen2_5_vl" else (SIGLIP_MEAN, SIGLIP_STD)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": list(mean), "image_std": list(std), "fps": FPS[arch], "size": [FRAME_SIZE, FRAME_SIZE]},
        indent=1) + "\n")
