"""A draft's greedy round in one compiled call (models.draft_chain): the same logits and cache
entries as drafting token by token on the eager lean path, no compile once warmed, and vanilla
speculative decoding through it still gives the target's own greedy answer.

Tolerance: the chain's attention sums the same float32 terms in another order than the eager path
(models.compiled_step), so logits of size ~10 agree to a few float32 roundings: 1e-4, the bound
the compiled step's own tests use. Keys and values (size ~1): 1e-5."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from models.decoding import greedy, prefill_video
from models.draft_chain import DraftChain
from models.load import load_model
from models.sampling import Sampling
from speculative.model_draft import ModelDrafter
from speculative.reference import speculative_decode
from speculative.verifier import TargetVerifier
from zoo.train.data import example

DRAFT = "zoo/weights/qwen-draft"
TARGET = "zoo/weights/qwen-target"
STEPS = 3        # the chain's length: few unrolled steps keep the compile short


@pytest.fixture(scope="module")
def chained():
    """(the compiled draft, a warmed chain of STEPS, the eager draft, an example video)"""
    compiled = load_model(DRAFT, compile="default")
    chain = DraftChain(compiled, STEPS, compiled.vocabulary)
    chain.warm()
    return compiled, chain, load_model(DRAFT), example(11, 20, 2)


@torch.inference_mode()
def drafted_eagerly(lm, cache, pending: list[int], start: int, layout, steps: int):
    """Token by token on the eager lean path: (tokens, logits [steps, V], the cache after)."""
    tokens, rows, ids, at = [], [], torch.tensor(pending), start
    for _ in range(steps):
        states = lm.lean.forward_eager(cache, lm.embed(ids), layout.decode_positions(at, ids.shape[0])[0])
        logits = lm.lm_head(states[-1]).float()[:lm.vocabulary]
        at += ids.shape[0]
        tokens.append(int(logits.argmax()))
        rows.append(logits)
        ids = torch.tensor(tokens[-1:])
    return tokens, torch.stack(rows), cache


@pytest.mark.parametrize("pending", [[7], [7, 12]])
def test_the_chain_drafts_what_token_by_token_drafting_does(chained, pending):
    compiled, chain, eager, ex = chained
    cache, layout, _ = prefill_video(compiled, ex.frames, 2, ex.prompt)
    held = compiled.cached_length(cache)
    with torch.compiler.set_stance("fail_on_recompile"):
        tokens, logits = chain.run(cache, torch.tensor(pending), layout.decode_positions(layout.length,
                                                                                         len(pending) + STEPS - 1)[0])
    want_cache, _, _ = prefill_video(eager, ex.frames, 2, ex.prompt)
    want_tokens, want_logits, want_cache = drafted_eagerly(eager, want_cache, pending, layout.length, layout, STEPS)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-4)
    assert tokens.tolist() == want_tokens
    # everything fed (the pending tokens, then all drafted tokens but the last) is in the cache
    assert compiled.cached_length(cache) == held + len(pending) + STEPS - 1 == eager.cached_length(want_cache)
    for layer in range(compiled.n_layers):
        for got, want in zip(compiled.layer_kv(cache, layer), eager.layer_kv(want_cache, layer)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_chain_checks_its_inputs(chained):
    compiled, chain, _, ex = chained
    cache, layout, _ = prefill_video(compiled, ex.frames, 2, ex.prompt)
    with pytest.raises(ValueError, match="pending"):
        chain.run(cache, torch.tensor([], dtype=torch.long), torch.arange(STEPS - 1))
    with pytest.raises(ValueError, match="positions"):
        chain.run(cache, torch.tensor([3]), torch.arange(STEPS + 4))
    with pytest.raises(ValueError, match="steps"):
        DraftChain(compiled, 0, compiled.vocabulary)
    with pytest.raises(ValueError, match="fixed window greedily"):
        ModelDrafter(compiled, cache, layout.length, layout, torch.zeros(64), window="auto", sampling=Sampling(),
                     vocab=compiled.vocabulary, max_new_tokens=8, chain=chain)


@pytest.mark.parametrize("confidence", [0.0, 0.9])
def test_speculative_decoding_through_the_chain_is_the_targets_greedy_answer(chained, confidence):
    """Rounds of the chain's length go through it (the first round and a short last one token by
    token); `confidence` cuts a chained round after its first doubtful token. The answer is the
    target's own greedy one either way."""
    compiled, chain, _, ex = chained
    target = load_model(TARGET)
    t_cache, t_layout, t_logits = prefill_video(target, ex.frames, 2, ex.prompt)
    want = greedy(target, *prefill_video(target, ex.frames, 2, ex.prompt)[::2], t_layout.length, t_layout, 40)
    d_cache, d_layout, d_logits = prefill_video(compiled, ex.frames, 2, ex.prompt)
    verifier = TargetVerifier(target, t_cache, t_layout.length, t_layout, t_logits, sampling=Sampling(),
                              max_new_tokens=40, vocab=target.vocabulary)
    drafter = ModelDrafter(compiled, d_cache, d_layout.length, d_layout, d_logits, window=STEPS, sampling=Sampling(),
                           vocab=compiled.vocabulary, max_new_tokens=40, confidence=confidence, chain=chain)
    calls = []
    run = chain.run
    chain.run = lambda *a: calls.append(1) or run(*a)
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            ids = speculative_decode(verifier, drafter)
    finally:
        del chain.run
    assert ids == want
    assert calls, "no round went through the chain"
    stats = verifier.rounds.stats()
    if confidence:
        assert sum(stats.drafted) < STEPS * stats.rounds, "confidence cut no chained round short"
    else:         # every chained round drafted its whole length
        assert sum(d == STEPS for d in stats.drafted) >= len(calls)
    assert compiled.cached_length(d_cache) == d_layout.length + drafter.in_cache


def test_the_draft_stage_chains_only_what_a_chain_can_draft(monkeypatch):
    """The ModelDraft stage builds (and warms) a chain for a compiled draft drafting a fixed window
    greedily, and none for sampling, `window: auto`, `chain: false` or an eager draft. (The warm-up
    is recorded, not run: the compile itself is the fixture's above.)"""
    from stages.draft import ModelDraft

    warmed = []
    monkeypatch.setattr(DraftChain, "warm", lambda self: warmed.append(self.steps))
    compiled = {"path": DRAFT, "compile": "default"}
    cpu = SimpleNamespace(device="cpu")
    stage = ModelDraft(compiled, window=STEPS)
    stage.setup(cpu)
    assert isinstance(stage.chain, DraftChain) and stage.chain.steps == STEPS and warmed == [STEPS]
    for model, settings in [(compiled, {"window": "auto"}), (compiled, {"temperature": 1.0}),
                            (compiled, {"chain": False}), ({"path": DRAFT}, {})]:
        stage = ModelDraft(model, **{"window": STEPS, **settings})
        stage.setup(cpu)
        assert stage.chain is None, settings
    assert warmed == [STEPS]
