"""Speculative decoding as one plain loop, with no engine: the algorithm every speculative graph runs.

    tokens = speculative_decode(target, drafter, ahead=1)

`target` is a TargetVerifier (speculative.verifier) over the target's prefill; `drafter` a
ModelDrafter (a small model's chain, speculative.model_draft) or a HeadDrafter (Sparrow's tree,
speculative.head_draft). A round is draft → verify → accept → roll back: the drafter proposes
tokens after what it believes is committed; the target scores them in one forward, the rule
accepts a prefix (or a tree path) and adds the target's own next token, and the target's cache
drops the rest; the verdict tells the drafter what was committed, and it rolls its own state back
to that.

`ahead` is how many verdicts the drafter may be behind: 1 drafts, then verifies (vanilla SD,
Sparrow); 2 drafts round i+1 while round i is verified (ParallelVLM), so some rounds are drafted on
a prefix that turns out rejected and are answered stale. `first_from_prefill` commits the target's
first token from its prefill before any round. In a graph the same two objects sit in the draft and
verify nodes, `ahead` is the prime on the verdict edge and `first_from_prefill` a prime on the
proposal edge. Each node consumes its input stream in order and, given its inputs, decides the same
way wherever it runs (its random draws come from its own seeded generator), so a graph's run gives
exactly this loop's tokens and rounds, however its nodes are placed
(tests/speculative/test_reference.py). The one setting outside that premise is `window: auto`,
whose γ follows measured times.
"""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager

import torch


def speculative_decode(target, drafter, *, ahead: int = 1, first_from_prefill: bool = False) -> list[int]:
    """The committed tokens; `target.rounds` holds the round-by-round record (M, acceptance)."""
    if first_from_prefill:
        target.first_from_prefill()
    verdicts = deque([None] * ahead)          # the verdicts the drafter has not read yet
    while verdicts and not target.done:
        proposal = drafter.propose(verdicts.popleft(), stopwatch)     # draft (after rolling back)
        if proposal is None:                  # nothing to draft: every token the budget allows is in flight
            continue
        verdict = target.verify(proposal, stopwatch)                  # verify, accept, roll back
        if verdict is not None:
            verdicts.append(verdict)
    if not target.done:     # in a graph: a loop that waits forever
        raise RuntimeError(f"the drafter stopped proposing after {len(target.rounds.committed)} committed tokens "
                           "before the answer was complete")
    return list(target.rounds.committed)


class Elapsed:
    seconds = 0.0


@contextmanager
def stopwatch(name: str):
    """What the engine's ctx.timer gives a stage, off the engine: the block's wall time in `.seconds`
    (and, under torch.profiler, a region of that name: bench.engine_vs_loop --profile)."""
    elapsed, start = Elapsed(), time.perf_counter()
    with torch.profiler.record_function(name):
        yield elapsed
    elapsed.seconds = time.perf_counter() - start
