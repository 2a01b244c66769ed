"""Port types: the small frozen records that travel along the graph's edges.

The engine checks edges by these classes (a producer's type must be the consumer's type or a
subclass of it) and never looks inside. Tensors carry their shapes in comments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
class KV:
    """A model's cache after prefill. A pruned cache is shorter than its logical length; both are
    kept (docs/design.md, pitfall 2)."""

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
class Proposal:
    """A draft's block of tokens continuing the sequence at ``base`` (its assumed committed
    length) after token ``after`` (what it assumed at base − 1; -1: none), so a verifier can tell
    a proposal made on a rejected prefix."""

    round: int
    base: int
    tokens: Any          # int64 [k]
    probs: Any = None    # float [k, vocab] when sampling
    meta: dict = field(default_factory=dict)   # the first round's: what the draft prefilled
    after: int = -1
    parents: Any = None  # int64 [k]: a tree (stages.tree: parents[i] < i, -1 a root); None: a chain


@dataclass(frozen=True)
class Verdict:
    """The target's answer to one proposal."""

    round: int
    accepted: int        # draft tokens accepted (0..k)
    token: int           # the target's own next token (bonus or correction); -1: none (judge_ahead)
    length: int          # committed length after this verdict
    stale: bool = False  # the proposal was built on a prefix already rejected
    done: bool = False
    verify_s: float = 0.0  # the target's time for this verification (its forward and the rule): Tp, for `window: auto`
    path: tuple = ()       # a tree proposal: the accepted nodes, root to leaf
    features: Any = None   # asked for by the proposal (meta "features"): the target's final-norm
    #                        states [m, hidden] of the tokens this verification cached, in order


@dataclass(frozen=True)
class SpeculativeStats:
    """What a speculative run did, round by round; `metrics()` gives its figures for metrics.json.

    M (mean_accepted_length): tokens committed per verification round, the accepted draft tokens
    and the target's own; tokens_per_rollback: the seed's (ParallelVLM's) M, tokens committed
    between rollbacks: the rounds from one rejection (a round that commits fewer draft tokens than
    it drafted) to the next, or to the end, each give one run of tokens, and this is their mean
    length; acceptance: accepted over drafted tokens; Tp: the target's verification of a round; Tq:
    the draft's forward for one drafted token (both timed by the engine); pre_verify_rounds: rounds
    of one token drafted right after a rollback (ParallelVLM's pre-verify mode, stages/draft.py).
    For a tree proposal a round's `drafted` is the tree's depth (the most it could accept), so
    per_position_acceptance is the acceptance by depth, and `tree_nodes` its size."""

    committed: int                  # tokens committed in all
    accepted: tuple = ()            # per round: draft tokens accepted
    drafted: tuple = ()             # per round: draft tokens verified
    windows: tuple = ()             # per round: the γ the draft used
    verify_s: tuple = ()            # per round: Tp
    tq_s: float | None = None       # the draft's mean time per drafted token
    stale_proposals: int = 0        # rounds drafted ahead on a prefix the target did not commit
    pre_verify_rounds: int = 0      # one-token rounds right after a rollback (pre-verify)
    tree_nodes: tuple = ()          # per round of a tree proposal: its nodes (`drafted` is then its depth)

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    def per_position_acceptance(self) -> list[float]:
        """Share of the rounds that drafted a token at position i whose draft was accepted up to i."""
        k_max = max(self.drafted, default=0)
        return [round(sum(a > i for a in self.accepted) / max(1, sum(d > i for d in self.drafted)), 4)
                for i in range(k_max)]

    def runs_between_rollbacks(self) -> int:
        """Rounds with a rejection, plus a last run that ended without one (EOS, the token budget)."""
        rejections = [a < d for a, d in zip(self.accepted, self.drafted)]
        return sum(rejections) + (1 if rejections and not rejections[-1] else 0)

    def metrics(self) -> dict:
        rounds = self.rounds
        runs = self.runs_between_rollbacks()
        return {"rounds": rounds, "stale_proposals": self.stale_proposals,
                "pre_verify_rounds": self.pre_verify_rounds,
                "mean_accepted_length": round(self.committed / rounds, 4) if rounds else None,
                "tokens_per_rollback": round(self.committed / runs, 4) if runs else None,
                "acceptance_rate": round(sum(self.accepted) / max(1, sum(self.drafted)), 4),
                "per_position_acceptance": self.per_position_acceptance(),
                "window_mean": round(sum(self.windows) / len(self.windows), 3) if self.windows else None,
                "window_last": self.windows[-1] if self.windows else None,
                "tp_ms": round(1000 * sum(self.verify_s) / len(self.verify_s), 3) if self.verify_s else None,
                "tq_ms": round(1000 * self.tq_s, 3) if self.tq_s else None,
                **({"tree_nodes_mean": round(sum(self.tree_nodes) / len(self.tree_nodes), 2)} if self.tree_nodes else {})}


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
