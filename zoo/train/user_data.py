"""Training examples from the user's own videos: clips of the files a `data:` block names
(`data=folder`, `data=manifest`, `data.path=`), each answered by the target itself, built once into
a cache on disk.

    clips, skipped = plan_clips(load_requests(data), clip_seconds=(8, 16), clips_per_video=4,
                                heldout=0.1, seed=0, prompts=["describe the video ."])
    cache = ExampleCache(root, key={...})                 # the directory named by what the examples depend on
    paths = cache.build(clips, make_example)              # resumable: clips already built are not made again
    examples = user_examples(data, UserDataConfig(), lm, "zoo/weights/qwen-target", recipe="train_draft",
                             key={...}, make=make)        # all of it: the clips, the cache, the held-out frames

No labels are needed: the examples are the target's own greedy answers and states (self-
distillation), so any videos will do. Clips are short (like the paper's training inputs): a draft
head trained on short clips carries to long videos because it attends to text only.

The cache is one file per clip, each written whole (to a temporary name, then renamed), so an
interrupted build keeps what it made and the next run makes only the rest. A video that cannot be
read costs its clips (each noted in the cache with the reason), never the cache. The cache key
holds the target (its path and its weights' size and time), the clips, the prompts and the answer
length: change any and the examples live in a new directory; nothing is ever deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("reelflow.train")

__all__ = ["Clip", "ExampleCache", "TargetRecipe", "UserDataConfig", "UserExamples", "clip_rate", "decode_clip",
           "load_prompts", "plan_clips", "target_dtype", "target_fingerprint", "user_examples", "user_source"]


@dataclass(frozen=True)
class UserDataConfig:
    """The `train:` keys of a recipe that learns from the user's own videos (`data=folder` /
    `data=manifest` / `data.path=`): which clips, answered how, cached where."""

    clip_seconds: tuple[float, float] = (2.0, 16.0)   # each clip's length is drawn in this range (s)
    clips_per_video: int = 8
    heldout: float = 0.1                        # the share of the videos kept for the agreement check
    prompts: Any = None                         # a list or a .txt / .json file (None: data.prompt)
    cache: str = "~/.cache/reelflow/examples"   # where built examples are kept and found again
    clip_seed: int = 0                          # which clips: their lengths, starts and the held-out videos
    fps: float | None = None                    # frames a second the target sees (None: its own, else 1)
    size: int | None = None                     # frame side it sees (None: its own, else 448)
    eval_clips: int = 8                         # held-out clips the accepted length is measured on
    target_dtype: str = "auto"                  # auto: bfloat16 on a GPU, float32 on the CPU
    rate_scale: tuple[int, int] | None = None   # [low, high]: some clips at that many times `fps` (None: none)
    rate_share: float = 0.5                     # ... the share of the clips

    def problems(self) -> list[str]:
        out = []
        if not 0 < self.clip_seconds[0] <= self.clip_seconds[1]:
            out.append(f"clip_seconds={list(self.clip_seconds)}: a range [low, high] of positive lengths")
        if self.clips_per_video < 1:
            out.append(f"clips_per_video={self.clips_per_video}: at least 1")
        if not 0.0 <= self.heldout < 1.0:
            out.append(f"heldout={self.heldout}: a share of the videos, in [0, 1)")
        if self.prompts is not None and not isinstance(self.prompts, (str, list, tuple)):
            out.append(f"prompts={self.prompts!r}: a list of prompts, or a .txt / .json file of them")
        if self.target_dtype not in ("auto", "float32", "bfloat16", "float16"):
            out.append(f"target_dtype={self.target_dtype!r}: auto, float32, bfloat16 or float16")
        if self.eval_clips < 0:
            out.append(f"eval_clips={self.eval_clips}: 0 or more")
        if self.rate_scale is not None and not 1 <= self.rate_scale[0] <= self.rate_scale[1]:
            out.append(f"rate_scale={list(self.rate_scale)}: a range [low, high] of integer factors, 1 or more")
        if not 0.0 <= self.rate_share <= 1.0:
            out.append(f"rate_share={self.rate_share}: a share of the clips, in [0, 1]")
        return out


class TargetRecipe:
    """What a recipe that learns from a frozen target's answers shares (zoo.train.sparrow's head,
    zoo.train.draft's draft): its settings, the user's videos or none (the toy world), and the
    target loaded read-only. Mixed in before loop.Recipe."""

    def __init__(self, config, videos: UserDataConfig | None = None, data: dict | None = None,
                 progress: bool | None = None):
        self.config, self.videos, self.source, self.progress = config, videos or UserDataConfig(), data, progress
        self.eval_clips: list = []
        self.trained_on: dict = {"data": "the toy world"}

    def load_target(self, device: torch.device):
        """The target (`config.target`) on `device` in `videos.target_dtype`, frozen."""
        from models.load import load_model

        self.lm = load_model(self.config.target, dtype=target_dtype(self.videos, device), device=str(device))
        self.lm.model.requires_grad_(False)
        return self.lm


def user_source(data: dict | None) -> dict | None:
    """The `data:` block when it names the user's videos (a path, a folder or a manifest), else None
    (the recipe's own toy-world examples)."""
    return data if data and any(data.get(k) for k in ("path", "folder", "manifest")) else None


def clip_rate(config: UserDataConfig, lm) -> tuple[float, int]:
    """(frames a second, frame side) the target sees the clips at: the settings, else its own."""
    return float(config.fps or lm.fps or 1.0), int(config.size or (lm.frame_size[0] if lm.frame_size else 448))


def target_dtype(config: UserDataConfig, device: torch.device) -> str:
    """The dtype the frozen target is loaded in: the setting, or bfloat16 on a GPU and float32 on the CPU."""
    if config.target_dtype != "auto":
        return config.target_dtype
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass(frozen=True)
class Clip:
    """One training input: `seconds` of `video` from `start` (s from its first frame), asked `prompt`."""

    video: str
    start: float
    seconds: float
    prompt: str
    heldout: bool         # kept out of training: the agreement check's clips
    rate: int = 1         # sampled at this many times the target's frame rate

    @property
    def name(self) -> str:
        rate = f"x{self.rate}" if self.rate != 1 else ""
        return f"{Path(self.video).name}@{self.start:.2f}+{self.seconds:.2f}{rate}"


def load_prompts(prompts: Any) -> list[str]:
    """The default prompt set: a list of strings, or a file (.txt: one prompt a line; .json: a list
    of strings). Raises ValueError with the file and the reason when it cannot be used."""
    if isinstance(prompts, str):
        path = Path(prompts).expanduser()
        if not path.is_file():
            raise ValueError(f"prompts={prompts}: no such file (give a list of prompts, or a .txt / .json file)")
        text = path.read_text()
        if path.suffix == ".json":
            try:
                prompts = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompts={prompts}: not valid JSON ({e}); give a list of strings") from None
            if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
                raise ValueError(f"prompts={path}: the JSON must be a list of strings")
        else:
            prompts = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    prompts = [str(p) for p in (prompts or []) if str(p).strip()]
    if not prompts:
        raise ValueError("prompts: at least one prompt is needed")
    return prompts


def plan_clips(requests: list, *, clip_seconds: tuple[float, float], clips_per_video: int, heldout: float,
               seed: int, prompts: list[str], default_prompt: str | None = None,
               rate_scale: tuple[int, int] | None = None, rate_share: float = 0.5) -> tuple[list[Clip], dict[str, str]]:
    """The clips to train and check on: `clips_per_video` from each request's video, lengths drawn
    in `clip_seconds`, starts anywhere they fit; a request's own prompt (a manifest row's) when it
    differs from `default_prompt`, else one of `prompts` in turn. `heldout` of the videos (at least
    one when there are two or more) are kept out of training; with one video, that share of its
    clips. `rate_scale` [low, high]: `rate_share` of the clips are sampled at that many times the
    target's frame rate, an integer drawn in the range (more visual tokens for the same seconds, as
    Qwen2.5-VL is trained with dynamic frame rates); their own random stream, so the clips' lengths
    and starts do not depend on it. Returns (clips, {video: why it was skipped}) for the videos that
    cannot be read."""
    from video.codec import VideoError, scan

    rng, rates = random.Random(seed), random.Random(f"rates-{seed}")
    durations: dict[str, float] = {}
    skipped: dict[str, str] = {}
    for request in requests:
        try:
            durations[request.video] = scan(request.video).duration_s
        except (VideoError, OSError) as e:
            skipped[request.video] = str(e)
            log.warning("skipping %s: %s", request.video, e)
    readable = [r for r in requests if r.video in durations]
    if not readable:
        raise ValueError("none of the videos can be read: " + "; ".join(f"{v}: {why}" for v, why in skipped.items()))
    videos = sorted({r.video for r in readable})
    held = set()
    if len(videos) >= 2 and heldout > 0:
        held = set(random.Random(f"heldout-{seed}").sample(videos, max(1, round(heldout * len(videos)))))
    elif heldout > 0:
        log.warning("one video: the held-out clips are other stretches of the video trained on, so the agreement "
                    "check reads high; two or more videos keep whole videos out")
    clips: list[Clip] = []
    turn = 0
    for request in sorted(readable, key=lambda r: r.video):
        own = request.prompt if request.prompt and request.prompt != default_prompt else None
        duration = durations[request.video]
        for k in range(clips_per_video):
            length = min(duration, rng.uniform(*clip_seconds))
            start = rng.uniform(0.0, max(0.0, duration - length))
            prompt = own or prompts[turn % len(prompts)]
            turn += own is None
            one_video_heldout = len(videos) == 1 and k >= clips_per_video - round(heldout * clips_per_video)
            rate = rates.randint(*rate_scale) if rate_scale and rates.random() < rate_share else 1
            clips.append(Clip(request.video, round(start, 3), round(length, 3), prompt,
                              request.video in held or one_video_heldout, rate))
    return clips, skipped


def target_fingerprint(path: str) -> dict:
    """What identifies a target's weights without reading them: its resolved path, and the size and
    modification time of each weight file (a hub id stands for itself)."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return {"target": str(path)}
    files = sorted(f for f in p.iterdir() if f.suffix in (".safetensors", ".bin", ".json"))
    return {"target": str(p.resolve()), "files": {f.name: [f.stat().st_size, int(f.stat().st_mtime)] for f in files}}


class ExampleCache:
    """A directory of examples, one file per clip, named by a hash of `key` under `root`."""

    def __init__(self, root: str | os.PathLike, key: dict):
        text = json.dumps(key, sort_keys=True, default=str)
        self.key = key
        self.dir = Path(root).expanduser() / hashlib.sha256(text.encode()).hexdigest()[:16]
        self.dir.mkdir(parents=True, exist_ok=True)
        key_file = self.dir / "key.json"
        if not key_file.exists():
            key_file.write_text(json.dumps(key, indent=1, sort_keys=True, default=str) + "\n")

    def path(self, i: int) -> Path:
        return self.dir / f"clip-{i:05d}.pt"

    def skip_path(self, i: int) -> Path:
        return self.dir / f"clip-{i:05d}.skip"

    def build(self, clips: list[Clip], make: Callable[[Clip], dict], progress: bool | None = None,
              desc: str = "examples") -> list[Path | None]:
        """Each clip's example file, making the missing ones with `make(clip)` (a dict of tensors);
        a clip whose `make` raises is noted as skipped (None) with the reason, and the build goes on."""
        from tqdm import tqdm

        (self.dir / "clips.json").write_text(json.dumps([asdict(c) for c in clips], indent=0) + "\n")
        todo = [i for i in range(len(clips)) if not self.path(i).exists() and not self.skip_path(i).exists()]
        if len(todo) < len(clips):
            log.info("example cache %s: %d of %d clips already built", self.dir, len(clips) - len(todo), len(clips))
        for i in tqdm(todo, desc=desc, disable=progress is False or not todo, mininterval=2):
            clip = clips[i]
            try:
                example = make(clip)
            except KeyboardInterrupt:
                raise
            except Exception as e:   # one unreadable clip must not cost the others
                log.warning("skipping clip %s: %s: %s", clip.name, type(e).__name__, e)
                self.skip_path(i).write_text(f"{type(e).__name__}: {e}\n")
                continue
            tmp = self.path(i).with_suffix(".partial")
            torch.save(example, tmp)
            os.replace(tmp, self.path(i))
        return [self.path(i) if self.path(i).exists() else None for i in range(len(clips))]

    def skipped(self) -> dict[str, str]:
        return {p.stem: p.read_text().strip() for p in sorted(self.dir.glob("clip-*.skip"))}


@dataclass
class UserExamples:
    """What a recipe trains and checks on, made from the user's videos by `user_examples`."""

    train: list[dict]                           # the training clips' examples
    heldout: list[dict]                         # the held-out clips' examples
    eval_clips: list[tuple[Clip, torch.Tensor, float]]   # up to `eval_clips` held-out clips, their frames and rate
    trained_on: dict = field(default_factory=dict)   # for the card and training.json
    fps: float = 1.0
    size: int = 448


def user_examples(source: dict, config: UserDataConfig, lm, target: str, *, recipe: str, key: dict,
                  make: Callable[[Clip, torch.Tensor, float], dict], memory: Callable[[int, int], Any] | None = None,
                  progress: bool | None = None) -> UserExamples:
    """The examples of the clips of `source`'s videos (a `data:` block) for `lm` (the target, loaded
    from `target`), each `make(clip, frames, fps)` (frames: uint8 [n, 3, size, size] at `fps`, the
    target's rate times the clip's `rate`) built once into the example cache named
    by `key` + the clips. `memory(frames, size)` checks the longest clip fits before anything is
    built. Raises graph.spec.ConfigError (prefixed by `recipe`) when the data cannot be used."""
    from graph.spec import ConfigError
    from stages.source import load_requests
    from video.quickcodec import DecoderPool

    fps, size = clip_rate(config, lm)
    default_prompt = source.get("prompt")
    try:
        prompts = load_prompts(config.prompts if config.prompts is not None
                               else [default_prompt or "describe the video ."])
        clips, skipped = plan_clips(load_requests(source), clip_seconds=tuple(config.clip_seconds),
                                    clips_per_video=config.clips_per_video, heldout=config.heldout,
                                    seed=config.clip_seed, prompts=prompts, default_prompt=default_prompt,
                                    rate_scale=config.rate_scale, rate_share=config.rate_share)
    except ValueError as e:
        raise ConfigError(f"{recipe}: {e}") from None
    if memory is not None:
        memory(int(config.clip_seconds[1] * fps * max(k.rate for k in clips)) + 1, size)
    # a clip at the target's own rate keeps the key it had before clips could have other rates
    listed = [[k.video, k.start, k.seconds, k.prompt] + ([k.rate] if k.rate != 1 else []) for k in clips]
    cache = ExampleCache(config.cache, {**key, **target_fingerprint(target), "dtype": str(lm.dtype),
                                        "fps": fps, "size": size, "clips": listed})
    with DecoderPool(1) as pool:
        paths = cache.build(clips, lambda k: make(k, decode_clip(k, pool, fps * k.rate, size), fps * k.rate),
                            progress=progress,
                            desc="target answers")
        held = [k for k, p in zip(clips, paths) if p is not None and k.heldout]
        eval_clips = [(k, decode_clip(k, pool, fps * k.rate, size), fps * k.rate) for k in held[:config.eval_clips]]
    train = [torch.load(p) for k, p in zip(clips, paths) if p is not None and not k.heldout]
    heldout = [torch.load(p) for k, p in zip(clips, paths) if p is not None and k.heldout]
    if not train:
        raise ConfigError(f"{recipe}: no training clip could be made ({len(cache.skipped())} skipped; see "
                          f"{cache.dir}); every clip is held out or unreadable")
    trained_on = {"data": {k: v for k, v in source.items() if v and k != "toy"},
                  "videos": len({k.video for k in clips}), "videos_skipped": skipped,
                  "clips": len(train), "heldout_clips": len(heldout), "clips_skipped": len(cache.skipped()),
                  "fps": fps, "size": size, "prompts": prompts[:8], "example_cache": str(cache.dir)}
    log.info("examples: %d training clips and %d held-out clips from %d videos (%s)", len(train), len(heldout),
             len({k.video for k in clips}), cache.dir)
    return UserExamples(train, heldout, eval_clips, trained_on, fps, size)


def decode_clip(clip: Clip, pool, fps: float, size: int) -> torch.Tensor:
    """uint8 [n, 3, size, size]: the clip's frames at `fps` (QuickCodec on `pool`)."""
    import numpy as np

    from video.quickcodec import quickcodec_groups

    times = clip.start + np.arange(max(1, int(round(clip.seconds * fps)))) / fps
    groups = list(quickcodec_groups(clip.video, pool, seconds=times.tolist(), size=size))
    return torch.cat([g.frames for g in groups])
