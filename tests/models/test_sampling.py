"""Logit warping against transformers' own warpers (temperature, top-k, top-p) and greedy."""

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from models.sampling import greedy, sample, warp


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.9)])
def test_warp_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(warp(logits, temperature, top_k, top_p), ref.softmax(-1))


def test_greedy_and_sample():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    assert greedy(logits).tolist() == [1]
    probs = torch.tensor([[0.0, 0.0, 1.0]])
    assert sample(probs, torch.Generator().manual_seed(1)).tolist() == [2]
    with pytest.raises(ValueError, match="temperature"):
        warp(logits, 0.0)
