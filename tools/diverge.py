"""Where does a description first leave the truth, and how? Reads caption_eval's outputs.

    python -m run -m +experiment=caption_eval data.toy.seconds=30,120 data.toy.videos=24
    python -m tools.diverge outputs/multirun/<date>/<time>_caption_eval   # one table row per job

For each described video it walks the generated events and the true ones side by side (both in
time order) to the first clause where they differ, and sorts that clause into one of:

- complete:        the description states every true event, in order, and nothing more;
- stopped early:   it ends while true events remain;
- ran on:          it states every true event, then more;
- earlier event:   it states an event the video already had (it lost its place and went back);
- next events:     it states one of the next three true events (it skipped some);
- later event:     it states a true event further ahead;
- not in video:    no true event has that key: an object named with the wrong shape or color,
                   the wrong verb, direction or background.

Why this and not only F1: the F1 of a 2-min video says how much is wrong, not which of these
failures a change should address. Measured with it (the shipped Qwen target, seeds 0-23 through
H.264): the first slip comes at about the same clause at 30, 60 and 120 s (8.4, 8.9 and 6.8 on
average), mostly an object named with the wrong shape or color; at 60 s the description recovers
after it (F1 0.83), at 120 s it does not (0.50); and 6 of the 24 120-s descriptions begin with the
wrong background, against 2 of 24 at 60 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from zoo import captions, world

KINDS = ("complete", "stopped early", "ran on", "earlier event", "next events", "later event", "not in video")
NEXT = 3            # "next events": one of this many true events after the one due


@dataclass(frozen=True)
class Divergence:
    index: int      # the first clause (0-based) where generated and true events differ
    kind: str       # one of KINDS
    due: tuple[str, ...] | None = None      # the true event at that clause
    stated: tuple[str, ...] | None = None   # what the description stated there


def first_divergence(generated: list[tuple[str, ...]], reference: list[tuple[str, ...]]) -> Divergence:
    """The first clause at which the generated event keys leave the reference ones (captions.parse /
    Event.key), and what the description did there (see KINDS)."""
    i = 0
    while i < min(len(generated), len(reference)) and generated[i] == reference[i]:
        i += 1
    if i == len(generated) == len(reference):
        return Divergence(i, "complete")
    if i == len(generated):
        return Divergence(i, "stopped early", due=reference[i])
    if i == len(reference):
        return Divergence(i, "ran on", stated=generated[i])
    due, stated = reference[i], generated[i]
    if stated in reference[:i]:
        kind = "earlier event"
    elif stated in reference[i + 1:i + 1 + NEXT]:
        kind = "next events"
    elif stated in reference[i + 1 + NEXT:]:
        kind = "later event"
    else:
        kind = "not in video"
    return Divergence(i, kind, due=due, stated=stated)


def job_divergences(job: Path) -> tuple[float, list[Divergence], list[int]]:
    """(video seconds, divergences, true event counts) for the runs of one caption_eval job
    directory; each run's truth is the JSON the toy cache keeps beside its video."""
    metrics = job / "metrics.json"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no metrics.json (is {job} a caption_eval job directory?)")
    runs = json.loads(metrics.read_text()).get("runs") or []
    if not runs:
        raise ValueError(f"{metrics}: no runs (caption_eval writes one per video)")
    found, counts, seconds = [], [], set()
    for run in runs:
        truth_file = Path(run["video"]["path"]).with_suffix(".json")
        if not truth_file.is_file():
            raise FileNotFoundError(f"{truth_file}: the toy video's truth is gone from the cache; "
                                    f"run caption_eval again to make it")
        truth = world.Truth.from_dict(json.loads(truth_file.read_text()))
        reference = [e.key() for e in truth.events]
        found.append(first_divergence(captions.parse(run.get("output_text") or ""), reference))
        counts.append(len(reference))
        seconds.add(truth.seconds)
    if len(seconds) != 1:
        raise ValueError(f"{metrics}: videos of several lengths {sorted(seconds)}; one job should have one")
    return seconds.pop(), found, counts


def table(rows: list[tuple[float, list[Divergence], list[int]]]) -> str:
    """A markdown table: per video length, the mean first divergent clause (of the mean true
    events) and how many descriptions first diverge in each way."""
    lines = ["| seconds | videos | first divergence (clause) | true events | " + " | ".join(KINDS) + " |",
             "|---" * (4 + len(KINDS)) + "|"]
    for seconds, found, counts in sorted(rows, key=lambda r: r[0]):
        kinds = Counter(d.kind for d in found)
        lines.append(f"| {seconds:g} | {len(found)} | {statistics.mean(d.index for d in found):.1f} | "
                     f"{statistics.mean(counts):.1f} | " + " | ".join(str(kinds[k]) for k in KINDS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.diverge", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", type=Path, help="a caption_eval output directory: one job, or a sweep of them")
    ap.add_argument("--each", action="store_true", help="also list every video's first divergence")
    args = ap.parse_args(argv)
    jobs = [args.runs] if (args.runs / "metrics.json").is_file() else sorted(
        p.parent for p in args.runs.glob("*/metrics.json"))
    if not jobs:
        ap.error(f"{args.runs}: no metrics.json in it or in its job directories")
    try:
        rows = [job_divergences(job) for job in jobs]
    except (FileNotFoundError, ValueError) as e:
        ap.error(str(e))
    print(table(rows))
    if args.each:
        for seconds, found, _ in rows:
            for d in found:
                print(f"{seconds:g} s  clause {d.index:2d}  {d.kind:14s}  due {d.due}  stated {d.stated}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
