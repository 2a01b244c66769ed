"""The place-keeping measurement: one entry per stated clause, shares in [0, 1]."""

import torch
from transformers import AutoModelForImageTextToText

from tools.grounding import by_clause
from zoo import world
from zoo.shapes import zoo_config
from zoo.tokenizer import build_tokenizer


def test_by_clause_gives_one_mass_per_event_and_one_accuracy_per_clause_and_the_end():
    torch.manual_seed(0)
    config = zoo_config("qwen-draft")
    net = AutoModelForImageTextToText.from_config(config).eval()
    net.set_attn_implementation("eager")
    seed, seconds = 5, 12
    n_events = len(world.make_world(seed, seconds).truth.events)
    result = by_clause(net, build_tokenizer(config.model_type), [seed], seconds, layer=1)
    assert len(result["mass"]) == n_events
    assert len(result["accuracy"]) == n_events + 1            # the end of the turn after the last clause
    assert all(0.0 <= v <= 1.0 + 1e-6 for v in result["mass"] + result["accuracy"])
