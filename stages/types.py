"""Port types: the small frozen records that travel along the graph's edges.

The engine checks edges by these classes (a producer's type must be the consumer's type or a
subclass of it) and never looks inside. Tensors carry their shapes in comments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from speculative.protocol import DraftInfo, Proposal, RoundKind, Verdict  # noqa: F401  (the draft ⇄ verify edges)
from speculative.rounds import SpeculativeStats
from video.frames import FrameGroup, VideoInfo  # noqa: F401  (made by the video layer; the decode stage's ports)


@dataclass(frozen=True)
class Request:
    """One run's input: a video and a prompt (either may be absent for synthetic graphs)."""

    id: str = "0"
    video: str | None = None
    prompt: str | None = None
    reference: Any = None   # what a scorer compares the answer with (the toy world's truth, a dict)


@dataclass(frozen=True)
class Payload:
    """A generic tensor item, used by synthetic stages and tests."""

    index: int
    data: Any  # torch.Tensor, any shape


@dataclass(frozen=True)
class VisualTokens:
    """Vision-encoder output of one frame group, ready to be placed into the LLM sequence."""

    index: int
    embeds: Any                      # [n_tokens, hidden]
    meta: dict = field(default_factory=dict)  # model-specific (grid_thw, positions, ...)
    last: bool = False


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill leaves: the model's cache, where the next token goes, the prompt's layout, the
    logits of the first new token and how it was prefilled. A pruned cache is shorter than its
    logical length; both are kept (docs/design.md, pitfall 2)."""

    cache: Any
    logical_length: int         # the unpruned prompt's length: where the next token's position starts
    layout: Any = None          # models.adapter.Layout: the prompt's ids and every position
    logits: Any = None          # float [V]: the prefill's prediction of the first new token
    model: str | None = None    # the model's name
    n_video_tokens: int | None = None
    frames: int | None = None   # video frames prefilled
    prefill: dict | None = None   # how it was prefilled (mode, groups, tokens kept, kv_bytes...), for metrics


@dataclass(frozen=True)
class Taps:
    """Hidden states (or attention) published mid-forward: layer index -> [seq, hidden]."""

    layers: dict
    layout: Any = None          # the prompt's layout the rows follow
    model: str | None = None


@dataclass(frozen=True)
class Selection:
    """Which visual tokens a pruner keeps, as indices into the unpruned sequence."""

    keep: Any            # int64 [n_keep], sorted
    total: int
    scores: Any = None   # float [total], for plots


@dataclass(frozen=True)
class Tokens:
    """Generated output: the ids, their text, what the generating stage adds about them (`meta`:
    model, prefill statistics...) and, for speculative decoding, its round-by-round record."""

    ids: list
    text: str | None = None
    meta: dict = field(default_factory=dict)
    speculative: SpeculativeStats | None = None

    def details(self) -> dict:
        """metrics.json's tokens_meta: `meta`, and the speculative figures where there are any."""
        return {**self.meta, **(self.speculative.metrics() if self.speculative is not None else {})}


@dataclass(frozen=True)
class Score:
    """How good an answer is against the request's reference; `metrics()` feeds metrics.json."""

    values: dict            # e.g. {"precision": .., "recall": .., "f1": ..}

    def metrics(self) -> dict:
        return {"score": dict(self.values)}
