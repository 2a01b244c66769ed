"""Sparrow on the executor: the dynamic draft tree's structure, and greedy decoding through the
sparrow graph (target prefill with taps → head drafts a tree or a chain → the target verifies the
tree) token-identical to the target's own `generate()`, for both shipped toy targets, with the head
attending to text only (VATA) and to the video's mid-layer states too. The heads here are
untrained (random): losslessness may not depend on the head; the shipped heads' figures are
bench_sparrow's."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from graph.executor import Executor
from models.load import load_model
from models.registry import release_all
from models.sparrow import HeadCache, SparrowConfig, SparrowHead
from speculative.head_draft import draft_tree
from speculative.tree import check_tree
from stages.types import Request
from tests.helpers import make, node, target_side
from tests.stages.test_generate import reference_ids
from zoo.shapes import FPS
from zoo.videos import make_video

PROMPT = "describe the video ."
TARGETS = {"qwen2_5_vl": "zoo/weights/qwen-target", "llava_onevision": "zoo/weights/llava-target"}


def random_head(lm, path, vata=True, seed=0):
    torch.manual_seed(seed)
    head = SparrowHead(SparrowConfig.of_target(lm, tap_layer=lm.n_layers // 2, vata=vata))
    head.save(path)
    return str(path)


@torch.inference_mode()
def test_the_dynamic_tree_is_a_tree_of_the_heads_best_and_leaves_the_cache_as_it_was():
    lm = load_model(TARGETS["qwen2_5_vl"])
    torch.manual_seed(1)
    head = SparrowHead(SparrowConfig.of_target(lm)).eval()
    cache = HeadCache.empty(head)
    z = torch.randn(5, head.config.hidden)
    top = head(cache, z, torch.arange(5))[-1]
    keys = cache.keys.clone()
    tokens, parents, facts = draft_tree(head, lm, cache, top, 5, total=20, depth=4, topk=3, vocab=lm.vocab_size)
    check_tree(tokens, parents)                                   # parents first, distinct siblings
    assert len(tokens) == facts["nodes"] <= 20 and 2 <= facts["depth"] <= 4
    assert cache.length == 5 and torch.equal(cache.keys, keys)
    roots = set(tokens[parents < 0].tolist())
    assert roots <= set(lm.lm_head(top).topk(3).indices.tolist()) and roots
    chain_like = draft_tree(head, lm, cache, top, 5, total=4, depth=4, topk=1, vocab=lm.vocab_size)
    assert chain_like[1].tolist() == [-1, 0, 1, 2]                # topk 1: the head's greedy chain


def sparrow_nodes(target: dict, head: str, *, tree=True, max_new_tokens=24, taps=(3, 6), temperature=0.0, seed=0):
    return {
        **target_side(target, max_new_tokens=max_new_tokens, taps=list(taps)),
        "draft": node("stages.sparrow.SparrowDraft", on="target",
                      inputs={"taps": "prefill.taps", "verdict": {"from": "verify.verdict", "feedback": True, "prime": 1}},
                      model=target, head=head, total=12, depth=3, topk=3, tree=tree, max_new_tokens=max_new_tokens),
        "verify": node("stages.verify.Verifier", on="target", inputs={"kv": "prefill.kv", "proposal": "draft.proposal"},
                       model=target, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed),
    }


@pytest.mark.parametrize("arch", list(TARGETS))
@pytest.mark.parametrize("variant", ["tree", "chain", "no_vata", "draft_vocab"])
def test_greedy_sparrow_is_token_identical_to_generate(arch, variant, tmp_path):
    """draft_vocab: the head proposes only a third of the tokens (and the end token); the answer is
    still the target's own, every token the set lacks coming as the target's correction."""
    target = {"path": TARGETS[arch], "fps": FPS[arch], "size": 84, "name": "target"}
    lm = load_model(target["path"])
    head = random_head(lm, tmp_path / "head", vata=variant != "no_vata")
    video = tmp_path / "v.mp4"
    make_video(31, 16, 2, 84, video)
    nodes = sparrow_nodes(target, head, tree=variant != "chain")
    if variant == "draft_vocab":
        (tmp_path / "vocab.json").write_text(json.dumps(list(range(0, lm.vocabulary, 3))))
        nodes["draft"]["stage"]["draft_vocab"] = str(tmp_path / "vocab.json")
    spec, plan = make(nodes)
    try:
        with Executor(spec, plan, progress=False) as ex:
            tokens = ex.run(Request("v", str(video), PROMPT)).outputs["verify.tokens"]
    finally:
        release_all()
    ref = reference_ids(target, str(video), PROMPT, 24)
    assert tokens.ids == ref[:len(tokens.ids)] and (len(tokens.ids) == 24 or tokens.ids[-1] in lm.eos_ids)
    meta = tokens.details()
    assert meta["rounds"] >= 1 and meta["draft_prefill"]["vata"] == (variant != "no_vata")
    if variant == "draft_vocab":
        assert any(t % 3 for t in tokens.ids)          # the answer holds tokens the head could not propose


def test_compiled_sparrow_is_token_identical_and_never_compiles_mid_run(tmp_path):
    """With the target compiled (its steps and the head's tree, warmed at setup for every thread
    count an elastic pool takes), requests over videos of two lengths decode generate()'s tokens,
    and no compile happens once the stages are set up (a recompile raises)."""
    target = {"path": TARGETS["qwen2_5_vl"], "fps": FPS["qwen2_5_vl"], "size": 84, "name": "target",
              "compile": "default"}
    head = random_head(load_model(target["path"]), tmp_path / "head")
    nodes = sparrow_nodes(target, head)
    nodes["draft"]["stage"].update(total=10, depth=6, topk=2)        # the CPU's default tree
    spec, plan = make(nodes)
    videos = []
    for seed, seconds in ((31, 8), (32, 14)):
        videos.append(tmp_path / f"v{seed}.mp4")
        make_video(seed, seconds, 2, 84, videos[-1])
    try:
        with Executor(spec, plan, progress=False) as ex, torch.compiler.set_stance("fail_on_recompile"):
            got = [ex.run(Request(v.stem, str(v), PROMPT)).outputs["verify.tokens"].ids for v in videos]
    finally:
        release_all()
    eos = load_model(target["path"]).eos_ids
    for ids, video in zip(got, videos):
        ref = reference_ids(target, str(video), PROMPT, 24)               # the model's own generate()
        assert ids == ref[:len(ids)] and (len(ids) == 24 or ids[-1] in eos)


def test_a_primed_proposal_edge_is_refused_for_a_tree_draft(tmp_path):
    """The first token from the prefill (a primed proposal edge) is for chain drafts: a tree
    arriving after it stops the run with a message that says what to change."""
    from graph.executor import StageFailed

    target = {"path": TARGETS["qwen2_5_vl"], "fps": FPS["qwen2_5_vl"], "size": 84, "name": "target"}
    head = random_head(load_model(target["path"]), tmp_path / "head")
    video = tmp_path / "v.mp4"
    make_video(31, 8, 2, 84, video)
    nodes = sparrow_nodes(target, head)
    nodes["verify"]["inputs"]["proposal"] = {"from": "draft.proposal", "prime": 1}
    spec, plan = make(nodes)
    try:
        with Executor(spec, plan, progress=False) as ex, pytest.raises(StageFailed, match="unprimed for tree drafts"):
            ex.run(Request("v", str(video), PROMPT))
    finally:
        release_all()


def test_dataclass_config_round_trips():
    lm = load_model(TARGETS["qwen2_5_vl"])
    c = SparrowConfig.of_target(lm, tap_layer=3)
    assert SparrowConfig(**dataclasses.asdict(c)) == c and c.hidden == lm.text_config.hidden_size


@pytest.mark.slow
def test_sampled_first_tokens_follow_the_target_distribution(tmp_path):
    """Over 200 seeds, the first two tokens of Sparrow at temperature 1 (a head drafting trees, the
    target judging siblings by multi-candidate rejection) are distributed as the target's own
    sampling's: a two-sample chi-square on the six most common pairs, 5 degrees of freedom, bound at
    its 0.999 quantile. The target is a random checkpoint of the zoo's shape: the shipped one is so
    sure of its first words that at temperature 1 it says the same two tokens for every seed, and
    a test over one outcome could not fail; a random head's candidates are often rejected, so the
    residual draws are exercised."""
    from collections import Counter

    from tests.models.test_adapters import random_checkpoint
    from tests.stages.test_generate import ar_nodes, run_graph

    path = random_checkpoint(tmp_path / "target", "qwen-target", seed=1, never_stops=True)
    target = {"path": str(path), "fps": 2, "size": 84, "name": "target"}
    head = random_head(load_model(str(path)), tmp_path / "head")
    video = tmp_path / "v.mp4"
    make_video(32, 12, 2, 84, video)
    ours, ar = Counter(), Counter()
    try:
        for seed in range(200):
            spec, plan = make(sparrow_nodes(target, head, max_new_tokens=2, temperature=1.0, seed=seed))
            with Executor(spec, plan, progress=False) as ex:
                ours[tuple(ex.run(Request("v", str(video), PROMPT)).outputs["verify.tokens"].ids)] += 1
            out = run_graph(ar_nodes(target, max_new_tokens=2, temperature=1.0, seed=seed),
                            Request("v", str(video), PROMPT))
            ar[tuple(out.outputs["generate.tokens"].ids)] += 1
    finally:
        release_all()
    assert len(ar) > 20                     # the distribution has many outcomes to get wrong
    keys = [k for k, _ in (ours + ar).most_common(6)]
    stat = sum((ours[k] - ar[k]) ** 2 / (ours[k] + ar[k]) for k in keys)
    assert stat < 20.52
