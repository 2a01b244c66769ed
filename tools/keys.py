"""What a toy model's keys say about its visual tokens: the evidence behind QuickPrefill's
importance functions on the toy zoo.

    python -m tools.keys                      # the shipped Qwen target, 6 held-out 30-s videos
    python -m tools.keys --model zoo/weights/llava-target --videos 4

Per decoder layer: the mean key norm (over all KV heads, as stages.prune scores it) of the visual
tokens whose board cell holds an object and of the empty ones; the share of object tokens among
the half that key-norm pruning keeps (the smallest keys); and the Spearman correlation between
−‖k‖ (the key-norm score) and the attention the question pays each visual token. Key-norm pruning
works where that correlation is high (Devoto et al. found it so in large LLMs).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from models.load import load_model
from stages.prune import key_norm_scores
from zoo import world
from zoo.shapes import FRAME_SIZE
from zoo.train.labels import cell_labels
from zoo.videos import render


def _ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().float()


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([_ranks(a), _ranks(b)]))[0, 1])


def layer_report(model: str, videos: int = 6, first_seed: int = 200, seconds: float = 30.0) -> list[dict]:
    lm = load_model(model)
    fps = lm.fps
    step = lm.frames_per_step
    per_layer = [{"object": [], "empty": [], "scores": [], "attention": []} for _ in lm.text.layers]
    for seed in range(first_seed, first_seed + videos):
        w = world.make_world(seed, seconds)
        frames = torch.from_numpy(np.stack(list(render(w, fps, FRAME_SIZE)))).permute(0, 3, 1, 2).contiguous()
        layout = lm.layout("describe the video .", frames.shape[0], tuple(frames.shape[-2:]), fps)
        embeds = lm.embed(layout.ids, lm.encode(frames), layout.video_start)
        end = layout.video_start + layout.n_video
        cache = lm.new_cache()
        with torch.inference_mode():
            lm.prefill(cache, embeds[:end], layout.positions[:, :end], logits="none")
            attention = lm.attention_scores(cache, embeds[end:], layout.positions[:, end:],
                                            layers=range(1, len(lm.text.layers) + 1))
        has_object = cell_labels(w, fps, frames.shape[0], step)[:, 0] > 0
        cells = slice(layout.video_start, layout.video_start + has_object.shape[0])   # LLaVA's newline token left out
        for layer, row in enumerate(per_layer):
            norms = -key_norm_scores(lm.layer_kv(cache, layer)[0][:, cells])
            row["object"].append(norms[has_object])
            row["empty"].append(norms[~has_object])
            row["scores"].append(-norms)
            row["attention"].append(attention[layer + 1][:, cells].mean(0))
    out = []
    for layer, row in enumerate(per_layer):
        obj, empty = torch.cat(row["object"]), torch.cat(row["empty"])
        both = torch.cat([obj, empty])
        kept = both.argsort()[: len(both) // 2]
        out.append({"layer": layer, "key_norm_object": round(float(obj.mean()), 2),
                    "key_norm_empty": round(float(empty.mean()), 2),
                    "objects_among_kept_half": round(float((kept < len(obj)).float().mean()), 3),
                    "object_share": round(len(obj) / len(both), 3),
                    "spearman_score_vs_attention": round(spearman(torch.cat(row["scores"]), torch.cat(row["attention"])), 3)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.keys", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="zoo/weights/qwen-target")
    ap.add_argument("--videos", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=200)
    args = ap.parse_args(argv)
    rows = layer_report(args.model, args.videos, args.first_seed)
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
