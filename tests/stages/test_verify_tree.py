"""The Verifier with tree proposals, on a shipped toy target: greedy decoding from trees whose
paths are partly the target's own tokens (and partly not) is token-identical to the target's
`generate()`; the cache keeps only the accepted path's entries (a plain decode continues right
from it); a chain given as a tree behaves as the chain."""

from __future__ import annotations

import contextlib
import time

import torch

from models.decoding import prefill_video
from stages.types import KV, Proposal
from stages.verify import Verifier
from zoo.shapes import FPS
from zoo.train.data import example

TARGET = "zoo/weights/qwen-target"


class Ctx:
    """What the Verifier asks of the engine's context: emit, end and a timer."""

    device = "cpu"

    def __init__(self):
        self.emitted, self.ended = [], []

    def emit(self, name, value):
        self.emitted.append((name, value))

    def end(self, name):
        self.ended.append(name)

    @contextlib.contextmanager
    def timer(self, name):
        class T:
            seconds = 0.0
        t, start = T(), time.perf_counter()
        yield t
        t.seconds = time.perf_counter() - start


def setup(max_new_tokens):
    verifier = Verifier({"path": TARGET}, max_new_tokens=max_new_tokens)
    verifier.setup(Ctx())
    lm = verifier.lm
    fps = FPS[lm.arch]
    ex = example(7, 16, fps)
    cache, layout, logits = prefill_video(lm, ex.frames, fps, ex.prompt)
    kv = KV(cache, layout.length, layout, logits, lm.name)
    ref = lm.model.generate(**lm.generate_inputs(layout, ex.frames, fps), max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens, do_sample=False)[0, layout.length:].tolist()
    return verifier, lm, kv, ref


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
    verifier, lm, kv, ref = setup(max_new_tokens=20)
    ctx = Ctx()
    rounds = 0
    while not verifier.done:
        tokens, parents = oracle_tree(ref, len(verifier.committed), lm.vocab_size, corrupt=rounds % 2 == 1)
        verifier(ctx, kv, Proposal(rounds, len(verifier.committed), tokens, parents=parents))
        rounds += 1
        assert lm.cached_length(kv.cache) == kv.logical_length + verifier.in_cache     # only the kept path
    assert verifier.committed == ref[:len(verifier.committed)] and len(verifier.committed) == 20
    assert rounds < 20 and max(verifier.accepted) == 3 and 1 in verifier.accepted


def test_the_cache_keeps_only_the_accepted_paths_entries():
    """After tree rounds, a plain greedy decode from the verifier's cache goes on with the
    target's own tokens: the dropped nodes' entries are gone and the path's sit where they belong."""
    verifier, lm, kv, ref = setup(max_new_tokens=24)
    ctx = Ctx()
    for r in range(4):
        tokens, parents = oracle_tree(ref, len(verifier.committed), lm.vocab_size, corrupt=r == 1)
        verifier(ctx, kv, Proposal(r, len(verifier.committed), tokens, parents=parents))
    out = list(verifier.committed)
    pending = torch.tensor(out[verifier.in_cache:], dtype=torch.long)
    position = kv.logical_length + verifier.in_cache
    logits = lm.score(kv.cache, pending, position, kv.layout)[-1]
    position += pending.numel()
    while len(out) < 24:
        out.append(int(logits.argmax()))
        logits = lm.score(kv.cache, torch.tensor(out[-1:]), position, kv.layout)[-1]
        position += 1
    assert out == ref


def test_a_chain_as_a_tree_is_the_chain():
    v_tree, lm, kv_tree, ref = setup(max_new_tokens=12)
    v_chain = Verifier({"path": TARGET}, max_new_tokens=12)
    v_chain.setup(Ctx())
    _, _, kv_chain, _ = setup(max_new_tokens=12)
    ctx = Ctx()
    for r in range(4):
        at = len(v_tree.committed)
        assert at == len(v_chain.committed)
        chain = torch.tensor([ref[at], ref[at + 1], (ref[at + 2] + 1) % lm.vocab_size])
        v_tree(ctx, kv_tree, Proposal(r, at, chain, parents=torch.arange(3) - 1))
        v_chain(ctx, kv_chain, Proposal(r, at, chain))
        assert v_tree.committed == v_chain.committed and v_tree.accepted == v_chain.accepted
    assert lm.cached_length(kv_tree.cache) == lm.cached_length(kv_chain.cache)
