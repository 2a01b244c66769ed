"""The toy world's caption grammar, its prompts, and the event-level scorer of a description.

The caption is one clause per event, in time order, from this grammar (`vocabulary()` lists
every word it and the prompts use; 44 words):

    the background is|turns <plain|striped|checkered> .
    a <small|large> <color> <shape> appears .
    the <color> <shape> disappears|grows|shrinks .
    the <color> <shape> moves <left|right|up|down> .
    the <color> <shape> turns <color> .

There are no time words ("then", "in the middle"): clause order already carries the order, which
is all the scorer checks, and coarse time words would depend on the video's length (the middle of
30 s and of 10 min), so a model would have to count frames to place them; they would cost tokens
on every clause without adding anything a scorer can check.
"""

from __future__ import annotations

import re
from collections import Counter

import numpy as np

from zoo.world import (
    BACKGROUNDS,
    COLORS,
    DIRECTIONS,
    SHAPES,
    SIZES,
    Event,
    Truth,
    _pick,
)

__all__ = ["caption", "clause", "colors_at_end", "prompts", "parse", "score", "score_reference", "vocabulary"]



_VERB = {"appear": "appears", "disappear": "disappears", "move": "moves", "recolor": "turns",
         "grow": "grows", "shrink": "shrinks"}
_KIND = {verb: kind for kind, verb in _VERB.items()}
_PROMPT_WORDS = ("describe", "video", "what", "happened", "after", "appeared", "color", "at", "end", "nothing")


def vocabulary() -> list[str]:
    """Every word the captions, prompts and answers can contain, '.' and '?' included."""
    words = ["the", "a", "background", "is", *_VERB.values(), *SIZES, *COLORS, *SHAPES, *BACKGROUNDS,
             *DIRECTIONS, *_PROMPT_WORDS, ".", "?"]
    assert len(set(words)) == len(words)
    return words


def clause(e: Event) -> str:
    """The one clause of the grammar that states event `e`."""
    if e.kind == "background":   # the first background is stated, later ones are changes
        return f"the background {'is' if e.time == 0 else 'turns'} {e.change} ."
    if e.kind == "appear":
        return f"a {e.size} {e.color} {e.shape} appears ."
    return " ".join(["the", e.color, e.shape, _VERB[e.kind], *([e.change] if e.change else []), "."])


def caption(truth: Truth) -> str:
    """The reference description: one clause per event, in time order ('' when there are none)."""
    return " ".join(clause(e) for e in truth.events)


def prompts(truth: Truth, rng) -> list[tuple[str, str]]:
    """(prompt, reference answer) pairs: the description, what happened after one appearance
    (one whose color and shape no other appearance has, so the question names one event), and
    the color of one object on screen at the end (when there is one). `rng`: a seed or a
    numpy Generator."""
    rng = np.random.default_rng(rng)
    events = truth.events
    pairs = [("describe the video .", caption(truth))]
    appearances = Counter((e.color, e.shape) for e in events if e.kind == "appear")
    unique = [i for i, e in enumerate(events) if e.kind == "appear" and appearances[e.color, e.shape] == 1]
    if unique:
        i = _pick(rng, unique)
        rest = caption(Truth(truth.seconds, events[i + 1:]))
        pairs.append((f"what happened after the {events[i].color} {events[i].shape} appeared ?", rest or "nothing ."))
    final = colors_at_end(truth)
    if final:
        shape = _pick(rng, sorted(final))
        pairs.append((f"what color is the {shape} at the end ?", f"{final[shape]} ."))
    return pairs


def colors_at_end(truth: Truth) -> dict[str, str]:
    """shape -> color of each object on screen at the end (shapes on screen are distinct)."""
    on_screen: dict[int, list[str]] = {}
    for e in truth.events:
        if e.kind == "appear":
            on_screen[e.obj] = [e.shape, e.color]
        elif e.kind == "disappear":
            del on_screen[e.obj]
        elif e.kind == "recolor":
            on_screen[e.obj][1] = e.change
    return dict(on_screen.values())


# ------------------------------------------------------------------------------------ scorer

def parse(text: str) -> list[tuple[str, ...]]:
    """The event keys (see Event.key) a text states, in order. Clauses end at '.', '?', '!', ';'
    or ','; a clause that is not exactly one of the grammar's forms (an unknown word, a missing
    or extra word) states nothing."""
    keys = []
    for part in re.split(r"[.?!;,]", text.lower()):
        match part.split():
            case ["the", "background", "is" | "turns", kind] if kind in BACKGROUNDS:
                keys.append(("background", kind))
            case ["a", size, color, shape, "appears"] if size in SIZES and color in COLORS and shape in SHAPES:
                keys.append(("appear", size, color, shape))
            case ["the", color, shape, "disappears" | "grows" | "shrinks" as verb] if color in COLORS and shape in SHAPES:
                keys.append((_KIND[verb], color, shape))
            case ["the", color, shape, "moves", direction] if color in COLORS and shape in SHAPES and direction in DIRECTIONS:
                keys.append(("move", color, shape, direction))
            case ["the", color, shape, "turns", new] if color in COLORS and shape in SHAPES and new in COLORS:
                keys.append(("recolor", color, shape, new))
    return keys


def score(text: str, truth: Truth) -> dict:
    """Event-level precision, recall and F1 of `text` against the truth.

    A generated event matches a true one when its kind and the object's attributes agree (equal
    keys). The matching is the longest common subsequence of the two event sequences: the most
    pairs that keep both time orders. Greedy in-order matching could let one early false match
    use up a true event that a later clause should have taken; order-free (bag) matching would
    credit a right event told in the wrong place ('turns green' before 'appears'). Clauses that
    do not parse are not counted at all; nothing parsed gives 0 (unless the truth has no events
    either)."""
    generated, reference = parse(text), [e.key() for e in truth.events]
    matched = _lcs_length(generated, reference)
    if not generated or not reference:
        p = r = f1 = float(not generated and not reference)
    else:
        p, r = matched / len(generated), matched / len(reference)
        f1 = 2 * p * r / (p + r) if matched else 0.0
    return {"precision": p, "recall": r, "f1": f1, "matched": matched,
            "generated": len(generated), "reference": len(reference)}


def score_reference(text: str, reference: dict) -> dict:
    """`score` against a request's reference (a Truth as `Truth.to_dict` wrote it): precision,
    recall, F1 and the truth's event count, the figures a caption_eval run reports per video.
    The score stage names this function in its config."""
    truth = Truth.from_dict(reference)
    values = score(text, truth)
    return {k: values[k] for k in ("precision", "recall", "f1")} | {"events": len(truth.events)}


def _lcs_length(a: list, b: list) -> int:
    """Length of the longest common subsequence, bit-parallel (Allison & Dix 1986; Hyyrö 2004):
    one Python int holds a whole DP column, so a 10-min video's 150 events cost 150 big-int
    steps, not 150 x 150 Python ones."""
    positions: dict = {}
    for i, x in enumerate(a):
        positions[x] = positions.get(x, 0) | (1 << i)
    everything = (1 << len(a)) - 1
    v = everything
    for y in b:
        u = v & positions.get(y, 0)
        v = ((v + u) | (v - u)) & everything
    return len(a) - v.bit_count()
