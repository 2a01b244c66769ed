"""Drafts' greedy agreement with their target, whole and pruned: zoo.card's definition (along the
target's own greedy description, the share of positions where the draft's greedy token is the
target's), with the draft seeing only the visual tokens ParallelVLM's UV-Prune keeps at each
pruning ratio α (stages.prune.UVPrune's defaults: as written, the query as text; the target's
layers `--uv-layers`, 0 1 2 unless given: the toy Qwen's graph runs 1 2 3, its `model.uv_layers`),
each at its own position as SelectedPrefill prefills them.

    python -m zoo.agreement --target zoo/weights/qwen-target --drafts zoo/weights/qwen-draft \\
        --fps 2 8 --alphas 0 0.5 0.9 --videos 8

Held-out toy videos (seeds 0..videos-1 or from --first-seed, H.264, the caption_eval and card videos) of `--seconds`,
made at each frame rate. Prints a markdown table (one row per draft and frame rate) and, with
--out, writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from models.decoding import greedy_answer
from models.load import load_model
from zoo.card import PROMPT, agreement, answer_budget, uv_keep


def frames_at(seed: int, seconds: float, fps: float):
    from video import read_video
    from zoo.videos import ensure_video

    path, truth = ensure_video(seed, seconds, fps, workers=1)
    frames, _ = read_video(path, fps=fps, size=84)
    return frames, truth


@torch.no_grad()
def measure(target_path: str, draft_paths: list[str], fps_list, alphas, videos: int = 8, seconds: float = 30.0,
            first_seed: int = 0, uv_layers=(0, 1, 2)) -> dict:
    """{draft: {fps: {alpha: agreement}}} (plus "positions" per fps): the target's greedy answer
    and UV-Prune's choice are computed once per video and shared by the drafts."""
    target = load_model(target_path)
    drafts = {path: load_model(path) for path in draft_paths}
    out: dict = {path: {} for path in draft_paths}
    for fps in fps_list:
        hits = {(path, a): 0 for path in draft_paths for a in alphas}
        total, t0 = 0, time.perf_counter()
        for seed in range(first_seed, first_seed + videos):
            frames, truth = frames_at(seed, seconds, fps)
            answer = greedy_answer(target, frames, fps, PROMPT, answer_budget(truth))
            for alpha in alphas:
                keep = uv_keep(target, frames, fps, alpha, tuple(uv_layers)) if alpha > 0 else None
                for path, draft in drafts.items():
                    a, n = agreement(draft, frames, fps, answer, keep)
                    hits[path, alpha] += a
            total += len(answer)
        for path in draft_paths:
            out[path][f"{fps:g}"] = {f"{a:g}": round(hits[path, a] / total, 4) for a in alphas}
            out[path][f"{fps:g}"]["positions"] = total
        print(f"{fps:g} fps: {videos} videos, {total} positions, {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def table(found: dict, alphas) -> str:
    cols = [f"α = {a:g}" for a in alphas]
    lines = ["| draft | fps | " + " | ".join(cols) + " | α = 0.9 / α = 0 |", "|" + "---|" * (len(cols) + 3)]
    for path, by_fps in found.items():
        for fps, row in by_fps.items():
            ratio = row[f"{alphas[-1]:g}"] / row[f"{alphas[0]:g}"] if row[f"{alphas[0]:g}"] else float("nan")
            lines.append(f"| {path} | {fps} | " + " | ".join(f"{row[f'{a:g}']:.3f}" for a in alphas)
                         + f" | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m zoo.agreement", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafts", nargs="+", required=True)
    ap.add_argument("--fps", nargs="+", type=float, default=[2.0, 8.0])
    ap.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.5, 0.9])
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first..first+videos-1 (validation: 200)")
    ap.add_argument("--uv-layers", nargs="+", type=int, default=[0, 1, 2],
                    help="the target's layers UV-Prune compares (the model config's uv_layers)")
    ap.add_argument("--out", help="a JSON file for the figures")
    args = ap.parse_args(argv)
    found = measure(args.target, args.drafts, args.fps, args.alphas, args.videos, args.seconds, args.first_seed,
                    args.uv_layers)
    if args.out:
        Path(args.out).write_text(json.dumps({"target": args.target, "videos": args.videos, "seconds": args.seconds,
                                              "first_seed": args.first_seed, "uv_layers": args.uv_layers,
                                              "agreement": found}, indent=1) + "\n")
    print(table(found, args.alphas))


if __name__ == "__main__":
    main()
