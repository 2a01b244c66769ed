"""Every shipped speculative graph is the reference loop (speculative.reference) spread over
nodes: run as a user runs it (`+experiment=...` composed by Hydra, on the engine), it commits the
same tokens, round by round the same accepted and drafted lengths, and the same stale rounds as the
plain loop run on the same prefills with the same drafter and verifier settings.

The prefills come from the same graph with its draft and verify nodes left out (the engine runs
the rest and keeps the prefill results), so both sides start from the same caches and logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hydra.utils import instantiate

from bench.engine_vs_loop import loop_settings, prefills_only
from graph.executor import Executor
from job.run import prepare
from models.registry import release_all
from speculative.reference import speculative_decode
from stages.source import load_requests
from tests.conf.test_experiments import composed

GRAPHS = ["vanilla_sd", "parallelvlm", "specvlm", "fastv_verified", "sparrow", "quickvideo_sparrow",
          "quickvideo_parallelvlm"]
SHORT = ["data=toy_eval", "data.toy.videos=1", "data.toy.first_seed=240", "data.toy.seconds=12",
         "graph.max_new_tokens=40"]
CPU = SimpleNamespace(device="cpu")


@pytest.fixture(scope="module", autouse=True)
def _release():
    yield
    release_all()


@pytest.mark.parametrize("experiment", GRAPHS)
def test_the_graph_is_the_reference_loop(experiment):
    graph_and_reference_agree(experiment, SHORT)


@pytest.mark.parametrize("experiment", ["vanilla_sd", "parallelvlm", "sparrow"])
def test_sampling_graphs_are_the_reference_loop(experiment):
    """Temperature 1: each side draws from its own seeded generator in the order it consumes its
    inputs, so the graph and the loop draw the same tokens (ParallelVLM with judge_ahead)."""
    graph_and_reference_agree(experiment, [*SHORT, "graph.sampling.temperature=1", "graph.sampling.seed=3"])


def graph_and_reference_agree(experiment: str, overrides: list[str]) -> None:
    cfg = composed([f"+experiment={experiment}", *overrides])
    if "pre_verify" in cfg.graph:
        # `auto` chooses by the times each side measures, which differ between two runs: the rounds
        # compared here would differ by timing alone. Forced on, both sides take every choice alike.
        cfg = composed([f"+experiment={experiment}", *overrides, "graph.pre_verify=true"])
    request = load_requests(cfg.data)[0]
    spec, plan = prepare(cfg, n_cuda=0)
    with Executor(spec, plan, progress=False) as ex:
        tokens = ex.run(request).outputs["verify.tokens"]

    nodes = cfg.graph.nodes
    prefix, prefill_ports = prefills_only(cfg)
    spec, plan = prepare(prefix, n_cuda=0)
    with Executor(spec, plan, progress=False, record=prefill_ports) as ex:
        outputs = ex.run(request).outputs
    target_prefill, draft_prefill = (outputs[port] for port in prefill_ports)

    verifier_stage, draft_stage = instantiate(nodes.verify.stage), instantiate(nodes.draft.stage)
    verifier_stage.setup(CPU)
    draft_stage.setup(CPU)
    target, drafter = verifier_stage.verifier_for(target_prefill), draft_stage.drafter_for(draft_prefill)
    ids = speculative_decode(target, drafter, **loop_settings(nodes))

    reference = target.rounds.stats()
    assert ids == tokens.ids
    assert reference.accepted == tokens.speculative.accepted and reference.drafted == tokens.speculative.drafted
    assert reference.stale_proposals == tokens.speculative.stale_proposals
    assert reference.rounds > 3 and len(ids) > 8          # enough rounds to mean something


def test_a_drafter_that_stops_before_the_answer_is_complete_is_an_error():
    """In a graph this would wait forever; the loop says so instead of returning half an answer."""
    target = SimpleNamespace(done=False, rounds=SimpleNamespace(committed=[5, 6]), verify=None)
    silent = SimpleNamespace(propose=lambda verdict, timer: None)
    with pytest.raises(RuntimeError, match="after 2 committed tokens"):
        speculative_decode(target, silent, ahead=2)
