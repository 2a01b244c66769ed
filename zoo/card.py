"""The toy zoo's model card: every shipped model's caption F1 on held-out videos at the training
length and 4x longer, and each draft's greedy agreement with its target.

    python -m zoo.card                    # writes zoo/weights/README.md and card.json
    python -m zoo.card --videos 4         # quicker

Greedy agreement: along the target's own greedy answer, the share of positions where the draft's
most likely next token (given the same prefix, the same video and the same prompt) is the
target's token. It is the per-token acceptance a greedy speculative decoder would see with this
draft; it is measured teacher-forced, one draft forward over the whole answer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from models.decoding import greedy_answer, prefill_video
from models.load import load_model
from models.pruning import keep_top, uv_scores
from zoo import WEIGHTS, captions, world
from zoo.videos import ensure_video

PROMPT = "describe the video ."
PAIRS = (("qwen-target", "qwen-draft"), ("llava-target", "llava-draft"))


def answer_budget(truth: world.Truth) -> int:
    """The tokens a description may take: room for every event's clause (each a few words) and more."""
    return 8 * len(truth.events) + 16


def agreement(draft, frames, fps, answer: list[int], keep: torch.Tensor | None = None) -> tuple[int, int]:
    """(positions where the draft's greedy token equals the target's, positions). `keep`: the
    indices of the visual tokens the draft sees (uv_keep), each prefilled at its own position as
    ParallelVLM's draft does (stages.prefill.SelectedPrefill); None: all of them."""
    if keep is None:
        cache, layout, logits = prefill_video(draft, frames, fps, PROMPT)
    else:
        layout = draft.layout(PROMPT, frames.shape[0], tuple(frames.shape[-2:]), fps)
        embeds = draft.embed(layout.ids, draft.encode(frames), layout.video_start)
        end = layout.video_start + layout.n_video
        rows = torch.cat([torch.arange(layout.video_start), layout.video_start + keep.cpu(),
                          torch.arange(end, layout.length)])
        cache = draft.new_cache()
        logits = draft.prefill(cache, embeds[rows], layout.positions[:, rows])
    if len(answer) > 1:
        rest = draft.score(cache, torch.tensor(answer[:-1]), layout.length, layout)
        logits = torch.cat([logits[None], rest])
    else:
        logits = logits[None]
    guess = logits.argmax(-1).tolist()
    return sum(int(g == a) for g, a in zip(guess, answer)), len(answer)


def uv_keep(target, frames, fps, alpha: float, layers=(0, 1, 2)) -> torch.Tensor:
    """The visual tokens UV-Prune keeps at the paper's pruning ratio `alpha` (the share dropped:
    the UVPrune stage's keep = 1 − α, with its defaults: variant as_written, the query as text),
    from `target`'s prefill of the whole video. The zoo's agreement tables are in the paper's α."""
    layout = target.layout(PROMPT, frames.shape[0], tuple(frames.shape[-2:]), fps)
    taps: dict[int, torch.Tensor] = {}
    target.prefill(target.new_cache(), target.embed(layout.ids, target.encode(frames), layout.video_start),
                   layout.positions, taps=layers, on_tap=lambda layer, h: taps.__setitem__(layer, h), logits="none")
    scores = uv_scores(taps, layout.video, torch.arange(layout.video_start + layout.n_video, layout.length),
                       sorted(layers))
    return keep_top(scores, 1.0 - alpha)


def frames_of(seed: int, seconds: float, fps: float) -> tuple[torch.Tensor, world.Truth]:
    from video import read_video

    path, truth = ensure_video(seed, seconds)
    frames, _ = read_video(path, fps=fps, size=84)
    return frames, truth


def evaluate(videos: int = 8, lengths=(30, 120), long_videos: int = 4, pairs=PAIRS) -> dict:
    from tqdm import tqdm

    card = {}
    for target_name, draft_name in pairs:
        if not (WEIGHTS / target_name).is_dir():
            continue
        target = load_model(str(WEIGHTS / target_name), name=target_name)
        draft = load_model(str(WEIGHTS / draft_name), name=draft_name) if (WEIGHTS / draft_name).is_dir() else None
        for lm in (target, draft):
            if lm is None:
                continue
            row = {"arch": lm.arch, "parameters": sum(p.numel() for p in lm.model.parameters()), "fps": lm.fps}
            for seconds in lengths:
                n = videos if seconds == lengths[0] else long_videos
                f1, t0, agree = [], time.perf_counter(), [0, 0]
                for seed in tqdm(range(n), desc=f"{lm.name} {seconds} s", leave=False):
                    frames, truth = frames_of(seed, seconds, lm.fps)
                    answer = greedy_answer(lm, frames, lm.fps, PROMPT, answer_budget(truth))
                    f1.append(captions.score(lm.tokenizer.decode(answer, skip_special_tokens=True), truth)["f1"])
                    if lm is target and draft is not None and seconds == lengths[0]:
                        a, b = agreement(draft, frames, lm.fps, answer)
                        agree[0] += a
                        agree[1] += b
                row[f"f1_{seconds:g}s"] = round(float(np.mean(f1)), 4)
                row[f"videos_{seconds:g}s"] = n
                row[f"s_per_video_{seconds:g}s"] = round((time.perf_counter() - t0) / n, 3)
                if agree[1]:
                    card.setdefault(draft.name, {})["greedy_agreement_with_target"] = round(agree[0] / agree[1], 4)
            training = json.loads((WEIGHTS / lm.name / "training.json").read_text())
            stages = []
            while training:                       # a continued checkpoint carries its earlier stages
                stages.append(training)
                training = training.get("init_training")
            row.update(steps=sum(t["steps"] for t in stages), train_s=round(sum(t["train_s"] for t in stages), 1),
                       stages=len(stages))
            card.setdefault(lm.name, {}).update(row)
    return card


def write_card(card: dict, out: Path = WEIGHTS) -> Path:
    cols = ["model", "arch", "parameters", "fps", "f1_30s", "f1_120s", "greedy_agreement_with_target", "steps",
            "stages", "train_s"]
    lines = ["# The toy zoo", "",
             "Trained here by `python -m run +experiment=train_toy train.model=NAME`; evaluated by "
             "`python -m zoo.card` on held-out seeds (0..n-1; training uses seeds >= 1e6). "
             "F1: event-level caption F1 (zoo.captions.score) of the greedy description; "
             "120 s is 4x the 30-s training length (training lengths: 2-32 s). Greedy agreement: "
             "share of the target's greedy tokens the draft predicts greedily given the same prefix.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, row in card.items():
        lines.append("| " + " | ".join(str(row.get(c, "")) if c != "model" else name for c in cols) + " |")
    path = out / "README.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zoo.card", description=__doc__.split("\n\n")[0])
    ap.add_argument("--videos", type=int, default=8, help="held-out videos at the training length")
    ap.add_argument("--long-videos", type=int, default=4, help="held-out videos 4x longer")
    ap.add_argument("--family", choices=["qwen", "llava"], help="evaluate one pair and keep the other's rows")
    args = ap.parse_args(argv)
    pairs = [p for p in PAIRS if not args.family or p[0].startswith(args.family)]
    card = evaluate(args.videos, long_videos=args.long_videos, pairs=pairs)
    previous = WEIGHTS / "card.json"
    if args.family and previous.is_file():
        card = {**{k: v for k, v in json.loads(previous.read_text()).items() if not k.startswith(args.family)}, **card}
    print(write_card(card).read_text())


if __name__ == "__main__":
    main()
