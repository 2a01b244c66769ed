"""The shipped toy zoo: every model present, bf16 safetensors within the size budget (all pairs
≤ 40 MB, no file over 20 MB), loadable through the real loader, each draft 5-10x smaller than its
target with the same tokenizer, and the targets describe the bundled sample video."""

import json
from pathlib import Path

import pytest

from models.load import load_model, shared_vocabulary
from zoo.shapes import SHAPES
from zoo import WEIGHTS

MB = 1 << 20


def test_weights_fit_the_budget():
    files = [p for p in WEIGHTS.rglob("*") if p.is_file()]
    assert {p.parent.name for p in files if p.name == "model.safetensors"} == set(SHAPES)
    assert sum(p.stat().st_size for p in files) <= 40 * MB
    assert max(p.stat().st_size for p in files) <= 20 * MB


@pytest.mark.parametrize("target, draft", [("qwen-target", "qwen-draft"), ("llava-target", "llava-draft")])
def test_pairs_load_share_a_tokenizer_and_the_draft_is_5_to_10x_smaller(target, draft):
    t = load_model(str(WEIGHTS / target), name=target)
    d = load_model(str(WEIGHTS / draft), name=draft)
    assert shared_vocabulary(t, d) == len(t.tokenizer)
    ratio = sum(p.numel() for p in t.model.parameters()) / sum(p.numel() for p in d.model.parameters())
    assert 5 <= ratio <= 10
    assert 5e6 <= sum(p.numel() for p in t.model.parameters()) <= 10e6
    assert json.loads((WEIGHTS / target / "training.json").read_text())["steps"] > 0


def test_sample_video_and_truth_are_bundled():
    sample = Path(__file__).resolve().parents[2] / "zoo" / "sample"
    assert (sample / "toy-30s.mp4").stat().st_size > 1000
    assert json.loads((sample / "toy-30s.json").read_text())["events"]
