"""What a decoder returns: frame groups and what it read of the stream. The video layer owns these
records because it makes them; `stages.types` re-exports them as the decode stage's port types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FrameGroup:
    """Consecutive decoded frames: the unit that streams from decode to encode."""

    index: int          # group number, earliest first
    frames: Any         # uint8 [n, 3, H, W]
    seconds: Any        # float64 [n], timestamps relative to the stream's first pts
    last: bool = False  # no group follows in this run


@dataclass(frozen=True)
class VideoInfo:
    """What a decoder read: the stream and the selection. `metrics()` feeds metrics.json."""

    path: str
    duration_s: float
    fps: float                    # the stream's average frame rate
    n_frames: int                 # frames in the stream (counted from packets)
    codec: str
    width: int
    height: int
    selected: int                 # frames returned
    size: tuple = ()              # (h, w) of the returned frames
    lost: tuple = ()              # requested timestamps (s) that could not be decoded
    decoder: str = ""
    plan: dict | None = None      # QuickCodec: how it chose to decode (video.plan.DecodePlan) and what it did

    def metrics(self) -> dict:
        video = {"path": self.path, "seconds": round(self.duration_s, 3), "frames": self.selected,
                 "stream_frames": self.n_frames, "fps": round(self.fps, 3), "codec": self.codec,
                 "size": list(self.size), "lost": list(self.lost), "decoder": self.decoder}
        return {"video": video | ({"plan": dict(self.plan)} if self.plan else {})}
