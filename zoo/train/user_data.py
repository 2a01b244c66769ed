"""Training examples from the user's own videos: clips of the files a `data:` block names
(`data=folder`, `data=manifest`, `data.path=`), each answered by the target itself, built once into
a cache on disk.

    clips, skipped = plan_clips(load_requests(data), clip_seconds=(8, 16), clips_per_video=4,
                                heldout=0.1, seed=0, prompts=["describe the video ."])
    cache = ExampleCache(root, key={...})                 # the directory named by what the examples depend on
    paths = cache.build(clips, make_example)              # resumable: clips already built are not made again

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

log = logging.getLogger("reelflow.train")

__all__ = ["Clip", "ExampleCache", "load_prompts", "plan_clips", "target_fingerprint"]


@dataclass(frozen=True)
class Clip:
    """One training input: `seconds` of `video` from `start` (s from its first frame), asked `prompt`."""

    video: str
    start: float
    seconds: float
    prompt: str
    heldout: bool         # kept out of training: the agreement check's clips

    @property
    def name(self) -> str:
        return f"{Path(self.video).name}@{self.start:.2f}+{self.seconds:.2f}"


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
               seed: int, prompts: list[str], default_prompt: str | None = None) -> tuple[list[Clip], dict[str, str]]:
    """The clips to train and check on: `clips_per_video` from each request's video, lengths drawn
    in `clip_seconds`, starts anywhere they fit; a request's own prompt (a manifest row's) when it
    differs from `default_prompt`, else one of `prompts` in turn. `heldout` of the videos (at least
    one when there are two or more) are kept out of training; with one video, that share of its
    clips. Returns (clips, {video: why it was skipped}) for the videos that cannot be read."""
    from video.codec import VideoError, scan

    rng = random.Random(seed)
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
            clips.append(Clip(request.video, round(start, 3), round(length, 3), prompt,
                              request.video in held or one_video_heldout))
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
