"""Where a run's input comes from: the `data:` config turned into Requests, and the Source stage
that hands the current Request to the graph.

    data.path=VIDEO data.prompt=TEXT     one file
    data.folder=DIR data.prompt=TEXT     every video file in DIR, sorted by name
    data.manifest=FILE.jsonl             one {"path": ..., "prompt": ...} per line (paths relative to the file)
    data.toy={_target_: MAKER, ...}      the rows a maker the config names returns (data=toy_eval)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.utils import get_method

from graph.spec import ConfigError
from graph.stage import Out, Stage
from stages.types import Request
from video.bench import check_bench_video, check_codec, ensure_bench_video

VIDEO_SUFFIXES = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".ts", ".m4v", ".flv"}
ROOT = Path(__file__).resolve().parent.parent


def _find(path: str) -> Path:
    """`path` as given, or relative to the project (the bundled sample works from any directory)."""
    p = Path(path).expanduser()
    return p if p.exists() or p.is_absolute() else (ROOT / p if (ROOT / p).exists() else p)


def load_requests(data: Any) -> list[Request]:
    data = dict(data or {})
    path, folder, manifest, prompt = (data.get(k) for k in ("path", "folder", "manifest", "prompt"))
    given = [k for k in ("path", "folder", "manifest", "toy") if data.get(k)]
    if len(given) > 1:
        raise ConfigError(f"data: give one of path, folder, manifest, toy (got {', '.join(given)}).")
    if data.get("toy"):
        return generated_requests(data["toy"], prompt)
    if path:
        p = _find(path)
        if not p.is_file():
            raise ConfigError(f"data.path={path}: no such file.")
        return [Request(id=p.stem, video=str(p.resolve()), prompt=prompt)]
    if folder:
        d = _find(folder)
        if not d.is_dir():
            raise ConfigError(f"data.folder={folder}: no such directory.")
        files = sorted(f for f in d.iterdir() if f.suffix.lower() in VIDEO_SUFFIXES)
        if not files:
            raise ConfigError(f"data.folder={folder}: no video files ({', '.join(sorted(VIDEO_SUFFIXES))}).")
        return [Request(id=f.stem, video=str(f.resolve()), prompt=prompt) for f in files]
    if manifest:
        m = _find(manifest)
        if not m.is_file():
            raise ConfigError(f"data.manifest={manifest}: no such file.")
        out = []
        for n, line in enumerate(m.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                video = (m.parent / row["path"]).resolve()
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ConfigError(f"data.manifest={manifest} line {n}: expected {{\"path\": ..., \"prompt\": ...}} ({e}).") from None
            if not video.is_file():
                raise ConfigError(f"data.manifest={manifest} line {n}: no such file {video}.")
            out.append(Request(id=str(row.get("id", video.stem)), video=str(video), prompt=row.get("prompt", prompt),
                               reference=row.get("reference")))
        if not out:
            raise ConfigError(f"data.manifest={manifest} has no rows.")
        return out
    return [Request(id="0", video=None, prompt=prompt)]


def generated_requests(block: Any, prompt: str | None) -> list[Request]:
    """Requests from a maker the config names (`data.toy: {_target_: zoo.videos.held_out_requests,
    ...}`): it returns rows like a manifest's ({"id", "video", "prompt", "reference"}); the rest of
    the block are its arguments. The data's world stays out of this layer."""
    keys = dict(block)
    target = keys.pop("_target_", None)
    if not target:
        raise ConfigError("data.toy: name its request maker with `_target_` (data=toy_eval has one).")
    try:
        make = get_method(target)
    except Exception as e:  # hydra wraps the import's error; the message names the path
        raise ConfigError(f"data.toy._target_={target}: {e}") from None
    return [Request(**row) for row in make(prompt=prompt, **keys)]


class Source(Stage):
    """Emits the run's Request, so stages downstream see the video and prompt as an input."""

    outputs = {"request": Out(Request)}

    def __call__(self, ctx):
        return {"request": ctx.request}


class BenchVideo(Stage):
    """Emits a Request for the cached benchmark video (generated on first use in setup).
    codec: "h264" or "hevc"; bframes: B-frames between references (null: the encoder's default)."""

    outputs = {"request": Out(Request)}

    def __init__(self, minutes: float = 1.0, width: int = 1280, height: int = 720, fps: int = 24, gop_s: float = 2.0,
                 seed: int = 0, codec: str = "h264", bframes: int | None = None):
        check_bench_video(minutes, width, height, fps, gop_s)
        check_codec(codec, bframes)
        self.minutes, self.width, self.height, self.fps, self.gop_s, self.seed = minutes, width, height, fps, gop_s, seed
        self.codec, self.bframes = codec, bframes
        self.path: Path | None = None

    def setup(self, ctx) -> None:
        self.path = ensure_bench_video(self.minutes, width=self.width, height=self.height, fps=self.fps,
                                       gop_s=self.gop_s, seed=self.seed, codec=self.codec, bframes=self.bframes)

    def __call__(self, ctx):
        return {"request": Request(id=f"bench-{self.minutes}min", video=str(self.path), prompt=None)}
