"""Does a toy model keep its place while it describes a long video? The measurement behind the
zoo's 120-s goal.

    python -m tools.grounding                                   # the shipped Qwen target, 30/60/120 s
    python -m tools.grounding --model /tmp/qwen-target --seconds 30,120 --videos 8

Teacher-forced on the reference description of each held-out video, by clause j (the j-th event
stated): the attention mass the grounding head (the first head of `--layer`, by default the
second-to-last, as `train.ground_layer`) puts on the visual tokens that show event j
(`zoo.train.labels.event_tokens`), and the share of clause j's tokens the model predicts
greedily. A model that finds each event from where the text is, rather than from what it has
stated, holds up to the number of events it was trained on and falls off after (docs/zoo.md, "Keeping
its place").
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForImageTextToText

from zoo.shapes import FPS
from zoo.tokenizer import build_tokenizer
from zoo.train.data import example, model_inputs


def by_clause(net, tokenizer, seeds, seconds: float, layer: int | None = None) -> dict[str, list[float]]:
    """{"mass": [...], "accuracy": [...]}, each indexed by clause and averaged over the videos of
    `seeds` that state that many events (`net` with eager attention, which returns the weights)."""
    layers = net.config.text_config.num_hidden_layers
    layer = max(1, layers - 2) if layer is None else layer
    dot = tokenizer.convert_tokens_to_ids(".")
    mass: dict[int, list[float]] = {}
    accuracy: dict[int, list[float]] = {}
    for seed in seeds:
        ex = example(seed, seconds, FPS[net.config.model_type])
        batch = model_inputs(net.config, tokenizer, [ex], with_answers=True)
        looks_at = batch.pop("ground_mask")[0]
        for key in ("cell_labels", "event_labels", "chain_mask"):
            batch.pop(key, None)
        with torch.inference_mode():
            out = net(**batch, output_attentions=True)
        labels, guess = batch["labels"][0], out.logits[0].argmax(-1)
        attention = out.attentions[layer][0, 0]
        clause = 0
        for q in range(labels.shape[0] - 1):        # logits at q predict token q + 1
            target = int(labels[q + 1])
            if target == -100:
                continue
            accuracy.setdefault(clause, []).append(float(guess[q] == target))
            if looks_at[q].any():
                mass.setdefault(clause, []).append(float(attention[q][looks_at[q]].sum()))
            if target == dot:
                clause += 1

    def mean(d: dict[int, list[float]]) -> list[float]:
        return [sum(d[j]) / len(d[j]) for j in sorted(d)]
    return {"mass": mean(mass), "accuracy": mean(accuracy)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.grounding", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo/weights/qwen-target")
    ap.add_argument("--seconds", default="30,60,120", help="comma-separated video lengths")
    ap.add_argument("--videos", type=int, default=4)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--layer", type=int, default=None)
    args = ap.parse_args(argv)
    net = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32).eval()
    net.set_attn_implementation("eager")
    tokenizer = build_tokenizer(net.config.model_type)
    lengths = [float(s) for s in args.seconds.split(",")]
    seeds = range(args.first_seed, args.first_seed + args.videos)
    rows = {s: by_clause(net, tokenizer, seeds, s, args.layer) for s in lengths}
    print(f"{args.model}, {args.videos} videos: grounding mass on the stated event / tokens right, by clause")
    print("| clause | " + " | ".join(f"{s:g} s" for s in lengths) + " |")
    print("|---|" + "---|" * len(lengths))
    for j in range(max(len(r["mass"]) for r in rows.values())):
        cells = [f"{r['mass'][j]:.2f} / {r['accuracy'][j]:.2f}" if j < len(r["mass"]) else "" for r in rows.values()]
        print(f"| {j + 1} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
