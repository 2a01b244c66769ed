"""Is it the length or the number of events? A toy target's F1 on worlds of chosen length and
chosen time between events.

    python -m tools.density                                     # the shipped Qwen target, 4 cases
    python -m tools.density --model zoo/weights/llava-target --cases 30:2-6,120:8-24

A 2-min toy video has 4x the seconds, the visual tokens and the events of a 30-s one. caption_eval
at 30 s x 4 fps (`data.toy.fps`) varies the tokens alone; this varies the events: each case is
`seconds:low-high`, the range the gaps between events are drawn from (the zoo's is 2-6 s,
`world.GAP_S`), so 120:8-24 is a 2-min video with a 30-s video's ~9 events and 60:1.25-2.5 a
1-min one with a 2-min video's ~31. Frames are rendered (not through H.264), the description is
reelflow's greedy decoding, scored by `world.score`; validation seeds (200 on) by default.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from tqdm import tqdm

from models.decoding import greedy_answer
from models.load import load_model
from zoo import captions, world
from zoo.card import PROMPT, answer_budget
from zoo.train.data import example

DEFAULT_CASES = "30:2-6,120:8-24,30:1.25-2.5,60:1.25-2.5"


def parse_cases(text: str) -> list[tuple[float, tuple[float, float]]]:
    """'30:2-6,120:8-24' -> [(30.0, (2.0, 6.0)), (120.0, (8.0, 24.0))]."""
    cases = []
    for item in text.split(","):
        try:
            seconds, gaps = item.split(":")
            low, high = (float(g) for g in gaps.split("-"))
            seconds = float(seconds)
        except ValueError:
            raise ValueError(f"case {item!r}: expected seconds:low-high, e.g. 120:8-24") from None
        if not (seconds > 0 and world.MOVE_S <= low <= high):
            raise ValueError(f"case {item!r}: need seconds > 0 and {world.MOVE_S} s <= low <= high "
                             f"(a move glides for {world.MOVE_S} s, so events cannot come closer)")
        cases.append((seconds, (low, high)))
    return cases


def measure(model: str, cases, videos: int = 12, first_seed: int = 200) -> list[dict]:
    """Per case: mean and max true events, mean F1 over the videos."""
    lm = load_model(model)
    rows = []
    for seconds, gaps in cases:
        f1s, events = [], []
        for seed in tqdm(range(first_seed, first_seed + videos), desc=f"{seconds:g} s, gaps {gaps[0]:g}-{gaps[1]:g} s"):
            ex = example(seed, seconds, lm.fps, gap_s=gaps)
            with torch.inference_mode():
                ids = greedy_answer(lm, ex.frames, lm.fps, PROMPT, answer_budget(ex.truth))
            f1s.append(captions.score(lm.tokenizer.decode(ids, skip_special_tokens=True), ex.truth)["f1"])
            events.append(len(ex.truth.events))
        rows.append({"seconds": seconds, "gaps": gaps, "events": statistics.mean(events),
                     "max_events": max(events), "f1": statistics.mean(f1s)})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.density", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo/weights/qwen-target")
    ap.add_argument("--cases", default=DEFAULT_CASES, help="seconds:low-high,... (default %(default)s)")
    ap.add_argument("--videos", type=int, default=12)
    ap.add_argument("--first-seed", type=int, default=200)
    args = ap.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        ap.error(str(e))
    print("| seconds | gaps (s) | events (max) | F1 |\n|---|---|---|---|")
    for r in measure(args.model, cases, args.videos, args.first_seed):
        print(f"| {r['seconds']:g} | {r['gaps'][0]:g}-{r['gaps'][1]:g} | {r['events']:.1f} ({r['max_events']}) | {r['f1']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
