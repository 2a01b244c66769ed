"""Sparrow's draft head trained on its target's own states (models.sparrow):

    python -m run +experiment=train_sparrow model=toy_qwen        # (and model=toy_llava)

Data (the paper's App. C.2: short inputs only, VATA carries the head to long videos): the target's
own greedy answers to short toy videos (`seconds`, 2-16 s by default, at the model's frame rate),
and from one forward of the target over prompt + answer: its final-norm feature at every position
and its layer-m* states at the video's positions (m* = half its layers). Built once before
training, `examples` of them.

Loss, per text position t of the prompt and the answer (the head never sees a video position as
an input; its text positions are numbered 0, 1, ... as at inference):
- first pass, z_t = FC(e_t ⊕ h_{t-1}) with the target's h: feature regression (smooth L1 of ĥ_t
  against h_t) + `ce_weight` × the cross-entropy of lm_head(ĥ_t) against the target's
  distribution softmax(lm_head(h_t)) (EAGLE's loss and weight 0.1);
- IVSB (`ivsb`): the video's layer-m* states are a prefix of the head's input sequence, at
  positions −V .. −1, in both passes; `ivsb_drop` of the examples go without it, as the head
  drafts with VATA (on the toy, a head trained always with the prefix and drafting without it
  committed 2.9-3.0 tokens a round, against 4.4-4.6 drafting with it or trained without it);
- MTP (`mtp`): a second pass feeds the head its own first-pass outputs in place of h_{t-1} where
  the previous position is text (z_rec = FC(e_t ⊕ ĥ_{t-1})), with the same loss: what the head
  sees from its second drafted token on.

Check: the share of held-out text positions (30-s videos at the model's frame rate and at 4× it:
lengths never trained on) where the head's top token equals the target's, with VATA (no prefix)
as the head drafts at inference.

From the user's own videos (`data=folder` / `data=manifest` / `data.path=`, any target by path):
the same examples from clips of those files, built once into an example cache
(zoo.train.user_data), checked on held-out videos by top-1 and by the accepted length of trees
drafted and verified for real (zoo.train.acceptance), and saved with a card (docs/own-model.md).
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from graph.spec import ConfigError
from models.decoding import greedy_answer
from models.load import resolve
from models.sparrow import SparrowConfig, SparrowHead
from zoo import WEIGHTS
from zoo.shapes import FPS
from zoo.train import loop
from zoo.train.config import LoopConfig, parse_flat
from zoo.train.data import example
from zoo.train.user_data import (
    TargetRecipe,
    UserDataConfig,
    clip_rate,
    user_examples,
    user_source,
)

log = logging.getLogger("reelflow.train")

EVAL_SEEDS = range(900, 906)


@dataclass(frozen=True)
class SparrowTrainConfig:
    target: str = "zoo/weights/qwen-target"     # the target whose states the head learns
    out_name: str = ""                          # the head's directory under zoo/weights ("": <family>-sparrow)
    examples: int = 240                         # target answers built before training
    seconds: tuple[float, float] = (2.0, 16.0)  # their video lengths (s), at the target's frame rate
    max_new_tokens: int = 48
    batch_examples: int = 4                     # examples per step
    ce_weight: float = 0.1                      # the token cross-entropy beside the feature regression
    ivsb: bool = True
    ivsb_drop: float = 0.0                      # the share of examples trained without the IVSB prefix
    mtp: bool = True
    vata: bool = True                           # how the saved head attends at inference (false: an ablation)
    tap_layer: int = 0                          # m* (0: half the target's layers)
    def problems(self) -> list[str]:
        out = []
        if self.examples < 2:
            out.append(f"examples={self.examples}: at least 2")
        if not 0 < self.seconds[0] <= self.seconds[1]:
            out.append(f"seconds={list(self.seconds)}: a range [low, high] of positive lengths")
        if self.batch_examples < 1:
            out.append(f"batch_examples={self.batch_examples}: at least 1")
        if not 0.0 <= self.ivsb_drop <= 1.0:
            out.append(f"ivsb_drop={self.ivsb_drop}: a share of the examples, in [0, 1]")
        return out


def train(progress: bool | None = None, data: dict | None = None, **keys) -> dict:
    """`data`: a `data:` block naming the user's videos (folder, manifest or path); none or empty:
    the toy world's videos, made on the fly."""
    loop_config, videos, config = parse_flat(keys, LoopConfig, UserDataConfig, SparrowTrainConfig)
    if not loop_config.out and not in_zoo(config.target):
        raise ConfigError([f"train.out: required for a target outside the toy zoo ({config.target}): without it the "
                           "head would go to zoo/weights, over the toy target's. Fix: train.out=heads/<name>"])
    return loop.train(SparrowRecipe(config, videos, user_source(data), progress), loop_config, progress=progress)


def in_zoo(target: str) -> bool:
    """Whether `target` is one of the toy zoo's models (a directory under zoo/weights)."""
    return Path(resolve(target)).resolve().is_relative_to(WEIGHTS.resolve())


# ------------------------------------------------------------------------------ the target's states

@torch.inference_mode()
def target_states(lm, frames: torch.Tensor, fps: float, prompt: str, max_new_tokens: int, tap_layer: int) -> dict:
    """The target's greedy answer to the video and, over prompt + answer in one forward: ids [L],
    is_text bool [L], final-norm features [L, H], and the layer-`tap_layer` states of the video's
    positions [V, H]."""
    answer = greedy_answer(lm, frames, fps, prompt, max_new_tokens)
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
    ids = torch.cat([layout.ids, torch.tensor(answer, dtype=torch.long)])
    embeds = torch.cat([lm.embed(layout.ids, lm.encode(frames), layout.video_start), lm.embed(ids[layout.length:])])
    positions = torch.cat([layout.positions, layout.decode_positions(layout.length, len(answer))], 1)
    taps = {}
    _, final = lm.prefill(lm.new_cache(), embeds, positions, taps=(tap_layer,), logits="none", hidden=True,
                          on_tap=lambda layer, h: taps.__setitem__(layer, h))
    is_text = torch.ones(ids.shape[0], dtype=torch.bool)
    is_text[layout.video] = False
    return {"ids": ids, "is_text": is_text, "final": final.float().cpu(),
            "video": taps[tap_layer][layout.video].float().cpu(), "answer_at": layout.length}


def head_inputs(item: dict) -> dict:
    """The text positions the head trains on: their ids, the target's feature before each (h_{t-1}),
    the feature at each (the regression target), and whether the previous position is text."""
    text = item["is_text"].nonzero().squeeze(1)
    text = text[text > 0]                                   # the first token has no feature before it
    # clones: the states were made under inference mode, and autograd may not save those
    return {"ids": item["ids"][text].clone(), "prev": item["final"][text - 1].clone(),
            "want": item["final"][text].clone(), "prev_is_text": item["is_text"][text - 1].clone(),
            "video": item["video"].clone()}


# ------------------------------------------------------------------------------ the recipe

class SparrowRecipe(TargetRecipe, loop.Recipe):
    name = "sparrow"

    def build(self, device: torch.device) -> list[torch.nn.Parameter]:
        from tqdm import tqdm

        c = self.config
        self.load_target(device)
        self.tap = c.tap_layer or self.lm.n_layers // 2
        self.head = SparrowHead(SparrowConfig.of_target(self.lm, target=Path(c.target).name, tap_layer=self.tap,
                                                        vata=c.vata, ivsb=c.ivsb, mtp=c.mtp)).to(device)
        # start from the target's last layer: the same shape, and a layer that already maps states
        # of the target's own space (EAGLE initialises its head from the target's layer too)
        self._init_from_target_layer()
        if self.source is not None:
            self._build_from_user_videos(device)
            self.head.train()
            return list(self.head.parameters())
        self.fps = self.lm.fps or FPS[self.lm.arch]
        rng = random.Random(0)
        self.data = []
        for i in tqdm(range(c.examples), desc="target answers", mininterval=5):
            ex = example(10_000 + i, rng.uniform(*c.seconds), self.fps)
            self.data.append(head_inputs(target_states(self.lm, ex.frames, self.fps, ex.prompt, c.max_new_tokens,
                                                       self.tap)))
        self.eval_sets = {f"{m}x": [head_inputs(target_states(self.lm, e.frames, m * self.fps, e.prompt,
                                                                c.max_new_tokens, self.tap))
                                    for e in (example(s, 30.0, m * self.fps) for s in EVAL_SEEDS)]
                          for m in (1, 4)}
        self.head.train()
        return list(self.head.parameters())

    def _build_from_user_videos(self, device: torch.device) -> None:
        """Examples from the clips of the user's videos, through the example cache (see user_data)."""
        from zoo.train.memory import check_memory

        c, lm = self.config, self.lm
        self.fps, _ = clip_rate(self.videos, lm)

        def memory(frames: int, size: int) -> None:
            check_memory(lm, self.head, device, frames=frames, size=size, text_tokens=c.max_new_tokens + 64,
                         batch_examples=c.batch_examples, recipe="train_sparrow")

        made = user_examples(self.source, self.videos, lm, c.target, recipe="train_sparrow", memory=memory,
                             key={"examples": "sparrow head inputs", "version": 1, "tap_layer": self.tap,
                                  "max_new_tokens": c.max_new_tokens},
                             make=lambda clip, frames, fps: head_inputs(target_states(lm, frames, fps, clip.prompt,
                                                                                      c.max_new_tokens, self.tap)),
                             progress=self.progress)
        self.data, self.eval_sets = made.train, {"heldout": made.heldout}
        self.eval_clips, self.trained_on = made.eval_clips, made.trained_on

    def _init_from_target_layer(self) -> None:
        layer = self.lm.text.layers[-1]
        a, m, h = layer.self_attn, layer.mlp, self.head
        with torch.no_grad():
            for mine, theirs in ((h.q, a.q_proj), (h.k, a.k_proj), (h.v, a.v_proj), (h.o, a.o_proj),
                                 (h.gate, m.gate_proj), (h.up, m.up_proj), (h.down, m.down_proj)):
                mine.weight.copy_(theirs.weight)
                if mine.bias is not None and theirs.bias is not None:
                    mine.bias.copy_(theirs.bias)
            h.input_norm.copy_(layer.input_layernorm.weight)
            h.post_norm.copy_(layer.post_attention_layernorm.weight)

    def describe(self) -> str:
        n = sum(p.numel() for p in self.head.parameters())
        return (f"a {n / 1e6:.2f} M-parameter head on {self.config.target} (m* = {self.tap}), "
                f"{len(self.data)} target answers, ivsb={self.config.ivsb} mtp={self.config.mtp}")

    @property
    def weights(self) -> dict[str, float]:
        return {"loss": 1.0}

    def batches(self, steps: int, seed: int, start: int = 0):
        return _Examples(self.data, self.config.batch_examples, seed, start)

    def _pass(self, item: dict, prev: torch.Tensor, prefix: bool) -> torch.Tensor:
        """ĥ [T, H] for the item's text positions with features `prev` before them."""
        head, lm = self.head, self.lm
        z = head.fuse(lm.embed(item["ids"]).detach(), prev)
        positions = torch.arange(z.shape[0])
        if prefix and item["video"].shape[0]:
            v = item["video"].to(z.dtype)
            z = torch.cat([v, z])
            positions = torch.cat([torch.arange(-v.shape[0], 0), positions])
            return head(None, z, positions)[v.shape[0]:]
        return head(None, z, positions)

    def _terms(self, out: torch.Tensor, item: dict) -> tuple[torch.Tensor, torch.Tensor]:
        want = item["want"]
        regress = F.smooth_l1_loss(out, want)
        target = torch.softmax(self.lm.lm_head(want), -1)
        ce = -(target * torch.log_softmax(self.lm.lm_head(out), -1)).sum(-1).mean()
        return regress, ce

    def loss(self, batch) -> dict[str, torch.Tensor]:
        c = self.config
        regress = ce = torch.zeros(())
        passes = 0
        for item in batch:
            # with VATA the head drafts without the prefix: `ivsb_drop` of the examples train that way too
            prefix = c.ivsb and float(torch.rand(())) >= c.ivsb_drop
            first = self._pass(item, item["prev"], prefix)
            r, x = self._terms(first, item)
            regress, ce, passes = regress + r, ce + x, passes + 1
            if c.mtp:     # the head's own outputs in place of the target's where the previous is text
                own = torch.cat([item["prev"][:1], first[:-1]])
                prev = torch.where(item["prev_is_text"][:, None], own, item["prev"])
                r, x = self._terms(self._pass(item, prev, prefix), item)
                regress, ce, passes = regress + r, ce + x, passes + 1
        regress, ce = regress / passes, ce / passes
        return {"loss": regress + c.ce_weight * ce, "regress": regress, "ce": ce}

    @torch.no_grad()
    def evaluate(self, final: bool) -> dict:
        self.head.eval()
        out = {}
        for name, items in self.eval_sets.items():
            hits = total = 0
            for item in items:
                got = self.lm.lm_head(self._pass(item, item["prev"], prefix=not self.config.vata)).argmax(-1)
                hits += int((got == self.lm.lm_head(item["want"]).argmax(-1)).sum())
                total += got.shape[0]
            out[f"top1_{name}"] = round(hits / max(1, total), 4)
        if self.eval_clips:     # the real thing: trees drafted and verified on held-out clips
            from zoo.train.acceptance import head_accepted_length

            committed = rounds = 0
            for clip, frames, fps in self.eval_clips:
                # in fp32 the final check also decodes plainly and fails if the tokens differ (in bf16 a
                # k-token verification and k single steps may break a near tie differently)
                c, r = head_accepted_length(self.lm, self._inference_head(), frames, fps, clip.prompt,
                                            max_new_tokens=self.config.max_new_tokens,
                                            check=final and self.lm.dtype == torch.float32)
                committed, rounds = committed + c, rounds + r
            out["accepted_length_heldout"] = round(committed / max(1, rounds), 4)
        self.head.train()
        return out

    def _inference_head(self) -> SparrowHead:
        """The head as the drafter runs it: in the target's dtype, in eval mode (a copy when they differ)."""
        if next(self.head.parameters()).dtype == self.lm.dtype:
            return self.head
        import copy

        return copy.deepcopy(self.head).to(self.lm.dtype)

    def default_out(self) -> Path:
        # a zoo target (`train` asks for train.out otherwise), before it loads: its config names its family
        arch = json.loads((Path(resolve(self.config.target)) / "config.json").read_text())["model_type"]
        family = "qwen" if arch == "qwen2_5_vl" else "llava"
        return WEIGHTS / (self.config.out_name or f"{family}-sparrow")

    def save(self, out_dir: Path) -> None:
        self.head.eval()
        self.head.save(out_dir)

    def card(self, result: dict) -> str:
        from zoo.train.card import head_card

        return head_card(result, self.trained_on)

    def record(self) -> dict:
        from zoo.train.config import flat

        return {"recipe": "sparrow", **flat(self.config), **flat(self.videos), "tap_layer": self.tap,
                "parameters": sum(p.numel() for p in self.head.parameters()),
                "trained_on": json.loads(json.dumps(self.trained_on, default=str))}


class _Examples(torch.utils.data.IterableDataset):
    """Step k's examples are drawn with their own seed, so a resumed run from step `start` trains on
    what an uninterrupted one would."""

    def __init__(self, data: list[dict], per_step: int, seed: int, start: int = 0):
        self.data, self.per_step, self.seed, self.start = data, per_step, seed, start

    def __iter__(self):
        step = self.start
        while True:
            rng = random.Random(f"{self.seed}-{step}")
            yield [self.data[rng.randrange(len(self.data))] for _ in range(self.per_step)]
            step += 1
