"""The card saved beside a trained draft head or draft: what it was trained on, how well it agrees
with its target on held-out clips, and the command that made it (README.md in its directory)."""

from __future__ import annotations

import json
import shlex
import sys

__all__ = ["command_line", "draft_card", "head_card"]


def command_line() -> str:
    """This process's command as a user would type it (`python -m run ...` for the runner)."""
    args = [shlex.quote(a) for a in sys.argv[1:]]
    program = sys.argv[0]
    if program.endswith("run.py") or program == "-m":
        return " ".join(["python -m run", *args])
    return " ".join([shlex.quote(program), *args])


def head_card(result: dict, trained_on: dict) -> str:
    """Markdown for a Sparrow head trained by `zoo.train.sparrow` (`result`: its training.json)."""
    return _card(
        title=f"Sparrow draft head for {result.get('target')}",
        intro=["A one-layer draft head on the target's hidden states (Sparrow), trained on the target's own",
               "greedy answers (self-distillation: no labels). Load it with"],
        load=f"python -m run +experiment=sparrow model.target.path={result.get('target')} "
             "model.sparrow=<this directory>",
        model=f"head: {result.get('parameters')} parameters, m* = {result.get('tap_layer')}, "
              f"ivsb {result.get('ivsb')}, mtp {result.get('mtp')}, vata {result.get('vata')}",
        checks=["top1: the share of text positions where the head's next token is the target's; accepted_length:",
                "tokens committed per verification round when its trees are drafted and verified for real."],
        result=result, trained_on=trained_on)


def draft_card(result: dict, trained_on: dict) -> str:
    """Markdown for a draft model distilled by `zoo.train.draft` (`result`: its training.json)."""
    start = result.get("init") or f"random weights of the zoo shape {result.get('shape')}"
    return _card(
        title=f"Draft model for {result.get('target')}",
        intro=["A draft distilled from its target's own greedy answers (self-distillation: no labels), starting",
               f"from {start}. Load it with"],
        load=f"python -m run +experiment=vanilla_sd model.target.path={result.get('target')} "
             "model.draft.path=<this directory>",
        model=f"draft: {result.get('parameters')} parameters, loss {result.get('ce_weight')} x cross-entropy of the "
              f"target's token + {result.get('kl_weight')} x KL over its top-{result.get('topk')}",
        checks=["top1: the share of answer positions where the draft's next token is the target's; accepted_length:",
                f"tokens committed per verification round when it drafts {result.get('window')} tokens a round and "
                "the target verifies them."]
        + ([f"top1_heldout_pruned: top1 when the draft sees only the {100 * result.get('eval_keep', 0):g} % of the "
            f"visual tokens UV-Prune keeps on the target's layers {list(result.get('uv_layers', []))}, as a "
            f"ParallelVLM draft does (trained with visual-token dropout on {100 * result['visual_drop']:g} % of the "
            "examples)."]
           if result.get("visual_drop") else []),
        result=result, trained_on=trained_on)


def _card(*, title: str, intro: list[str], load: str, model: str, checks: list[str], result: dict,
          trained_on: dict) -> str:
    figures = {k: v for k, v in result.items() if k.startswith(("top1_", "accepted_length"))}
    rows = "\n".join(f"| {k} | {v} |" for k, v in figures.items()) or "| (none) | |"
    data = trained_on.get("data")
    source = json.dumps(data) if isinstance(data, dict) else str(data)
    lines = [f"# {title}", "", *intro, "", "```bash", load, "```", "", "## Trained on", "", f"- data: `{source}`"]
    for key in ("videos", "clips", "heldout_clips", "clips_skipped", "fps", "size", "example_cache"):
        if key in trained_on:
            lines.append(f"- {key.replace('_', ' ')}: {trained_on[key]}")
    if trained_on.get("videos_skipped"):
        lines.append(f"- videos that could not be read: {len(trained_on['videos_skipped'])} "
                     f"({', '.join(sorted(trained_on['videos_skipped']))[:300]})")
    if trained_on.get("prompts"):
        lines.append("- prompts: " + "; ".join(f"`{p}`" for p in trained_on["prompts"]))
    lines += [
        f"- steps: {result.get('steps')} of {result.get('steps_planned')}, lr {result.get('lr')}, "
        f"{result.get('precision')}, on {result.get('device_name') or result.get('device')}, "
        f"{result.get('train_s')} s"
        + (f" (resumed at step {result['resumed_at']})" if result.get("resumed_at") else ""),
        f"- {model}",
        "",
        "## Agreement with the target (held-out clips)",
        "",
        *checks,
        "",
        "| check | value |",
        "|---|---|",
        rows,
        "",
        "## Command",
        "",
        "```bash",
        command_line(),
        "```",
        "",
    ]
    return "\n".join(lines)
