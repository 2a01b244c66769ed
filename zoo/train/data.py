"""Examples and batches of the toy recipe: a world rendered to frames (`example`), a batch as the
transformers model's forward takes it with the training-only targets of `labels` (`model_inputs`),
the positions its text is moved to (`position_offsets`, `shifted_positions`), and the endless
stream of training batches the loop's DataLoader reads (`Batches`).

Each batch draws fresh worlds (training seeds start at TRAIN_SEED0; held-out seeds are below it)
of one length drawn from a range that starts short (`warm_seconds`: one to three events, so the
model first learns to look at the video before it learns to describe long ones) and widens to
`seconds`, renders them (straight, or through H.264 with `codec`: what inference sees), and asks a
prompt from `zoo.captions.prompts`: the description most of the time, a follow-up question
otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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
from video.encode import encode_video
from zoo import captions, videos
from zoo import world as toy
from zoo.shapes import FPS, FRAME_SIZE, SHAPES, zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train.labels import (
    cell_labels,
    chain_mask,
    event_labels,
    event_tokens,
    grounding_mask,
)

TRAIN_SEED0 = 1_000_000       # training worlds use seeds >= this; evaluation uses seeds below
MAX_CLAUSES = 64              # more than any training answer states


@dataclass
class Example:
    frames: torch.Tensor      # uint8 [n, 3, H, W]
    prompt: str
    answer: str | None
    truth: toy.Truth
    world: toy.World | None = None
    fps: float | None = None  # the frame rate it was rendered at (None: the zoo's, FPS)
    answer_ids: list[int] | None = None   # the answer as token ids (a target's own), used as they are


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
    compression artifacts, what a model sees at inference). Why train on them: the round trip
    changes few pixels by little, yet a model trained on rendered frames alone can lose much of
    its F1 on decoded videos."""
    import io

    import av

    buffer = io.BytesIO()
    encode_video(iter(frames), fps, buffer)
    buffer.seek(0)
    with av.open(buffer) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def model_inputs(config, tokenizer, examples: list[Example], *, with_answers: bool,
                 stretch: list[float] | None = None, moves: list[tuple[int, list[int]]] | None = None,
                 ground_before: bool = False, norm: tuple | None = None) -> dict:
    """The batch as the transformers model's forward takes it: right-padded ids, the video's
    pixels, and (with answers) labels that score only the answer and its <|im_end|>, plus the
    training-only per-token targets. `stretch` (Qwen2.5-VL, training only): per example, a factor
    on the seconds each temporal patch spans, which spreads the video's temporal positions over a
    longer range (see Batches); `moves` (training only): per example, how far the positions of its
    text after the video move on, and how much further after each clause of its answer (see
    labels.chain_mask); the batch's `position_offset` [batch, seq] carries them to the loss
    (shifted_positions).
    `ground_before`: the grounding targets include the step before a change (event_tokens).
    `norm`: the pixels' (mean, std) (None: the zoo's, CLIP's for Qwen and SigLIP's for LLaVA); an
    example's `answer_ids` are its answer as they are (no end-of-turn token added)."""
    arch = config.model_type
    mean, std = norm or ((CLIP_MEAN, CLIP_STD) if arch == "qwen2_5_vl" else (SIGLIP_MEAN, SIGLIP_STD))
    rows, labels, pixels, grids, cells, events, grounds, chains, afters = [], [], [], [], [], [], [], [], []
    rates = [ex.fps or FPS[arch] for ex in examples]
    for ex, fps in zip(examples, rates):
        step = config.vision_config.temporal_patch_size if arch == "qwen2_5_vl" else 1
        if with_answers and ex.world is not None:
            cells.append(cell_labels(ex.world, fps, ex.frames.shape[0], step))
            events.append(event_labels(ex.world, fps, ex.frames.shape[0], step))
        if arch == "qwen2_5_vl":
            flat, (t, h, w) = qwen_video_patches(ex.frames, mean, std)
            pixels.append(flat)
            grids.append((t, h, w))
            n_video, placeholder = t * h * w // 4, config.video_token_id
        else:
            pixels.append(siglip_video_pixels(ex.frames, mean, std))
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
        if with_answers and ex.answer_ids is not None:
            target = list(ex.answer_ids)
        elif with_answers:
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
    """Endless training batches from training step `start` on. Step k's batch is drawn from its own
    seed ([seed, k]), so the stream is the same whatever the number of loader workers, and a
    resumed run gets the batches the uninterrupted one would have."""

    def __init__(self, name: str, batch_size: int, seconds: tuple[float, float], seed: int,
                 warm_seconds: tuple[float, float] | None = None, ramp_batches: int = 0, stretch: float = 1.0,
                 text_shift: int = 0, clause_gap: int = 0, ground_before: bool = False, codec: bool = False,
                 dense_gap: tuple[float, float] | None = None, dense_share: float = 0.5,
                 fps_scale: tuple[int, int] | None = None, fps_share: float = 0.5, visual_drop: float = 0.0,
                 visual_keep: tuple[float, float] = (0.1, 1.0), visual_uv_share: float = 0.0, start: int = 0):
        self.name, self.batch_size, self.seconds, self.seed, self.start = name, batch_size, seconds, seed, start
        self.warm_seconds, self.ramp_batches, self.stretch = warm_seconds or seconds, ramp_batches, stretch
        self.text_shift, self.clause_gap, self.ground_before = text_shift, clause_gap, ground_before
        self.codec, self.dense_gap, self.dense_share = codec, dense_gap, dense_share
        self.fps_scale, self.fps_share = fps_scale, fps_share
        self.visual_drop, self.visual_keep, self.visual_uv_share = visual_drop, visual_keep, visual_uv_share

    def drops(self, rng: np.random.Generator, width: int) -> dict:
        """Per example, how much of its video the model sees (zoo.train.dropout): `keep_fraction`
        1 (all) for all but a `visual_drop` share, whose fraction is uniform in `visual_keep`; of
        those, a `visual_uv_share` are `keep_by_uv` (UV-Prune on the teacher picks the tokens),
        the others keep the tokens with the highest `keep_noise` (a random subset). Why: a
        ParallelVLM draft sees only the tokens UV-Prune keeps (90 % dropped at alpha 0.9)."""
        n = self.batch_size
        dropped = rng.random(n) < self.visual_drop
        fractions = np.where(dropped, rng.uniform(self.visual_keep[0], self.visual_keep[1], n), 1.0)
        by_uv = dropped & (rng.random(n) < self.visual_uv_share)
        return {"keep_fraction": torch.tensor(fractions, dtype=torch.float32), "keep_by_uv": torch.from_numpy(by_uv),
                "keep_noise": torch.from_numpy(rng.random((n, width)).astype(np.float32))}

    def frame_rate(self, rng: np.random.Generator, fps: float) -> float:
        """The batch's frame rate: the zoo's `fps`, or for a `fps_share` of the batches that times
        an integer drawn from `fps_scale` (dynamic frame rates, as Qwen2.5-VL is trained with).
        Why: a 30-s video at 4x the frame rate has as many visual tokens as a 120-s one at the
        zoo's, and a model that has only seen training-length token counts can fail on the number
        of tokens as well as on the number of events. The video stays of training length, with its
        events, so this teaches the token counts alone."""
        if self.fps_scale is None or rng.random() >= self.fps_share:
            return fps
        return fps * int(rng.integers(self.fps_scale[0], self.fps_scale[1] + 1))

    def gaps(self, rng: np.random.Generator) -> list[tuple[float, float]]:
        """Per example, the range its world's times between events are drawn from: `dense_gap` for a
        `dense_share` of them, else the world's own. Why: an answer states one clause per event, and
        a model trained on short worlds has never written as many clauses as a long video needs. A
        denser world of training length gives long answers without long videos; too dense or too
        often, and it harms the greedy description of long videos."""
        if self.dense_gap is None:
            return [toy.GAP_S] * self.batch_size
        return [tuple(self.dense_gap) if rng.random() < self.dense_share else toy.GAP_S for _ in range(self.batch_size)]

    def stretches(self, rng: np.random.Generator) -> list[float] | None:
        """Per example, the factor on its temporal position spacing: 1 for half the examples, else
        uniform in [1, stretch]. Why: RoPE attention depends on relative positions, and a model
        trained on videos up to 32 s never sees a question 100 temporal positions after the first
        frame, which a 2-min video puts there. Stretching shows it those distances at the cost of a
        short video, as randomized positional encodings do for length generalization (Ruoss et al.
        2023)."""
        if self.stretch <= 1.0 or SHAPES[self.name][0] != "qwen2_5_vl":
            return None
        return [1.0 if rng.random() < 0.5 else float(rng.uniform(1.0, self.stretch)) for _ in range(self.batch_size)]

    def moves(self, rng: np.random.Generator) -> list[tuple[int, list[int]]] | None:
        """Per example, how far its text's positions move on (labels.chain_mask says why): nothing for half
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
        config, tokenizer = zoo_config(self.name), build_tokenizer(SHAPES[self.name][0])
        fps = FPS[config.model_type]
        batch = 0
        while True:
            # the DataLoader takes batches from its workers in turn, so this worker's k-th batch is
            # the loader's (k * workers + worker)-th: the step it trains, its seed and its curriculum
            step = self.start + batch * workers + worker
            rng = np.random.default_rng([self.seed, step])
            low, high = self.lengths(step)
            batch += 1
            seconds = float(rng.integers(round(low), round(high) + 1))
            seeds = TRAIN_SEED0 + rng.integers(0, 1 << 40, self.batch_size)
            rate = self.frame_rate(rng, fps)
            examples = [example(int(s), seconds, rate, rng, codec=self.codec, gap_s=g) for s, g in zip(seeds, self.gaps(rng))]
            inputs = model_inputs(config, tokenizer, examples, with_answers=True,
                                  stretch=self.stretches(rng), moves=self.moves(rng), ground_before=self.ground_before)
            if self.visual_drop > 0:
                inputs.update(self.drops(rng, inputs["input_ids"].shape[1]))
            yield inputs
