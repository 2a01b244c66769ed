"""The toy-zoo recipe: trains a zoo model (zoo/shapes.py) on the toy world and saves it as a
transformers checkpoint (bf16 safetensors + tokenizer + preprocessor config), the way a real
checkpoint is saved:

    python -m run +experiment=train_toy train.model=qwen-target          # one model
    python -m run -m +experiment=train_toy train.model=qwen-target,qwen-draft,llava-target,llava-draft

Data: zoo.train.data (fresh worlds each batch, a curriculum of lengths). Loss: next-token
cross-entropy on the answer and its closing <|im_end|>, plus training-only terms, none of them
part of the saved model:
  - `aux_weight`: a linear probe on every visual token predicting what is on its cell of the 3x3
    board (labels.cell_labels): a dense perception signal, since the caption loss alone reaches
    the vision tower only through a few content words per event;
  - `event_weight`: a probe at the middle layer, what changed on each token's cell (labels.EVENT_CLASSES);
  - `ground_weight`: one upper-layer head attends where the event being stated is shown;
  - `chain_weight`: one middle-layer head looks from event j's tokens at event j - 1's;
  - `teacher`: KL(teacher ‖ model) on the answer (a draft distilled from its target; the teacher
    always sees the whole video), and `label_weight` the cross-entropy on the reference beside it;
  - `visual_drop`: for a share of the examples the model sees only a subset of its visual tokens,
    random or chosen by UV-Prune on the teacher, each at its own position (zoo.train.dropout).
Check: `caption_f1`, the event F1 of greedy descriptions of held-out worlds, decoded by reelflow's
own loop over the model adapter (models.decoding), as the Generate stage and the model card do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch

from models.decoding import greedy_answer
from models.load import adapted
from models.preprocess import CLIP_MEAN, CLIP_STD, SIGLIP_MEAN, SIGLIP_STD
from zoo import WEIGHTS, captions
from zoo.card import answer_budget
from zoo.shapes import FPS, FRAME_SIZE, zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train import config as settings
from zoo.train import loop
from zoo.train.config import ToyConfig
from zoo.train.data import Batches, example, shifted_positions
from zoo.train.dropout import answer_starts, keep_mask, uv_token_scores
from zoo.train.labels import AUX, EVENT_CLASSES
from zoo.train.losses import distill_loss, grounding_loss, probe_loss, rare_class_loss

log = logging.getLogger("reelflow.train")

QUICK_SEEDS, QUICK_SECONDS = range(100, 104), 10.0     # the check during training: short held-out videos


def train(progress: bool | None = None, **keys) -> dict:
    """Parses the flat keys of the `train:` block (a graph.spec.ConfigError before anything is built
    if one is wrong), trains, saves, and returns what training.json holds."""
    loop_config, toy_config = settings.parse(keys)
    return loop.train(ToyRecipe(toy_config), loop_config, progress=progress)


class ToyRecipe(loop.Recipe):
    """A zoo model from its shape (or `init`), the probe heads its losses need and a frozen teacher;
    toy-world batches; the step's losses by name (step_losses); the F1 check; a transformers
    checkpoint in bf16."""

    def __init__(self, config: ToyConfig):
        self.config, self.name = config, config.model

    # --------------------------------------------------------------------------------- build

    def build(self, device: torch.device) -> list[torch.nn.Parameter]:
        from transformers import AutoModelForImageTextToText

        c, losses = self.config, self.config.losses
        self.device = device
        config = zoo_config(c.model, c.rope_theta)
        self.tokenizer = build_tokenizer(config.model_type)
        if c.init:     # go on from a saved checkpoint (same zoo shape, config checks it) instead of random weights
            net = AutoModelForImageTextToText.from_pretrained(c.init, dtype=torch.float32, use_safetensors=True)
        else:
            net = AutoModelForImageTextToText.from_config(config)
        layers = net.config.text_config.num_hidden_layers
        self.ground_layer = _looking_layer(losses.ground_layer, max(1, layers - 2), losses.ground_weight)
        self.chain_layer = _looking_layer(losses.chain_layer, layers // 2, losses.chain_weight)
        if self.ground_layer is not None or self.chain_layer is not None:
            net.set_attn_implementation("eager")   # these losses read attention weights, which only eager returns
        self.n_params = sum(p.numel() for p in net.parameters())
        hidden = config.text_config.hidden_size
        self.heads = {}
        if losses.aux_weight > 0:
            self.heads["cells"] = torch.nn.Linear(hidden, sum(len(v) for v in AUX.values())).to(device)
        if losses.event_weight > 0:
            self.heads["events"] = torch.nn.Linear(hidden, len(EVENT_CLASSES)).to(device)
        self.teacher = None
        if losses.teacher:     # a trained target of the same architecture and tokenizer, frozen
            self.teacher = AutoModelForImageTextToText.from_pretrained(losses.teacher, dtype=torch.float32,
                                                                       use_safetensors=True)
            self.teacher.eval().requires_grad_(False).to(device)
        net.to(device)         # after every random initialisation, which stays on the CPU: same weights anywhere
        net.train()
        self.net = net
        return list(net.parameters()) + [p for h in self.heads.values() for p in h.parameters()]

    def describe(self) -> str:
        d = self.config.data
        return (f"{type(self.net).__name__}, {self.n_params / 1e6:.2f} M parameters, batches of {d.batch_size} "
                f"videos of {list(d.seconds)} s")

    @property
    def weights(self) -> dict[str, float]:
        w = self.config.losses
        return {"loss": w.label_weight, "aux_loss": w.aux_weight, "event_loss": w.event_weight, "distill_loss": w.distill_weight,
                "ground_loss": w.ground_weight, "chain_loss": w.chain_weight}

    def batches(self, steps: int, seed: int, start: int = 0) -> Batches:
        d, v = self.config.data, self.config.drop
        dense_gap = tuple(float(g) for g in d.dense_gap) if d.dense_gap is not None else None
        return Batches(self.config.model, d.batch_size, tuple(d.seconds), seed, tuple(d.warm_seconds),
                       int(d.ramp * steps), d.stretch, d.text_shift, d.clause_gap, d.ground_before, d.codec,
                       dense_gap, d.dense_share, d.fps_scale, d.fps_share, v.visual_drop, tuple(v.visual_keep),
                       v.visual_uv_share, start)

    # --------------------------------------------------------------------------------- step

    def loss(self, batch: dict) -> dict[str, torch.Tensor]:
        return step_losses(self.net, self.heads, batch, self.teacher, self.ground_layer, self.chain_layer,
                           self.config.losses.ground_margin, tuple(self.config.drop.uv_layers))

    # --------------------------------------------------------------------------------- check, save

    def evaluate(self, final: bool) -> dict:
        if not final:      # a quick look on short held-out videos: is the model using the video yet?
            f1 = caption_f1(self.net, self.tokenizer, QUICK_SEEDS, QUICK_SECONDS)
            log.info("caption F1 %.3f on %d held-out %g-s videos", f1, len(QUICK_SEEDS), QUICK_SECONDS)
            return {f"f1_at_{QUICK_SECONDS:g}s": round(f1, 4)}
        c = self.config
        seeds = range(c.eval_videos)
        f1 = caption_f1(self.net.to(self.device).float(), self.tokenizer, seeds, c.eval_seconds)
        log.info("%s: caption F1 %.3f on %d held-out %g-s videos", c.model, f1, c.eval_videos, c.eval_seconds)
        out = {f"f1_at_{c.eval_seconds:g}s": round(f1, 4), "eval_seeds": list(seeds)}
        if self.teacher is not None:     # a draft: how often it agrees with its teacher, whole and pruned
            # pruned by UV-Prune on the layers the dropout was trained with (l_0..L: their sum telescopes)
            layers = tuple(range(c.drop.uv_layers[0], c.drop.uv_layers[1] + 1))
            for alpha in (0.0, 0.9):
                agree = teacher_agreement(self.net, self.teacher, self.tokenizer, seeds, c.eval_seconds, alpha, layers)
                log.info("%s: greedy agreement with the teacher %.3f at alpha %g (UV-Prune on layers %s)", c.model,
                         agree, alpha, list(layers))
                out[f"agreement_alpha{alpha:g}"] = round(agree, 4)
            out["agreement_uv_layers"] = list(layers)
        return out

    def default_out(self) -> Path:
        return WEIGHTS / self.config.model

    def save(self, out_dir: Path) -> None:
        self.net.set_attn_implementation("sdpa")   # what the saved checkpoint is loaded with by default
        self.net = self.net.to(torch.bfloat16)     # what is shipped is what is evaluated
        save(self.net.cpu(), self.tokenizer, out_dir)   # written from the CPU, whatever trained it

    def record(self) -> dict:
        c, d, w = self.config, self.config.data, self.config.losses
        out = {"model": c.model, "parameters": self.n_params, "batch_size": d.batch_size,
               "aux_weight": w.aux_weight, "event_weight": w.event_weight, "stretch": d.stretch, "init": c.init,
               "teacher": w.teacher, "distill_weight": w.distill_weight if w.teacher else None,
               "label_weight": w.label_weight, "visual_drop": c.drop.visual_drop,
               "visual_keep": list(c.drop.visual_keep) if c.drop.visual_drop else None,
               "visual_uv_share": c.drop.visual_uv_share if c.drop.visual_drop else None,
               "uv_layers": list(c.drop.uv_layers) if c.drop.visual_drop and c.drop.visual_uv_share else None,
               "rope_theta": self.net.config.text_config.rope_parameters["rope_theta"],
               "ground_weight": w.ground_weight, "ground_layer": self.ground_layer,
               "chain_weight": w.chain_weight, "chain_layer": self.chain_layer, "text_shift": d.text_shift,
               "clause_gap": d.clause_gap, "ground_margin": w.ground_margin, "ground_before": d.ground_before,
               "codec": d.codec, "dense_gap": [float(g) for g in d.dense_gap] if d.dense_gap else None,
               "dense_share": d.dense_share if d.dense_gap else None,
               "fps_scale": list(d.fps_scale) if d.fps_scale else None,
               "fps_share": d.fps_share if d.fps_scale else None,
               "seconds": list(d.seconds), "warm_seconds": list(d.warm_seconds), "ramp": d.ramp}
        if c.init and (Path(c.init) / "training.json").is_file():   # keep the whole recipe: earlier stages first
            out["init_training"] = json.loads((Path(c.init) / "training.json").read_text())
        return out


def _looking_layer(layer: int | None, default: int, weight: float) -> int | None:
    """The layer whose first head a `weight`-ed attention target trains (None: that target is off;
    config checks the layer's range)."""
    if weight <= 0:
        return None
    return default if layer is None else int(layer)


def step_losses(net, heads: dict, batch: dict, teacher=None, ground_layer: int | None = None,
                chain_layer: int | None = None, margin: float = 1.0,
                uv_layers: tuple[int, int] = (0, 2)) -> dict[str, torch.Tensor]:
    """{"loss": language-model loss, "aux_loss": cell-probe loss, "event_loss": event-probe loss,
    "distill_loss": KL(teacher ‖ model) on the answer's positions, "ground_loss", "chain_loss": the
    looking losses}, each but the first only with its head, labels, teacher or layer (`ground_layer`,
    `chain_layer`: the layers whose first head is trained where to look; they need eager
    attention, which returns the weights; `margin`: see losses.grounding_loss). A batch's
    `position_offset` moves its text's positions. The video is encoded once; the cell probe
    reads each visual token as it enters the language model, the event probe reads it at the middle
    layer; the same features go into the language model through `mm_encoder_outputs`.
    A batch's `keep_fraction` (zoo.train.data.Batches.drops) has the model see only part of some
    rows' visual tokens, at their own positions (zoo.train.dropout), the highest of `keep_noise`
    or, where `keep_by_uv`, of UV-Prune's scores from the teacher's hidden states at `uv_layers`;
    the teacher always sees the whole video, as the target does at inference."""
    batch = dict(batch)
    cells, events = batch.pop("cell_labels", None), batch.pop("event_labels", None)
    ground_mask, chain_target = batch.pop("ground_mask", None), batch.pop("chain_mask", None)
    offset = batch.pop("position_offset", None)
    fractions, by_uv, noise = batch.pop("keep_fraction", None), batch.pop("keep_by_uv", None), batch.pop("keep_noise", None)
    teacher_batch = dict(batch)            # the teacher sees the positions it would at inference
    dropping = fractions is not None and bool((fractions < 1).any())
    uv = dropping and by_uv is not None and bool(by_uv.any())
    if uv and teacher is None:
        raise ValueError("UV-Prune-chosen dropout reads the teacher's hidden states: it needs a teacher")
    taught = None
    if teacher is not None:                # first: UV-Prune's choice needs its hidden states
        with torch.no_grad():
            taught = teacher(**{k: v for k, v in teacher_batch.items() if k != "labels"}, output_hidden_states=uv)
    if (offset is not None and bool(offset.any())) or dropping:
        # positions from the whole prompt: a dropped token leaves the mask, not the position table
        add = offset if offset is not None else torch.zeros_like(batch["input_ids"])
        batch["position_ids"] = shifted_positions(net, batch, add)
    if dropping:
        video_id = net.config.video_token_id if net.config.model_type == "qwen2_5_vl" else net.config.video_token_index
        is_video = batch["input_ids"] == video_id
        scores = noise
        if uv:
            found = uv_token_scores(taught.hidden_states, is_video, answer_starts(teacher_batch["labels"]), uv_layers)
            scores = torch.where(by_uv[:, None], found, noise)
        keep = keep_mask(is_video, scores, fractions)
        batch["attention_mask"] = batch["attention_mask"] * keep
        # the looking losses ask for attention on the kept tokens only (a query none of whose
        # targets is kept has no target)
        ground_mask = ground_mask & keep[:, None, :] if ground_mask is not None else None
        chain_target = chain_target & keep[:, None, :] if chain_target is not None else None
    ground = ground_layer is not None and ground_mask is not None
    chain = chain_layer is not None and chain_target is not None

    def looking(out) -> dict:
        return (({"ground_loss": grounding_loss(out.attentions[ground_layer], ground_mask, margin)} if ground else {})
                | ({"chain_loss": grounding_loss(out.attentions[chain_layer], chain_target, margin)} if chain else {}))

    def distill(out) -> torch.Tensor:
        return distill_loss(out.logits, taught.logits, teacher_batch["labels"])

    if not heads or cells is None:
        out = net(**batch, output_attentions=ground or chain)
        losses = {"loss": out.loss} | ({"distill_loss": distill(out)} if teacher is not None else {})
        return losses | looking(out)
    pixels = batch.pop("pixel_values_videos")
    qwen = net.config.model_type == "qwen2_5_vl"
    if qwen:
        feats = net.model.get_video_features(pixels, batch["video_grid_thw"])
        tokens = torch.cat(feats.pooler_output)                        # [n_tokens, d]
    else:
        feats = net.model.get_video_features(pixels)
        tokens = feats.pooler_output[:, :-1].reshape(-1, feats.pooler_output.shape[-1])   # newline dropped
    out = net(**batch, mm_encoder_outputs={"video": feats}, output_hidden_states="events" in heads,
              output_attentions=ground or chain)
    losses = {"loss": out.loss} | looking(out)
    if teacher is not None:
        losses["distill_loss"] = distill(out)
    if "cells" in heads:
        losses["aux_loss"] = probe_loss(heads["cells"](tokens), cells.reshape(-1, len(AUX)),
                                        [len(v) for v in AUX.values()])
    if "events" in heads and events is not None:
        middle = out.hidden_states[len(out.hidden_states) // 2]          # [batch, seq, d]
        video_id = net.config.video_token_id if qwen else net.config.video_token_index
        is_video = batch["input_ids"] == video_id
        if not qwen:                                                      # each row's last one is the newline
            last = is_video.int().cumsum(1) == is_video.sum(1, keepdim=True)
            is_video = is_video & ~last
        losses["event_loss"] = rare_class_loss(heads["events"](middle[is_video]), events)
    return losses


@torch.no_grad()
def caption_f1(model, tokenizer, seeds, seconds: float) -> float:
    """Mean event F1 of the greedy descriptions of held-out worlds `seeds` of `seconds` s (rendered
    frames), by `model` (a transformers model in memory, left as it was found) through the adapter."""
    arch = model.config.model_type
    f1 = []
    with adapted(model, tokenizer, preprocessor_config(arch)) as lm:
        for seed in seeds:
            ex = example(int(seed), seconds, FPS[arch])
            answer = greedy_answer(lm, ex.frames, ex.fps, ex.prompt, answer_budget(ex.truth))
            f1.append(captions.score(tokenizer.decode(answer, skip_special_tokens=True), ex.truth)["f1"])
    return float(np.mean(f1))


@torch.no_grad()
def teacher_agreement(model, teacher, tokenizer, seeds, seconds: float, alpha: float = 0.0,
                      uv_layers: tuple[int, ...] = (0, 1, 2)) -> float:
    """zoo.card's greedy agreement of `model` (a draft in memory) with `teacher` along the
    teacher's greedy descriptions of held-out worlds `seeds` of `seconds` s (rendered frames), the
    draft seeing the visual tokens UV-Prune keeps at `alpha` (0: all) on the teacher's layers
    `uv_layers`. Both are left as found."""
    from zoo.card import agreement, uv_keep

    arch = model.config.model_type
    hits = total = 0
    with adapted(model, tokenizer, preprocessor_config(arch)) as draft, \
            adapted(teacher, tokenizer, preprocessor_config(arch)) as target:
        for seed in seeds:
            ex = example(int(seed), seconds, FPS[arch])
            answer = greedy_answer(target, ex.frames, ex.fps, ex.prompt, answer_budget(ex.truth))
            keep = uv_keep(target, ex.frames, ex.fps, alpha, uv_layers) if alpha > 0 else None
            a, b = agreement(draft, ex.frames, ex.fps, answer, keep)
            hits, total = hits + a, total + b
    return hits / max(total, 1)


def preprocessor_config(arch: str) -> dict:
    """How the zoo's frames are prepared for `arch`: normalisation, frame rate and size."""
    mean, std = (CLIP_MEAN, CLIP_STD) if arch == "qwen2_5_vl" else (SIGLIP_MEAN, SIGLIP_STD)
    return {"image_mean": list(mean), "image_std": list(std), "fps": FPS[arch], "size": [FRAME_SIZE, FRAME_SIZE]}


def save(net, tokenizer, out_dir: Path) -> None:
    """A checkpoint any transformers user can load: safetensors weights, config, tokenizer with its
    chat template, and the preprocessing the model was trained with (frame rate and size included)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    net.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(net.config.model_type),
                                                                 indent=1) + "\n")
