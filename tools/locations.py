"""Does a toy model know where things are? Two measurements behind the zoo's move errors.

    python -m tools.locations                                   # the shipped Qwen target, 24 videos
    python -m tools.locations --model /tmp/qwen-target --videos 8

1. A location probe: a linear classifier fitted on the visual tokens the language model receives
   (`lm.encode`) of the board cells that hold an object, predicting the cell's row and column;
   fitted on the first half of the videos, scored on the second (chance: 1/3 each). Qwen2.5-VL's
   MRoPE gives height and width the lowest rotary frequencies, so unless the vision tower puts the
   location into the token's content the language model cannot tell where an object is.
2. Recall by event kind of the model's greedy descriptions (moves by direction): which true events
   the description states, counted as a bag per video (each stated event matches at most one true
   one), so it says which kinds are missed; the F1 of `world.score` also checks their order.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from models.decoding import greedy_answer
from models.load import load_model
from zoo import captions, world
from zoo.card import PROMPT, answer_budget, frames_of
from zoo.train.labels import cell_labels


def kind_of(key: tuple[str, ...]) -> str:
    """An event key's kind, moves with their direction ("move left")."""
    return f"move {key[-1]}" if key[0] == "move" else key[0]


def recall_by_kind(described: list[tuple[str, world.Truth]]) -> dict[str, tuple[int, int]]:
    """{kind: (true events stated, true events)} over (text, truth) pairs."""
    hit, total = Counter(), Counter()
    for text, truth in described:
        stated = Counter(captions.parse(text))
        for key in (e.key() for e in truth.events):
            total[kind_of(key)] += 1
            if stated[key] > 0:
                stated[key] -= 1
                hit[kind_of(key)] += 1
    return {k: (hit[k], total[k]) for k in sorted(total)}


def fit_linear_probe(features: torch.Tensor, labels: torch.Tensor, n_classes: int, steps: int = 300) -> torch.nn.Linear:
    """A linear classifier on standardised features (Adam, a little weight decay, full batch)."""
    torch.manual_seed(0)
    probe = torch.nn.Linear(features.shape[1], n_classes)
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(probe(features), labels).backward()
        opt.step()
    return probe


def location_probe(tokens: list[torch.Tensor], cells: list[torch.Tensor]) -> dict[str, float]:
    """Held-out accuracy of row and column probes on object-cell tokens. tokens: per video the
    visual tokens [n, d]; cells: per video `cell_labels` [n, len(AUX)] (shape, ..., row, column)."""
    half = len(tokens) // 2
    x = torch.cat(tokens).float()
    labels = torch.cat(cells)
    is_first_half = torch.cat([torch.full((len(t),), i < half) for i, t in enumerate(tokens)])
    keep = labels[:, 0] > 0                                   # cells holding an object
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-6)
    train, test = keep & is_first_half, keep & ~is_first_half
    out = {}
    for name, column in (("row", -2), ("column", -1)):
        y = labels[:, column]
        probe = fit_linear_probe(x[train], y[train], world.GRID)
        with torch.no_grad():
            out[name] = float((probe(x[test]).argmax(1) == y[test]).float().mean())
    return out


def measure(model: str, videos: int = 24, first_seed: int = 0, seconds: float = 30.0) -> dict:
    lm = load_model(model)
    if lm.arch != "qwen2_5_vl":
        raise ValueError(f"{model} is a {lm.arch} model; the location probe reads Qwen2.5-VL's 3x3 visual tokens")
    tokens, cells, described = [], [], []
    for seed in range(first_seed, first_seed + videos):
        frames, truth = frames_of(seed, seconds, lm.fps)
        with torch.inference_mode():
            tokens.append(lm.encode(frames))
            text = lm.tokenizer.decode(greedy_answer(lm, frames, lm.fps, PROMPT, answer_budget(truth)),
                                       skip_special_tokens=True)
        cells.append(cell_labels(world.make_world(seed, seconds), lm.fps, frames.shape[0], lm.frames_per_step))
        described.append((text, truth))
    return {"probe": location_probe(tokens, cells), "recall": recall_by_kind(described)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.locations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo/weights/qwen-target")
    ap.add_argument("--videos", type=int, default=24)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    result = measure(args.model, args.videos, args.first_seed, args.seconds)
    probe = result["probe"]
    print(f"location probe on object cells (chance 0.33): row {probe['row']:.2f}, column {probe['column']:.2f}")
    print("| event kind | stated | true | recall |\n|---|---|---|---|")
    for kind, (hit, total) in result["recall"].items():
        print(f"| {kind} | {hit} | {total} | {hit / total:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
