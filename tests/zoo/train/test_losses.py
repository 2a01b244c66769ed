"""zoo.train.losses: each term is small exactly where it should be."""

import numpy as np

from zoo.shapes import zoo_config
from zoo.tokenizer import build_tokenizer
from zoo.train.data import example, model_inputs


def test_grounding_loss_is_small_only_where_the_head_looks_at_the_marked_tokens():
    import torch

    from zoo.train.losses import grounding_loss

    mask = torch.zeros(1, 3, 3, dtype=torch.bool)
    mask[0, 2, 0] = True                                       # only query 2 has a target: key 0
    looks = torch.zeros(1, 2, 3, 3)
    looks[0, 0, :, 0] = 1.0                                    # head 0 all on key 0
    away = torch.zeros(1, 2, 3, 3)
    away[0, 0, :, 1] = 1.0
    away[0, 1, :, 0] = 1.0                                     # another head looking there does not count
    assert grounding_loss(looks, mask).item() < 1e-6
    assert grounding_loss(away, mask).item() > 10
    assert grounding_loss(looks, torch.zeros_like(mask)).item() == 0.0


def test_a_margin_asks_for_larger_logit_gaps():
    """margin m: the loss of the head's logits divided by m, so a gap that gives the target most of
    the mass at m = 1 costs more at m = 2, and a head that looks nowhere else costs nothing either way."""
    import torch

    from zoo.train.losses import grounding_loss

    logits = torch.tensor([3.0, 0.0, 0.0, 0.0])
    mask = torch.tensor([[[True, False, False, False]]])
    weights = torch.softmax(logits, -1).view(1, 1, 1, 4)
    assert abs(grounding_loss(weights, mask).item() + torch.log_softmax(logits, -1)[0].item()) < 1e-5
    assert abs(grounding_loss(weights, mask, 2.0).item() + torch.log_softmax(logits / 2, -1)[0].item()) < 1e-5
    certain = torch.tensor([1.0, 0.0, 0.0, 0.0]).view(1, 1, 1, 4)
    assert grounding_loss(certain, mask, 2.0).item() < 1e-6


def test_distillation_adds_the_teachers_kl_and_it_is_zero_against_itself(tmp_path):
    """A student equal to its teacher has KL 0 on every answer token; a different one does not."""
    import torch
    from transformers import AutoModelForImageTextToText

    from zoo.train.losses import distill_loss

    torch.manual_seed(0)
    config, tok = zoo_config("qwen-draft"), build_tokenizer("qwen2_5_vl")
    net = AutoModelForImageTextToText.from_config(config).eval()
    batch = model_inputs(config, tok, [example(1_000_003, 4, 2.0, np.random.default_rng(0))], with_answers=True)
    batch = {k: v for k, v in batch.items() if k not in ("cell_labels", "event_labels", "ground_mask", "chain_mask")}
    logits = net(**batch).logits
    assert abs(distill_loss(logits, logits, batch["labels"]).item()) < 1e-5
    other = AutoModelForImageTextToText.from_config(config).eval()
    assert distill_loss(other(**batch).logits, logits, batch["labels"]).item() > 1e-3

