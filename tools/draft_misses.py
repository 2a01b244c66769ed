"""Where and why a draft disagrees with its target. Two measurements behind the shipped drafts
(docs/zoo.md):

    python -m tools.draft_misses                                 # the shipped Qwen pair, seeds 0-5, 2 fps
    python -m tools.draft_misses --draft /tmp/qwen-draft --videos 8 --fps 8

1. Greedy agreement (zoo.card's) with the whole video, with UV-Prune's half and tenth, with a random
   half and tenth, and with the first half: does the number of visual tokens cost, or the choice?
2. With the whole video: the target's tokens the draft misses most, and the misses by clause.
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from models.decoding import greedy_answer
from models.load import load_model
from models.pruning import keep_top
from zoo.agreement import frames_at
from zoo.card import PROMPT, agreement, answer_budget, uv_keep


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.draft_misses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="zoo/weights/qwen-target")
    ap.add_argument("--draft", default="zoo/weights/qwen-draft")
    ap.add_argument("--videos", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--fps", type=float, default=2.0)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    target, draft, fps = load_model(args.target), load_model(args.draft), args.fps
    kinds, missed, seen, by_clause = Counter(), Counter(), Counter(), {}
    for seed in range(args.videos):
        frames, truth = frames_at(seed, args.seconds, fps)
        answer = greedy_answer(target, frames, fps, PROMPT, answer_budget(truth))
        m = target.layout(PROMPT, frames.shape[0], tuple(frames.shape[-2:]), fps).n_video
        for name, keep in (("whole", None), ("UV-Prune 0.5", uv_keep(target, frames, fps, 0.5)),
                           ("UV-Prune 0.1", uv_keep(target, frames, fps, 0.9)),
                           ("random 0.5", keep_top(torch.rand(m), 0.5)),
                           ("random 0.1", keep_top(torch.rand(m), 0.1)), ("first half", torch.arange(m // 2))):
            a, n = agreement(draft, frames, fps, answer, keep)
            kinds[name, 0] += a
            kinds[name, 1] += n
        # which tokens: the draft's greedy guesses along the answer, whole video
        from models.decoding import prefill_video

        cache, layout, logits = prefill_video(draft, frames, fps, PROMPT)
        rest = draft.score(cache, torch.tensor(answer[:-1]), layout.length, layout)
        guesses = torch.cat([logits[None], rest]).argmax(-1).tolist()
        clause = 0
        for g, a in zip(guesses, answer):
            word = target.tokenizer.decode([a])
            seen[word] += 1
            missed[word] += g != a
            hit = by_clause.setdefault(clause, [0, 0])
            hit[0], hit[1] = hit[0] + (g != a), hit[1] + 1
            clause += word == "."
    print(f"{args.draft} against {args.target}, {args.videos} videos of {args.seconds:g} s at {fps:g} fps")
    print("greedy agreement by what the draft is shown:")
    for name in dict.fromkeys(k for k, _ in kinds):
        print(f"  {name:14s} {kinds[name, 0] / kinds[name, 1]:.3f}")
    print("tokens missed most (missed / seen), whole video:")
    for word, n in missed.most_common(15):
        print(f"  {word!r:14s} {n} / {seen[word]}")
    print("missed by clause (0: the first):", ", ".join(f"{c}: {m}/{n}" for c, (m, n) in sorted(by_clause.items())))


if __name__ == "__main__":
    main()
