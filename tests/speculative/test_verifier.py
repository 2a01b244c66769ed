"""The target's verifier (speculative.verifier) with tree proposals, on a shipped toy target: greedy decoding from trees whose
paths are partly the target's own tokens (and partly not) is token-identical to the target's
`generate()`; the cache keeps only the accepted path's entries (a plain decode continues right
from it); a chain given as a tree behaves as the chain."""

from __future__ import annotations

import torch

from models.decoding import prefill_video
from models.load import load_model
from models.sampling import Sampling
from speculative.protocol import Proposal
from speculative.reference import stopwatch
from speculative.verifier import TargetVerifier
from zoo.shapes import FPS
from zoo.train.data import example

TARGET = "zoo/weights/qwen-target"


def setup(max_new_tokens):
    """A verifier over the target's prefill of a held-out toy video, and generate()'s answer."""
    lm = load_model(TARGET)
    fps = FPS[lm.arch]
    ex = example(7, 16, fps)
    cache, layout, logits = prefill_video(lm, ex.frames, fps, ex.prompt)
    verifier = TargetVerifier(lm, cache, layout.length, layout, logits, sampling=Sampling(),
                              max_new_tokens=max_new_tokens, vocab=lm.vocabulary)
    ref = lm.model.generate(**lm.generate_inputs(layout, ex.frames, fps), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False)[0, layout.length:].tolist()
    return verifier, lm, ref


def oracle_tree(ref, at, vocab, corrupt):
    """Three levels under the last committed token: at each, the target's own next token beside a
    distractor, a dead branch under the first distractor; `corrupt` replaces the second level's
    right token, so only one level can be accepted."""
    right = [ref[at + d] if at + d < len(ref) else 0 for d in range(3)]
    wrong = [(t + 1 + d) % vocab for d, t in enumerate(right)]
    second = wrong[1] if corrupt else right[1]
    #            0:wrong0   1:right0
    #              |          /     \\
    #            2:junk   3:second  4:wrong1'
    #                        |   \\
    #                     5:wrong2 6:right2
    tokens = [wrong[0], right[0], (wrong[0] + 3) % vocab, second, (second + 2) % vocab, wrong[2], right[2]]
    parents = [-1, -1, 0, 1, 1, 3, 3]
    return torch.tensor(tokens), torch.tensor(parents)


def test_greedy_tree_verification_is_generate():
    verifier, lm, ref = setup(max_new_tokens=20)
    rounds = verifier.rounds
    r = 0
    while not verifier.done:
        tokens, parents = oracle_tree(ref, len(rounds.committed), lm.vocab_size, corrupt=r % 2 == 1)
        verifier.verify(Proposal(r, len(rounds.committed), tokens, parents=parents), stopwatch)
        r += 1
        assert lm.cached_length(verifier.cache) == verifier.start + rounds.in_cache     # only the kept path
    assert rounds.committed == ref[:len(rounds.committed)] and len(rounds.committed) == 20
    assert r < 20 and max(rounds.accepted) == 3 and 1 in rounds.accepted


def test_the_cache_keeps_only_the_accepted_paths_entries():
    """After tree rounds, a plain greedy decode from the verifier's cache goes on with the
    target's own tokens: the dropped nodes' entries are gone and the path's sit where they belong."""
    verifier, lm, ref = setup(max_new_tokens=24)
    rounds = verifier.rounds
    for r in range(4):
        tokens, parents = oracle_tree(ref, len(rounds.committed), lm.vocab_size, corrupt=r == 1)
        verifier.verify(Proposal(r, len(rounds.committed), tokens, parents=parents), stopwatch)
    out = list(rounds.committed)
    pending = torch.tensor(rounds.pending, dtype=torch.long)
    position = verifier.start + rounds.in_cache
    logits = lm.score(verifier.cache, pending, position, verifier.layout)[-1]
    position += pending.numel()
    while len(out) < 24:
        out.append(int(logits.argmax()))
        logits = lm.score(verifier.cache, torch.tensor(out[-1:]), position, verifier.layout)[-1]
        position += 1
    assert out == ref


def test_a_chain_as_a_tree_is_the_chain():
    v_tree, lm, ref = setup(max_new_tokens=12)
    v_chain, _, _ = setup(max_new_tokens=12)
    for r in range(4):
        at = len(v_tree.rounds.committed)
        assert at == len(v_chain.rounds.committed)
        chain = torch.tensor([ref[at], ref[at + 1], (ref[at + 2] + 1) % lm.vocab_size])
        v_tree.verify(Proposal(r, at, chain, parents=torch.arange(3) - 1), stopwatch)
        v_chain.verify(Proposal(r, at, chain), stopwatch)
        assert v_tree.rounds.committed == v_chain.rounds.committed
        assert v_tree.rounds.accepted == v_chain.rounds.accepted
    assert lm.cached_length(v_tree.cache) == lm.cached_length(v_chain.cache)
