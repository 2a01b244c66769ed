"""The local video task: held-out toy videos with multiple-choice questions built from their truth,
in lmms-eval's task format (evaluation/tasks/reelflow_toy), needing no download.

Each question is asked in the toy models' own grammar (the only prompts they read) and scored
exactly by reading the free answer onto the options, as long-video benchmarks read a free answer
onto a letter:

- color: "what color is the <shape> at the end ?" → four colours; the answer's first colour word;
- events: "what happened after the <color> <shape> appeared ?" → four event clauses, the true
  next event among three others of the same video; the answer's first clause;
- order: "describe the video ." → two events of the video, "which came first"; whichever of the
  two the description states first.

An answer that states none of the options is wrong. The videos are made on first use into
reelflow's cache (zoo.videos.ensure_video, the held-out seeds); questions.jsonl, written by

    python -m evaluation.toy_task          # rewrites evaluation/tasks/reelflow_toy/questions.jsonl

carries everything else (seed, length, fps, size, the question, its options and answer), so the
shipped file and the videos it names are reproducible from their random seeds alone.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from zoo.captions import clause, colors_at_end, parse
from zoo.world import COLORS, make_world

TASK_DIR = Path(__file__).resolve().parent / "tasks" / "reelflow_toy"
QUESTIONS = TASK_DIR / "questions.jsonl"
SEEDS = tuple(range(8))          # held-out random seeds: below those the zoo trains on (zoo.videos.held_out_requests)
SECONDS, FPS, SIZE = 30.0, 2.0, 84
LETTERS = "ABCD"


def _mixed(rng: np.random.Generator, right: str, others: list[str]) -> tuple[list[str], int]:
    """The right option among `others` in a seeded order -> (options, index of the right one)."""
    options = [right, *others]
    order = rng.permutation(len(options))
    options = [options[i] for i in order]
    return options, options.index(right)


def questions(seed: int, seconds: float = SECONDS, fps: float = FPS, size: int = SIZE) -> list[dict]:
    """The questions of the toy video of `seed`: at most one of each kind, from its truth."""
    rng = np.random.default_rng(seed)
    truth = make_world(seed, seconds).truth
    events = truth.events
    video = {"seed": seed, "seconds": seconds, "fps": fps, "size": size}
    docs = []

    final = colors_at_end(truth)        # shape -> its colour at the end
    if final:
        shape = sorted(final)[int(rng.integers(len(final)))]
        wrong = [c for c in sorted(COLORS) if c != final[shape]]
        options, answer = _mixed(rng, final[shape], [wrong[i] for i in rng.choice(len(wrong), 3, replace=False)])
        docs.append({"kind": "color", "prompt": f"what color is the {shape} at the end ?",
                     "question": f"What color is the {shape} at the end of the video?", "options": options,
                     "answer": answer})

    clauses = [clause(e) for e in events]
    # an appearance whose colour and shape no other appearance has (the question names one event),
    # followed by an event, with three other distinct clauses in the video to offer beside it
    appearances = [(e.color, e.shape) for e in events if e.kind == "appear"]
    candidates = [i for i, e in enumerate(events[:-1])
                  if e.kind == "appear" and appearances.count((e.color, e.shape)) == 1
                  and len({c for j, c in enumerate(clauses) if j != i + 1 and c != clauses[i + 1]}) >= 3]
    if candidates:
        i = candidates[int(rng.integers(len(candidates)))]
        others = sorted({c for j, c in enumerate(clauses) if j != i + 1 and c != clauses[i + 1]})
        options, answer = _mixed(rng, clauses[i + 1], [others[k] for k in rng.choice(len(others), 3, replace=False)])
        named = f"{events[i].color} {events[i].shape}"
        docs.append({"kind": "events", "prompt": f"what happened after the {named} appeared ?",
                     "question": f"What happened right after the {named} appeared?", "options": options,
                     "answer": answer})

    distinct = [i for i, c in enumerate(clauses) if clauses.count(c) == 1 and events[i].kind != "background"]
    if len(distinct) >= 2:
        a, b = sorted(rng.choice(distinct, 2, replace=False))
        options, answer = _mixed(rng, clauses[a], [clauses[b]])
        docs.append({"kind": "order", "prompt": "describe the video .",
                     "question": "Which of these happened first in the video?", "options": options, "answer": answer})

    return [{"id": f"s{seed}-{d['kind']}", **video, **d} for d in docs]


def chosen(kind: str, answer: str, options: list[str]) -> int:
    """The option a free answer states (its index), or -1 when it states none of them."""
    if kind == "color":
        words = [w for w in answer.lower().replace(".", " ").split() if w in COLORS]
        return options.index(words[0]) if words and words[0] in options else -1
    stated = parse(answer)
    keys = [clause_key(o) for o in options]
    if kind == "events":
        return keys.index(stated[0]) if stated and stated[0] in keys else -1
    if kind == "order":        # the option the description states first
        firsts = [(stated.index(k), n) for n, k in enumerate(keys) if k in stated]
        return min(firsts)[1] if firsts else -1
    raise ValueError(f"unknown question kind {kind!r}")


def clause_key(clause: str) -> tuple[str, ...]:
    """The event key (zoo.world.Event.key) one clause of the grammar states."""
    keys = parse(clause)
    if len(keys) != 1:
        raise ValueError(f"not one clause of the toy grammar: {clause!r}")
    return keys[0]


def multiple_choice(doc: dict) -> str:
    """The question with lettered options, as a person (or a real checkpoint) would read it."""
    lines = [doc["question"], *(f"{LETTERS[i]}. {o.rstrip(' .')}" for i, o in enumerate(doc["options"]))]
    return "\n".join(lines + ["Answer with the option's letter."])


def write_questions(path: Path = QUESTIONS, seeds=SEEDS) -> list[dict]:
    docs = [d for seed in seeds for d in questions(seed)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    return docs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Write the local lmms-eval task's questions from the toy truth.")
    parser.add_argument("--out", type=Path, default=QUESTIONS)
    args = parser.parse_args(argv)
    docs = write_questions(args.out)
    kinds = {k: sum(d["kind"] == k for d in docs) for k in ("color", "events", "order")}
    print(f"{len(docs)} questions ({', '.join(f'{n} {k}' for k, n in kinds.items())}) -> {args.out}")


if __name__ == "__main__":
    main()
