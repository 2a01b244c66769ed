"""A draft model distilled from its target (vanilla SD's and ParallelVLM's draft, `model.draft.path`)
on the target's own answers, from the user's videos or from the toy world:

    python -m run +experiment=train_draft data=folder data.folder=~/videos \\
        model.target.path=/models/Qwen2.5-VL-7B-Instruct model.draft.path=/models/Qwen2.5-VL-3B-Instruct

Start: `init`, a checkpoint of the target's family with its tokenizer (by default the configured
draft, `model.draft.path`), or, with `init: null`, random weights of a zoo shape (`shape`).

Examples (no labels: self-distillation, any videos do): clips of the user's videos (zoo.train.
user_data; the toy world's videos when no data source is given), each with the target's greedy
answer to a prompt, and at each answer position the target's `topk` most likely tokens with
their log-probabilities. Built once into the example cache with the clip's frames.

Loss, over the answer's positions (the draft reads the prompt and video, as it does when it
drafts): `ce_weight` × the cross-entropy of the target's greedy token (what a greedy draft must
propose) + `kl_weight` × KL(target ‖ draft) over the target's top-k, renormalised (the sparse KL of
distillation: the rest of the target's distribution is below the top-k's last probability).

Visual-token dropout (`visual_drop` > 0), for a ParallelVLM draft: a share of the examples shows the
draft only some of its visual tokens, each at its place in the whole prompt, as ParallelVLM's draft
sees the ones UV-Prune keeps (zoo.train.dropout: they leave the attention mask, not the position
table). Which ones: UV-Prune's choice, scored once on the target's hidden states at `uv_layers`
when the example is built, or, for the rest of the share, a random subset. The check then also
reports `top1_heldout_pruned`, the agreement with `eval_keep` of the tokens chosen by UV-Prune.

Check on held-out clips: top-1 agreement along the target's answer (the share of positions where
the draft's greedy token is the target's; zoo.card's measure), and M, the tokens committed per
round when the draft drafts and the target verifies for real (zoo.train.acceptance).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.decoding import decode
from models.load import load_model
from models.pruning import uv_scores
from zoo.train import loop
from zoo.train.config import LoopConfig, parse_flat, visual_drop_problems
from zoo.train.user_data import (
    TargetRecipe,
    UserDataConfig,
    clip_rate,
    user_examples,
    user_source,
)

log = logging.getLogger("reelflow.train")

__all__ = ["DraftTrainConfig", "DraftRecipe", "target_answer", "distill_terms", "train"]

# files besides the weights that make a checkpoint loadable the way its family's is (copied from `init`)
PREPROCESSING_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                       "chat_template.json", "chat_template.jinja")


@dataclass(frozen=True)
class DraftTrainConfig:
    target: str = "zoo/weights/qwen-target"     # the teacher: read, never trained
    init: str | None = None                     # the draft to start from: a checkpoint of the target's family
                                                # (a directory, a hub id, or a `random:` shape for timing)
    shape: str | None = None                    # with init None: a zoo shape (zoo/shapes.py) from random weights
    examples: int = 400                         # without a data source: toy-world examples
    seconds: tuple[float, float] = (2.0, 16.0)  # ... their video lengths (s)
    max_new_tokens: int = 64                    # the target's answer length
    topk: int = 16                              # the target's most likely tokens kept at each answer position
    batch_examples: int = 8                     # examples per step
    ce_weight: float = 1.0                      # the target's greedy token, as a label
    kl_weight: float = 1.0                      # KL(target ‖ draft) over the target's top-k
    train_vision: bool = True                   # false: the draft's vision tower stays as `init` has it
    window: int = 4                             # tokens drafted per round in the accepted-length check
    visual_drop: float = 0.0                    # the share of training examples that see a subset of the video
    visual_keep: tuple[float, float] = (0.05, 0.5)  # ... the share of its visual tokens kept, uniform in [low, high]
    visual_uv_share: float = 0.8                # ... of those, the share whose subset UV-Prune picks (else random)
    uv_layers: tuple[int, ...] = (0, 1, 2)      # the target's layers UV-Prune compares (graph.uv.layers)
    eval_keep: float = 0.1                      # the share UV-Prune keeps in the pruned check (graph.uv.keep)

    @property
    def scores_uv(self) -> bool:
        """Whether examples carry UV-Prune's scores of their visual tokens."""
        return self.visual_drop > 0

    def problems(self) -> list[str]:
        out = []
        if self.init is None and self.shape is None:
            out.append("init: give the draft to start from (a checkpoint of the target's family, e.g. "
                       "model.draft.path) or, with init=null, a zoo shape to start from random weights "
                       "(shape=qwen-draft)")
        if self.init is None and self.shape is not None:
            from zoo.shapes import SHAPES

            if self.shape not in SHAPES:
                out.append(f"shape={self.shape!r}: one of {', '.join(SHAPES)}")
        if self.examples < 2:
            out.append(f"examples={self.examples}: at least 2")
        if not 0 < self.seconds[0] <= self.seconds[1]:
            out.append(f"seconds={list(self.seconds)}: a range [low, high] of positive lengths")
        for key in ("max_new_tokens", "topk", "batch_examples", "window"):
            if getattr(self, key) < 1:
                out.append(f"{key}={getattr(self, key)}: at least 1")
        if self.ce_weight < 0 or self.kl_weight < 0 or self.ce_weight + self.kl_weight <= 0:
            out.append(f"ce_weight={self.ce_weight}, kl_weight={self.kl_weight}: non-negative, not both 0")
        out += visual_drop_problems(self.visual_drop, self.visual_uv_share, self.visual_keep)
        if not 0 < self.eval_keep <= 1:
            out.append(f"eval_keep={self.eval_keep}: the share of the visual tokens kept, in (0, 1]")
        layers = list(self.uv_layers)
        if len(layers) < 2 or min(layers) < 0 or sorted(set(layers)) != layers:
            out.append(f"uv_layers={layers}: two or more of the target's layers, ascending, >= 0 (0: the embeddings)")
        return out


def train(progress: bool | None = None, data: dict | None = None, **keys) -> dict:
    """`data`: a `data:` block naming the user's videos (folder, manifest or path); none or empty:
    the toy world's videos."""
    loop_config, videos, config = parse_flat(keys, LoopConfig, UserDataConfig, DraftTrainConfig)
    return loop.train(DraftRecipe(config, videos, user_source(data), progress), loop_config, progress=progress)


# ------------------------------------------------------------------------------ the target's answers

@torch.inference_mode()
def target_answer(lm, frames: torch.Tensor, fps: float, prompt: str, max_new_tokens: int, topk: int,
                  vocab: int | None = None, uv_layers: tuple[int, ...] | None = None) -> dict:
    """The target's greedy answer to `prompt` about uint8 `frames` [n, 3, H, W] and, at each of
    its positions, the target's `topk` most likely tokens among the first `vocab` (the vocabulary it
    shares with the draft; None: all): {"frames", "fps", "prompt", "answer" long [A], "top_ids" long
    [A, k], "top_logp" float [A, k] (log-probabilities over the target's whole vocabulary)}; with
    `uv_layers`, also "uv_scores" float [m]: UV-Prune's score of each of the m visual tokens (the
    UVPrune stage's defaults: as written, the question after the video as the text)."""
    layout = lm.layout(prompt, frames.shape[0], tuple(frames.shape[-2:]), fps)
    cache, hidden = lm.new_cache(), {}
    logits = lm.prefill(cache, lm.embed(layout.ids, lm.encode(frames), layout.video_start), layout.positions,
                        taps=tuple(uv_layers or ()), on_tap=lambda layer, h: hidden.__setitem__(layer, h))
    scores = {}
    if uv_layers:
        end = layout.video_start + layout.n_video
        scores["uv_scores"] = uv_scores(hidden, layout.video, torch.arange(end, layout.length),
                                        sorted(uv_layers)).float().cpu()
    ids, logps = [], []

    def pick(step_logits: torch.Tensor) -> int:        # the distribution each answer token was chosen from
        top = step_logits.float().log_softmax(-1)[:vocab].topk(topk)
        ids.append(top.indices.cpu())
        logps.append(top.values.cpu())
        return int(step_logits.argmax())

    answer = list(decode(lm, cache, logits, layout.length, layout, max_new_tokens, pick))
    return {"frames": frames.cpu().clone(), "fps": float(fps), "prompt": prompt,
            "answer": torch.tensor(answer, dtype=torch.long), "top_ids": torch.stack(ids),
            "top_logp": torch.stack(logps), **scores}


# ------------------------------------------------------------------------------ the loss

def distill_terms(logits: torch.Tensor, answer: torch.Tensor, top_ids: torch.Tensor,
                  top_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy of `answer`, KL(target ‖ draft) over the target's top-k) from the draft's
    `logits` [N, V] at N answer positions; answer long [N] (a token the draft does not have, id ≥ V,
    is left out of the cross-entropy); top_ids long [N, k] (ids < V); top_logp [N, k] the target's
    log-probabilities there (renormalised over the k for the KL)."""
    logq = logits.float().log_softmax(-1)                            # [N, V]
    ce = F.nll_loss(logq, answer.masked_fill(answer >= logits.shape[-1], -100))
    logp = top_logp.float().log_softmax(-1)                          # [N, k]: the top-k as a distribution
    kl = (logp.exp() * (logp - logq.gather(-1, top_ids))).sum(-1).mean()
    return ce, kl


def answer_logits(net, batch: dict) -> torch.Tensor:
    """The draft's logits [N, V] at the positions that predict an answer token (labels ≠ -100), in
    the order of the batch's rows and their answers; the lm_head runs on those positions only."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    hidden = net.model(**inputs).last_hidden_state                   # [B, T, H]
    predicts = batch["labels"][:, 1:] != -100                        # [B, T-1]: the next token is an answer token
    return net.lm_head(hidden[:, :-1][predicts])


# ------------------------------------------------------------------------------ the recipe

class DraftRecipe(TargetRecipe, loop.Recipe):
    name = "draft"

    def build(self, device: torch.device) -> list[torch.nn.Parameter]:
        from transformers import AutoModelForImageTextToText

        from graph.spec import ConfigError
        from models.load import ModelError, resolve, shared_vocabulary, tokenizer_of
        from models.shapes import is_random

        c = self.config
        self.device = device
        self.load_target(device)
        if c.scores_uv and max(c.uv_layers) > self.lm.n_layers:
            raise ConfigError(f"train_draft: uv_layers={list(c.uv_layers)}: the target has layers 0..{self.lm.n_layers} "
                              "(0: the embeddings)")
        if c.init:
            try:
                self.vocab = shared_vocabulary(tokenizer_of(c.target), tokenizer_of(c.init))
            except ModelError as e:
                raise ConfigError(f"train_draft: {e}") from None
            if is_random(c.init):     # a real checkpoint's shape with random weights: for time and memory
                net = load_model(c.init, dtype="float32", lean=False).model
            else:
                net = AutoModelForImageTextToText.from_pretrained(resolve(c.init), dtype=torch.float32,
                                                                  use_safetensors=True)
        else:
            from zoo.shapes import zoo_config

            net = AutoModelForImageTextToText.from_config(zoo_config(c.shape))
            self.vocab = min(self.lm.vocabulary, net.config.get_text_config().vocab_size)
        if net.config.model_type != self.lm.arch:
            raise ConfigError(f"train_draft: the draft is a {net.config.model_type} and the target a {self.lm.arch}; "
                              "a draft must be of its target's family")
        if not c.train_vision:
            vision = getattr(net.model, "visual", None) or getattr(net.model, "vision_tower")
            vision.requires_grad_(False)
        self.net = net.to(device).train()
        self.arch = net.config.model_type
        self.norm = (self.lm.mean, self.lm.std) if hasattr(self.lm, "mean") else None
        if self.source is not None:
            self._examples_from_user_videos(device)
        else:
            self._examples_from_toy_world()
        return [p for p in self.net.parameters() if p.requires_grad]

    def _examples_from_user_videos(self, device: torch.device) -> None:
        from zoo.train.memory import check_memory

        c, lm = self.config, self.lm
        self.fps, _ = clip_rate(self.videos, lm)

        def memory(frames: int, size: int) -> None:
            check_memory(lm, self.net, device, frames=frames, size=size, text_tokens=c.max_new_tokens + 64,
                         batch_examples=c.batch_examples, recipe="train_draft", whole_model=True)

        # UV-Prune's scores only where dropout needs them: a run without keeps finding the examples it built before
        uv = {"uv_layers": list(c.uv_layers)} if c.scores_uv else {}
        made = user_examples(self.source, self.videos, lm, c.target, recipe="train_draft", memory=memory,
                             key={"examples": "draft distillation", "version": 1, "max_new_tokens": c.max_new_tokens,
                                  "topk": c.topk, "vocab": self.vocab, **uv},
                             make=lambda clip, frames, fps: target_answer(lm, frames, fps, clip.prompt,
                                                                          c.max_new_tokens, c.topk, self.vocab,
                                                                          self._uv_layers),
                             progress=self.progress)
        self.data, self.heldout = made.train, made.heldout
        self.eval_clips, self.trained_on = made.eval_clips, made.trained_on

    def _examples_from_toy_world(self) -> None:
        from tqdm import tqdm

        from zoo.shapes import FPS
        from zoo.train.data import example

        c, lm = self.config, self.lm
        self.fps = lm.fps or FPS[lm.arch]
        rng = random.Random(0)
        answer = lambda ex: target_answer(lm, ex.frames, self.fps, ex.prompt, c.max_new_tokens, c.topk,  # noqa: E731
                                          self.vocab, self._uv_layers)
        self.data = [answer(ex) for ex in (example(10_000 + i, rng.uniform(*c.seconds), self.fps)
                                           for i in tqdm(range(c.examples), desc="target answers", mininterval=5,
                                                         disable=self.progress is False))]
        self.heldout = [answer(ex) for ex in (example(s, 30.0, self.fps) for s in range(900, 904))]
        self.trained_on = {"data": "the toy world", "clips": len(self.data), "heldout_clips": len(self.heldout),
                           "fps": self.fps}

    @property
    def _uv_layers(self) -> tuple[int, ...] | None:
        return tuple(self.config.uv_layers) if self.config.scores_uv else None

    def describe(self) -> str:
        n = sum(p.numel() for p in self.net.parameters())
        start = self.config.init or f"random weights of {self.config.shape}"
        return (f"a {n / 1e6:.2f} M-parameter draft from {start}, distilled from {self.config.target} "
                f"on {len(self.data)} of its answers")

    @property
    def weights(self) -> dict[str, float]:
        return {"ce": self.config.ce_weight, "kl": self.config.kl_weight}

    def batches(self, steps: int, seed: int, start: int = 0):
        return _DraftBatches(self, seed, start)

    def draw_drops(self, n: int, rng: random.Random) -> list[tuple[float, bool]]:
        """Per example, (the share of its visual tokens the draft sees, whether UV-Prune picks them):
        (1, False) for all but a `visual_drop` share, whose share is uniform in `visual_keep`, a
        `visual_uv_share` of them picked by UV-Prune (the rest: a random subset)."""
        c = self.config
        drops = []
        for _ in range(n):
            dropped, share, by_uv = rng.random() < c.visual_drop, rng.uniform(*c.visual_keep), rng.random()
            drops.append((share, by_uv < c.visual_uv_share) if dropped else (1.0, False))
        return drops

    def inputs(self, items: list[dict], drops: list[tuple[float, bool]] | None = None, seed: int = 0) -> list[dict]:
        """The transformers forward's batches of `items` (cached examples) with their answers as
        labels, and the target's top-k at those answers: one batch for Qwen2.5-VL, whose forward
        takes videos of any lengths together; for LLaVA-OneVision, whose forward stacks its videos,
        one batch per frame count. `drops`: per item, (share of the visual tokens seen, picked by
        UV-Prune) (draw_drops; None: every item sees its whole video); `seed` draws the random subsets."""
        drops = drops or [(1.0, False)] * len(items)
        if self.arch == "qwen2_5_vl":
            return [self._batch(items, drops, seed)]
        counts = sorted({it["frames"].shape[0] for it in items})
        return [self._batch([it for it in items if it["frames"].shape[0] == n],
                            [d for it, d in zip(items, drops) if it["frames"].shape[0] == n], seed + n)
                for n in counts]

    def _batch(self, items: list[dict], drops: list[tuple[float, bool]], seed: int) -> dict:
        from zoo.train.data import Example, model_inputs

        examples = [Example(it["frames"], it["prompt"], None, None, fps=it["fps"], answer_ids=it["answer"].tolist())
                    for it in items]
        batch = model_inputs(self.net.config, self.lm.tokenizer, examples, with_answers=True, norm=self.norm)
        if any(share < 1 for share, _ in drops):
            self._drop_visual_tokens(batch, items, drops, seed)
        batch["answer"] = torch.cat([it["answer"] for it in items])
        batch["top_ids"] = torch.cat([it["top_ids"] for it in items])
        batch["top_logp"] = torch.cat([it["top_logp"] for it in items])
        return batch

    @torch.no_grad()
    def _drop_visual_tokens(self, batch: dict, items: list[dict], drops: list[tuple[float, bool]], seed: int) -> None:
        """Shows each row of `batch` only its share of the visual tokens, each at its position in
        the whole prompt (zoo.train.dropout): the positions are fixed from the whole prompt first,
        then the dropped tokens leave the attention mask."""
        from zoo.train.data import shifted_positions
        from zoo.train.dropout import keep_mask

        config = self.net.config
        video_id = config.video_token_id if self.arch == "qwen2_5_vl" else config.video_token_index
        is_video = batch["input_ids"] == video_id                                  # [B, T]
        scores = torch.rand(is_video.shape, generator=torch.Generator().manual_seed(seed))
        for row, (item, (_, by_uv)) in enumerate(zip(items, drops)):
            if not by_uv:
                continue
            found = item.get("uv_scores")
            if found is None or found.numel() != int(is_video[row].sum()):
                raise ValueError(f"an example's UV-Prune scores cover {None if found is None else found.numel()} "
                                 f"visual tokens, its prompt has {int(is_video[row].sum())}: rebuild the example cache")
            scores[row, is_video[row]] = found
        batch["position_ids"] = shifted_positions(self.net, batch, torch.zeros_like(batch["input_ids"]))
        shares = torch.tensor([share for share, _ in drops])
        batch["attention_mask"] = batch["attention_mask"] * keep_mask(is_video, scores, shares)

    def _forward(self, batches: list[dict]) -> tuple[torch.Tensor, ...]:
        """(the draft's logits [N, V] at every answer position of the batches, the answers [N], the
        target's top-k ids and log-probabilities [N, k] there)."""
        out = []
        for batch in batches:
            batch = dict(batch)
            answer, top_ids, top_logp = batch.pop("answer"), batch.pop("top_ids"), batch.pop("top_logp")
            out.append((answer_logits(self.net, batch), answer, top_ids, top_logp))
        return tuple(torch.cat(parts) for parts in zip(*out))

    def loss(self, batches: list[dict]) -> dict[str, torch.Tensor]:
        ce, kl = distill_terms(*self._forward(batches))
        c = self.config
        return {"loss": c.ce_weight * ce + c.kl_weight * kl, "ce": ce, "kl": kl}

    def _top1(self, keep: float | None) -> float:
        """The share of the held-out answers' positions where the draft's greedy token is the
        target's; `keep`: the draft sees that share of the visual tokens, UV-Prune's choice."""
        hits = total = 0
        step = self.config.batch_examples
        for i in range(0, len(self.heldout), step):
            items = self.heldout[i:i + step]
            drops = None if keep is None else [(keep, True)] * len(items)
            batches = [{k: v.to(self.device) for k, v in b.items()} for b in self.inputs(items, drops)]
            logits, answer, _, _ = self._forward(batches)
            hits += int((logits.argmax(-1) == answer).sum())
            total += len(answer)
        return round(hits / max(1, total), 4)

    @torch.no_grad()
    def evaluate(self, final: bool) -> dict:
        was_training = self.net.training
        self.net.eval()
        out = {"top1_heldout": self._top1(None)}
        if self.config.scores_uv:
            out["top1_heldout_pruned"] = self._top1(self.config.eval_keep)
        if self.eval_clips or not self.source:
            # in fp32 the final check also decodes plainly and fails on any token difference; not for
            # a `random:` target, whose noise may pick ids past the tokenizer the two models share
            from models.shapes import is_random

            check = final and self.lm.dtype == torch.float32 and not is_random(self.config.target)
            out["accepted_length_heldout"] = self._accepted_length(check=check)
        self.net.train(was_training)
        return out

    def _accepted_length(self, check: bool) -> float:
        """M of vanilla SD with this draft on the held-out clips (toy world: the held-out examples)."""
        from models.load import adapted
        from zoo.train.acceptance import draft_accepted_length

        clips = ([(k.prompt, frames, fps) for k, frames, fps in self.eval_clips] if self.source
                 else [(it["prompt"], it["frames"], it["fps"]) for it in self.heldout])
        committed = rounds = 0
        dtype = next(self.net.parameters()).dtype
        net = self.net if dtype == self.lm.dtype else _copy_to(self.net, self.lm.dtype)
        with adapted(net, self.lm.tokenizer, {"image_mean": list(self.lm.mean), "image_std": list(self.lm.std),
                                               "fps": self.fps}) as draft:
            for prompt, frames, fps in clips:
                c, r = draft_accepted_length(self.lm, draft, frames, fps, prompt,
                                             max_new_tokens=self.config.max_new_tokens, window=self.config.window,
                                             check=check)
                committed, rounds = committed + c, rounds + r
        return round(committed / max(1, rounds), 4)

    def default_out(self) -> Path:
        return Path("drafts") / f"{Path(self.config.target).name}-draft"

    def save(self, out_dir: Path) -> None:
        """A transformers checkpoint in bf16 with the target's tokenizer and the family's preprocessing
        files, loadable as `model.draft.path`; the draft is checked afterwards as saved."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.net.eval()
        self.net = self.net.to(torch.bfloat16)
        self.net.save_pretrained(out_dir)
        self.lm.tokenizer.save_pretrained(out_dir)
        from models.load import resolve

        source = Path(resolve(self.config.init)) if self.config.init and Path(resolve(self.config.init)).is_dir() \
            else None
        copied = [f for f in PREPROCESSING_FILES if source and (source / f).is_file()]
        for name in copied:
            shutil.copy(source / name, out_dir / name)
        if "preprocessor_config.json" not in copied:
            from zoo.train.toy import preprocessor_config

            (out_dir / "preprocessor_config.json").write_text(json.dumps(
                {**preprocessor_config(self.arch), "image_mean": list(self.lm.mean), "image_std": list(self.lm.std),
                 "fps": self.fps, "size": list(self.lm.frame_size or [448, 448])}, indent=1) + "\n")
        self.net = self.net.float()        # bf16 values, checked in fp32 as a fp32 load of the checkpoint gives

    def card(self, result: dict) -> str:
        from zoo.train.card import draft_card

        return draft_card(result, self.trained_on)

    def record(self) -> dict:
        from zoo.train.config import flat

        return {"recipe": "draft", **flat(self.config), **flat(self.videos),
                "parameters": sum(p.numel() for p in self.net.parameters()),
                "trained_on": json.loads(json.dumps(self.trained_on, default=str))}


def _copy_to(net, dtype: torch.dtype):
    import copy

    return copy.deepcopy(net).to(dtype)


class _DraftBatches(torch.utils.data.IterableDataset):
    """Step k's examples are drawn with their own seed (a resumed run trains on what an uninterrupted
    one would), made into the forward's batch in the training process."""

    def __init__(self, recipe: DraftRecipe, seed: int, start: int = 0):
        self.recipe, self.seed, self.start = recipe, seed, start

    def __iter__(self):
        data, per_step, step = self.recipe.data, self.recipe.config.batch_examples, self.start
        dropping = self.recipe.config.visual_drop > 0
        while True:
            rng = random.Random(f"{self.seed}-{step}")
            items = [data[rng.randrange(len(data))] for _ in range(per_step)]
            drops = self.recipe.draw_drops(len(items), rng) if dropping else None
            yield self.recipe.inputs(items, drops, seed=rng.getrandbits(62))
            step += 1
