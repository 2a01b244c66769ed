"""How QuickCodec decodes one video: straight through each interval, or seeking past the frames no
sample needs. Pure functions over the packet scan (`video.codec.StreamIndex`); no decoding here.

Within an interval a decoder stands on the last frame it returned. When the next sampled frame lies
in a later keyframe interval (a GOP), it can decode on through the gap, or seek to that GOP's
keyframe and skip the gap. Seeking costs about as much as decoding a few frames (the demuxer's seek,
the decoder's flush and restart), whatever the video; decoding the gap costs its frames, less the
ones the decoder skips (H.264/HEVC frames nothing refers to, which are not decoded when unneeded).
So a decoder seeks when

    gap frames × (1 - skipped share) > SEEK_COST_FRAMES

and the threshold in frames follows from each video's B-frame share. Dense sampling of a video with
short GOPs never seeks (the paper's interval decoding); sparse sampling seeks at every gap (what a
seek-based decoder does); in between, only the long gaps are skipped. `plan_decode` counts what a
threshold gives for a selection, for the run's metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["SEEK_COST_FRAMES", "DecodePlan", "plan_decode", "seek_threshold", "skipped_share"]

# What one seek costs, in decoded frames of the same video (measured with bench_decode_grid: H.264
# and HEVC, 720p and 1080p, GOPs of 1-10 s; see docs/quickvideo.md).
SEEK_COST_FRAMES = 4.0

# Of the frames shown before a later-decoded one (B-frames), the share nothing refers to: x264's and
# x265's default B-pyramid keeps one B-frame in three as a reference.
NONREF_OF_REORDERED = 2 / 3


def skipped_share(reordered: int, n_frames: int, skip_nonref: bool) -> float:
    """The share of a gap's frames the decoder skips without decoding (0 without skipping)."""
    if not skip_nonref or n_frames <= 0:
        return 0.0
    return NONREF_OF_REORDERED * min(reordered, n_frames) / n_frames


def seek_threshold(reordered: int, n_frames: int, skip_nonref: bool,
                   seek_cost_frames: float = SEEK_COST_FRAMES) -> int:
    """The gap (in frames) beyond which a seek is cheaper than decoding through it."""
    return int(np.ceil(seek_cost_frames / (1.0 - skipped_share(reordered, n_frames, skip_nonref))))


@dataclass(frozen=True)
class DecodePlan:
    """What a threshold does to one selection (counts in frames of the stream, display order)."""

    strategy: str            # "intervals" (never seeks), "seeking" (at every gap), "mixed"
    seek_frames: int         # the threshold: seek past gaps longer than this
    gop_frames: float        # median frames from one keyframe to the next
    sample_gap_frames: float  # median frames between sampled frames
    gaps: int                # times the next sample lies in a later GOP (where a seek is possible)
    seeks: int               # of those, the ones this threshold seeks at
    frames: int              # frames decoded through (before skipping unreferenced ones)
    straight_frames: int     # frames decoding every interval straight through would go through

    def metrics(self) -> dict:
        return asdict(self)


def plan_decode(pts: np.ndarray, keyframes: np.ndarray, tasks: list[list[int]], seek_frames: int) -> DecodePlan:
    """pts: int64 [n] the stream's frames; keyframes: int64 [k]; tasks: each interval's sampled pts
    (ascending); seek_frames: the threshold. Mirrors `video.codec.decode_task`'s choice per gap."""
    rank = {int(p): i for i, p in enumerate(pts.tolist())}
    key_rank = np.searchsorted(pts, keyframes)                         # [k] frame index of each keyframe

    def keyframe_rank(i: int) -> int:
        return int(key_rank[np.searchsorted(key_rank, i, side="right") - 1])

    gaps = seeks = frames = straight = 0
    for targets in tasks:
        ranks = [rank[int(p)] for p in targets]
        start = keyframe_rank(ranks[0])
        frames += ranks[0] - start + 1
        straight += ranks[-1] - start + 1
        for here, nxt in zip(ranks, ranks[1:]):
            key = keyframe_rank(nxt)
            if key > here:
                gaps += 1
                if key - here - 1 > seek_frames:
                    seeks += 1
                    frames += nxt - key + 1
                    continue
            frames += nxt - here
    strategy = "intervals" if seeks == 0 else "seeking" if seeks == gaps else "mixed"
    all_ranks = sorted(rank[int(p)] for t in tasks for p in t)
    return DecodePlan(strategy, int(seek_frames), float(np.median(np.diff(key_rank))) if len(key_rank) > 1 else float(len(pts)),
                      float(np.median(np.diff(all_ranks))) if len(all_ranks) > 1 else 0.0,
                      gaps, seeks, frames, straight)
