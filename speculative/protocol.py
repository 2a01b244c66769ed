"""What a draft and its target say to each other, round by round: the records on the draft ⇄ verify
edges (the graph's port types; stages.types lists them with the others).

A round: the draft sends a `Proposal` (a chain or a tree of tokens continuing what it believes is
committed), the target answers with a `Verdict` (how much it accepted, its own next token, the
committed length). What does not change within a run (which draft, how it prefilled) travels
once, as the first proposal's `DraftInfo`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

# timer(name) -> a context whose value has `.seconds` once it exits: the engine's ctx.timer, or
# speculative.reference.stopwatch off the engine
Timer = Callable[[str], AbstractContextManager]


class RoundKind(str, Enum):
    """WINDOW: the draft's γ tokens (or its tree). PRE_VERIFY: one token drafted right after a
    rollback, so the target verifies it at once while the draft goes on (ParallelVLM's App. B)."""

    WINDOW = "window"
    PRE_VERIFY = "pre_verify"


@dataclass(frozen=True)
class DraftInfo:
    """The run's facts about the draft, for metrics.json (sent with the first proposal only)."""

    model: str                            # the draft model's name, or the head's
    prefill: dict = field(default_factory=dict)   # how the draft prefilled (tokens kept, mode, ...)
    window_setting: int | str | None = None       # γ as configured ("auto": measured); None for a tree

    def metrics(self) -> dict:
        out = {"draft_model": self.model, "draft_prefill": self.prefill}
        if self.window_setting is not None:
            out["window_setting"] = self.window_setting
        return out


@dataclass(frozen=True)
class Proposal:
    """A draft's round: tokens continuing the sequence at `base` (the committed length the draft
    assumed) after token `after` (what it assumed at base − 1; -1: none), so the target can tell a
    round drafted on a prefix it has since rejected (stale)."""

    round: int
    base: int
    tokens: Any                      # int64 [k]
    after: int = -1
    parents: Any = None              # int64 [k]: a tree (speculative.tree); None: a chain
    probs: Any = None                # float [k, V]: the warped q each token was drawn from (sampling)
    kind: RoundKind = RoundKind.WINDOW
    window: int = 0                  # the γ in force (a tree: 0, its depth is recorded)
    wants_features: bool = False     # answer with the target's states of what it cached (Sparrow's head)
    draft_s: float | None = None     # Tq: the draft's mean time per drafted token (per round for a head) so far
    info: DraftInfo | None = None    # the first round only

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


@dataclass(frozen=True)
class Verdict:
    """The target's answer to one proposal."""

    round: int
    accepted: int          # draft tokens accepted (0..k; a tree: the path's length)
    token: int             # the target's own next token (bonus or correction); -1: none (judge_ahead)
    length: int            # committed length after this verdict
    stale: bool = False    # the proposal was built on a prefix already rejected: nothing was verified
    verify_s: float = 0.0  # Tp: the target's forward and rule for this round (for `window: auto`)
    path: tuple = ()       # a tree: the accepted nodes, root to leaf
    features: Any = None   # asked for (wants_features): the target's final-norm states [m, hidden]
    #                        of the tokens this verification cached, in order
