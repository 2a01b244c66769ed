"""Speculative decoding on the executor (draft ⇄ verify with a feedback edge): with temperature 0
the output is token-identical to the target's own generate(do_sample=False), for both
architectures, drafting then verifying (prime 1) or drafting a round ahead (prime 2), with a draft
that disagrees often (rollbacks), one that always agrees (bonus tokens, rounds ahead kept), and
max_new_tokens falling inside a block. With sampling, the first tokens follow the target's own
sampling distribution (chi-square over seeds)."""

from __future__ import annotations

import pytest

from graph.executor import Executor
from models.registry import release_all
from zoo.videos import make_video
from zoo.shapes import FPS
from stages.types import Request
from tests.helpers import make, node, target_side
from tests.models.test_adapters import ARCHS, random_checkpoint
from tests.stages.test_generate import reference_ids

PROMPT = "what happened after the red circle appeared ?"
TARGET = {"qwen2_5_vl": "qwen-target", "llava_onevision": "llava-target"}


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request, tmp_path_factory):
    """A random target and a random draft of the zoo's shapes (they disagree often), on a 12-s video."""
    arch = request.param
    d = tmp_path_factory.mktemp(arch)
    target = random_checkpoint(d / "target", TARGET[arch], seed=1, never_stops=True)   # every round counts
    draft = random_checkpoint(d / "draft", ARCHS[arch], seed=2)
    video = d / "toy.mp4"
    make_video(21, 12, 2, 84, video)
    model = {"fps": FPS[arch], "size": 84}
    yield {**model, "path": str(target), "name": "target"}, {**model, "path": str(draft), "name": "draft"}, str(video)
    release_all()


def sd_nodes(target: dict, draft: dict, *, window=3, prime=1, max_new_tokens=24, temperature=0.0, seed=0,
             pre_verify=False, judge_ahead=False, first_from_prefill=False, confidence=0.0):
    """first_from_prefill: the proposal edge primed, as the shipped graphs have it (the verifier
    commits the target's first token from the prefill before the draft's first round)."""
    sampling = {"temperature": temperature, "seed": seed}
    return {
        **target_side(target, max_new_tokens=max_new_tokens),
        "draft_encode": node("stages.encode.VisionEncoder", on="draft", inputs={"group": "decode.group"},
                             model=draft, fps=target["fps"]),
        "draft_prefill": node("stages.prefill.Prefill", on="draft",
                              inputs={"tokens": "draft_encode.tokens", "request": "source.request"},
                              model=draft, max_new_tokens=max_new_tokens),
        "draft": node("stages.draft.ModelDraft", on="draft",
                      inputs={"kv": "draft_prefill.kv",
                              "verdict": {"from": "verify.verdict", "feedback": True, "prime": prime}},
                      model=draft, window=window, max_new_tokens=max_new_tokens, pre_verify=pre_verify,
                      confidence=confidence, **sampling),
        "verify": node("stages.verify.Verifier", on="target",
                       inputs={"kv": "prefill.kv", "proposal": {"from": "draft.proposal", "prime": int(first_from_prefill)}},
                       model=target, max_new_tokens=max_new_tokens, judge_ahead=judge_ahead, **sampling),
    }


def parallelvlm_nodes(target, draft, *, alpha=0.7, layers=(0, 1, 2), variant="as_written", attention=False, **kw):
    nodes = sd_nodes(target, draft, prime=2, **kw)
    if attention:         # SpecVLM: the question's attention at target layer 2
        nodes["prefill"]["stage"]["attention"] = [2]
        nodes["prune"] = node("stages.prune.AttentionPrune", on="draft", inputs={"taps": "prefill.attention"},
                              keep=1 - alpha, mass=0.5)
    else:
        nodes["prefill"]["stage"]["taps"] = list(layers)
        nodes["prune"] = node("stages.prune.UVPrune", on="draft", inputs={"taps": "prefill.taps"}, keep=1 - alpha,
                              layers=list(layers), variant=variant)
    nodes["draft_prefill"] = node("stages.prefill.SelectedPrefill", on="draft",
                                  inputs={"tokens": "draft_encode.tokens", "request": "source.request",
                                          "selection": "prune.selection"},
                                  model=draft, max_new_tokens=kw.get("max_new_tokens", 24))
    return nodes


def run_sd(nodes, video):
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False) as ex:
        return ex.run(Request("v", video, PROMPT)).outputs["verify.tokens"]


@pytest.mark.parametrize("window, prime", [(1, 1), (3, 1), (3, 2), (5, 2)])
def test_greedy_speculative_decoding_is_token_identical_to_generate(pair, window, prime):
    target, draft, video = pair
    tokens = run_sd(sd_nodes(target, draft, window=window, prime=prime), video)
    ref = reference_ids(target, video, PROMPT, 24)
    assert len(set(ref)) > 3
    assert tokens.ids == ref
    meta = tokens.details()
    assert meta["rounds"] >= 24 / (window + 1)
    assert tokens.ids[:1] == ref[:1]
    assert 0 <= meta["acceptance_rate"] < 0.9          # a random draft: rollbacks happened
    if prime == 2:
        assert meta["stale_proposals"] > 0              # rounds drafted ahead were voided


@pytest.mark.parametrize("drafter", ["random", "the target"])
@pytest.mark.parametrize("prime", [1, 2])
def test_the_first_token_comes_from_the_prefill_before_any_round(pair, drafter, prime):
    """With the proposal edge primed, the verifier's first call has no proposal: it commits and
    publishes the target's first token from the prefill's logits, and the draft's first round is
    judged against it (a random draft's first token is answered with the target's; the target's
    own is verified on). The output is generate()'s, and the first round is accounted as it is
    unprimed (it commits the first token), so M is tokens over rounds."""
    target, draft, video = pair
    nodes = sd_nodes(target, draft if drafter == "random" else dict(target), window=3, prime=prime,
                     first_from_prefill=True, pre_verify=prime == 2)
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False) as ex:
        result = ex.run(Request("v", video, PROMPT))
    tokens = result.outputs["verify.tokens"]
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)
    node_of = {r.id: r.node for r in result.calls}
    first = [r for r in result.calls if r.node == "verify" and any(e[0] == "first" for e in r.emits)]
    assert len(first) == 1 and first[0].item == 0
    assert not [d for d in first[0].deps if node_of[d[0]] == "draft"]     # no draft round reached it
    stats = tokens.speculative      # the first round is accounted as unprimed: it commits the first token
    assert tokens.details()["mean_accepted_length"] == round(len(tokens.ids) / stats.rounds, 4)
    if drafter == "the target":
        assert stats.metrics()["acceptance_rate"] == 1.0 and stats.stale_proposals == 0
    else:
        assert stats.accepted[0] == 0 and stats.drafted[0] >= 1


@pytest.mark.parametrize("prime", [1, 2])
def test_rounds_that_end_at_a_doubted_token_are_lossless(pair, prime):
    """confidence: a round ends after a token the draft gives less than the threshold. The
    random draft's tokens are all below 0.99 (its softmax over the vocabulary is nearly flat):
    every round is one token; the target as its own draft at 1e-9 drafts whole windows. The
    output is generate()'s either way."""
    target, draft, video = pair
    ref = reference_ids(target, video, PROMPT, 24)
    doubting = run_sd(sd_nodes(target, draft, window=4, prime=prime, confidence=0.99, first_from_prefill=True), video)
    assert doubting.ids == ref
    assert set(doubting.speculative.drafted) == {1} and set(doubting.speculative.windows) == {1}
    trusting = run_sd(sd_nodes(target, dict(target), window=4, prime=prime, confidence=1e-9), video)
    assert trusting.ids == ref
    assert max(trusting.speculative.drafted) == 4 and max(trusting.speculative.windows) == 4


def test_own_probability_is_q_when_sampling_and_the_softmax_when_greedy():
    import torch

    from speculative.model_draft import own_probability

    logits = torch.tensor([2.0, 0.0, -1.0])
    assert own_probability(logits, 0, None) == pytest.approx(float(torch.softmax(logits, -1)[0]))
    assert own_probability(logits, 2, torch.tensor([0.1, 0.2, 0.7])) == pytest.approx(0.7)


@pytest.mark.parametrize("drafter", ["random", "the target"])
def test_pre_verify_is_lossless_and_drafts_one_token_after_each_rollback(pair, drafter):
    """ParallelVLM's pre-verify (App. B): the first round and each round drafted right after a
    rollback are one token, verified at once; rounds drafted on a rejected token are voided, not
    verified; the others draft whole windows. A random draft is rejected every round, so every
    verified round is a pre-verify round; the target as its own draft goes on in whole windows
    after its first. The output is the target's generate() either way."""
    target, draft, video = pair
    tokens = run_sd(sd_nodes(target, draft if drafter == "random" else dict(target), window=4, prime=2,
                             pre_verify=True), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)
    stats = tokens.speculative
    after_rejection = [True] + [a < d for a, d in zip(stats.accepted, stats.drafted)][:-1]
    assert stats.pre_verify_rounds == sum(after_rejection)
    assert [d == 1 for d in stats.drafted][:-1] == after_rejection[:-1]     # (the last round may be cut short)
    if drafter == "random":
        assert all(after_rejection) and stats.stale_proposals > 0
    else:     # a round drafted ahead begins with the bonus token it foresaw: 3 of its 4 are verified
        assert stats.drafted[0] == 1 and set(stats.drafted[1:-1]) == {3}
        assert stats.metrics()["tokens_per_rollback"] == 24


@pytest.mark.parametrize("prime", [1, 2])
def test_a_draft_that_always_agrees_commits_window_plus_one_per_round(pair, prime):
    """The target as its own draft: every round is accepted whole plus the bonus token, and with
    prime 2 the round drafted ahead is kept (its first token is the bonus) instead of voided."""
    target, _, video = pair
    tokens = run_sd(sd_nodes(target, dict(target), window=3, prime=prime, max_new_tokens=21), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 21)
    assert tokens.speculative.metrics()["acceptance_rate"] == 1.0
    assert tokens.speculative.stale_proposals == 0
    if prime == 1:
        assert tokens.speculative.rounds == 6 and tokens.details()["mean_accepted_length"] == 3.5   # 5 x 4 + 1 = 21


def test_auto_window_is_the_seeds_eq6_within_bounds():
    from speculative.model_draft import auto_window

    assert auto_window(0.420, 0.047, 16) == 9          # ParallelVLM's example: Tp 420 ms, Tq(α=0.9) 47 ms
    assert auto_window(0.420, 0.078, 16) == 5          # ... and unpruned, Tq 78 ms
    assert auto_window(0.010, 0.050, 16) == 1          # a draft slower than the target: one token
    assert auto_window(1.0, 0.001, 12) == 12           # never past max_window
    assert auto_window(1.0, 0.0, 7) == 7


def test_pre_verify_auto_is_lossless(pair):
    """pre_verify="auto" (the parallelvlm graph's default) decides round by round from the measured
    times (tests/speculative/test_model_draft.py); its first round, before any time is measured, is
    a pre-verify round, and the output is the target's own whichever way the later ones go."""
    target, draft, video = pair
    tokens = run_sd(sd_nodes(target, draft, window=4, prime=2, pre_verify="auto"), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)
    assert tokens.speculative.pre_verify_rounds >= 1 and tokens.speculative.drafted[0] == 1


@pytest.mark.parametrize("prime", [1, 2])
def test_auto_window_is_lossless_and_reports_the_measured_times(pair, prime):
    """window=auto: γ follows the measured Tp / Tq after the first verdict; the output stays the
    target's own, and the metrics carry the γ per round and the times it came from."""
    target, draft, video = pair
    nodes = sd_nodes(target, draft, window="auto", prime=prime)
    nodes["draft"]["stage"].update(start_window=2, max_window=6)
    tokens = run_sd(nodes, video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)
    meta = tokens.details()
    assert meta["window_setting"] == "auto" and tokens.speculative.windows[0] == 2   # round 1: start_window
    assert meta["tp_ms"] > 0 and meta["tq_ms"] > 0
    assert 1 <= meta["window_last"] <= 6 and 1 <= meta["window_mean"] <= 6


@pytest.mark.parametrize("limit", [2, 7, 10])
def test_max_new_tokens_inside_an_accepted_block(pair, limit):
    target, _, video = pair
    tokens = run_sd(sd_nodes(target, dict(target), window=4, prime=2, max_new_tokens=limit), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, limit)


def test_judge_ahead_leaves_the_target_no_token_after_a_round_accepted_whole(pair):
    """judge_ahead at temperature 1 with the target as its own draft (every token accepted): no
    round commits a token of the target's own, each next round's first token is judged by the
    rule instead, so every round commits exactly what it drafted and nothing goes stale."""
    target, _, video = pair
    tokens = run_sd(sd_nodes(target, dict(target), window=3, prime=2, temperature=1.0, judge_ahead=True,
                             max_new_tokens=20), video)
    stats = tokens.speculative
    assert len(tokens.ids) == 20 and stats.stale_proposals == 0
    assert tokens.meta["judged_ahead"] == stats.rounds - 1        # all but the last, cut at the budget
    assert sum(stats.accepted) == 20 and stats.accepted == stats.drafted


@pytest.mark.slow
@pytest.mark.parametrize("prime, judge_ahead, first_from_prefill", [(1, False, False), (1, False, True), (2, True, True)])
def test_sampled_first_tokens_follow_the_target_distribution(pair, prime, judge_ahead, first_from_prefill):
    """Over 200 seeds, the first two tokens of speculative sampling (temperature 1) are distributed
    as the target's own sampling's (chi-square on the most common values); also as the parallelvlm
    graph runs it: the first token drawn from the prefill before any round, the draft running
    ahead, pre-verify rounds after rollbacks, and the round in flight judged by the rule (judge_ahead)."""
    from collections import Counter

    from tests.stages.test_generate import ar_nodes, run_graph

    target, draft, video = pair
    sd, ar = Counter(), Counter()
    for seed in range(200):
        nodes = sd_nodes(target, draft, window=1 if judge_ahead else 3, prime=prime, max_new_tokens=2,
                         temperature=1.0, seed=seed, judge_ahead=judge_ahead, pre_verify=judge_ahead,
                         first_from_prefill=first_from_prefill)
        sd[tuple(run_sd(nodes, video).ids)] += 1
        out = run_graph(ar_nodes(target, max_new_tokens=2, temperature=1.0, seed=seed), Request("v", video, PROMPT))
        ar[tuple(out.outputs["generate.tokens"].ids)] += 1
    keys = [k for k, _ in (sd + ar).most_common(6)]
    stat = sum((sd[k] - ar[k]) ** 2 / (sd[k] + ar[k]) for k in keys)     # two-sample chi-square, 5 df
    assert stat < 20.52


@pytest.mark.parametrize("alpha, variant, window", [(0.7, "as_written", 3), (0.95, "absolute", 5), (0.0, "as_written", 2)])
def test_parallelvlm_with_uv_prune_is_token_identical_to_generate(pair, alpha, variant, window):
    """The draft prefills only the UV-Prune selection (from the target's prefill tap) and drafts a
    round ahead: still the target's own greedy tokens."""
    target, draft, video = pair
    tokens = run_sd(parallelvlm_nodes(target, draft, alpha=alpha, variant=variant, window=window), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)


def test_uv_prune_selection_reaches_the_draft_prefill(pair):
    """The draft's cache holds the prompt's text and exactly the selected ⌈(1 − α)·m⌉ video tokens."""
    target, draft, video = pair
    nodes = parallelvlm_nodes(target, draft, alpha=0.8)
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False, record=("draft_prefill.kv", "prune.selection")) as ex:
        out = ex.run(Request("v", video, PROMPT)).outputs
    kv, selection = out["draft_prefill.kv"], out["prune.selection"]
    layout = kv.layout
    assert selection.total == layout.n_video and len(selection.keep) == -(-layout.n_video * 2 // 10)
    text = layout.length - layout.n_video
    # (the recorded cache has grown by the drafted tokens since; its prefill stats were taken at the end of prefill)
    stats = kv.prefill
    assert stats["video_tokens_kept"] == len(selection.keep) and kv.logical_length == layout.length
    per_token = 2 * 2 * 1 * 64 * 4          # keys and values x 2 layers x 1 KV head x head_dim 64 x fp32 (the zoo's drafts)
    assert stats["kv_bytes"] == (text + len(selection.keep)) * per_token


def test_specvlm_attention_guided_draft_is_token_identical_to_generate(pair):
    """The target prefills the question separately (eager, publishing its attention): the same
    cache and logits, so the same tokens; the draft sees the attention-guided selection."""
    target, draft, video = pair
    tokens = run_sd(parallelvlm_nodes(target, draft, alpha=0.8, attention=True, window=3), video)
    assert tokens.ids == reference_ids(target, video, PROMPT, 24)


def test_a_draft_with_another_tokenizer_is_refused_at_setup(pair, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from models.load import ModelError
    from stages.draft import ModelDraft

    target, draft, _ = pair
    other = tmp_path / "other-draft"
    shutil.copytree(draft["path"], other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["zebra"])
    tokenizer.save_pretrained(other)

    class Ctx:
        device, item, node = "cpu", 0, "draft"

    with pytest.raises(ModelError, match="different tokenizers.*zebra"):
        ModelDraft({**draft, "path": str(other)}, target=target).setup(Ctx())
    ModelDraft(draft, target=target).setup(Ctx())          # the pair's own draft passes
