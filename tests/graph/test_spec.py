"""Validation: every error names the node, the port, both types and the fix."""

import pytest

from graph.resources import load_resources
from graph.schedule import compile_plan
from graph.spec import ConfigError, build_graph
from tests.helpers import make, node

P = "bench.synthetic"


def demo_loop(prime=1, feedback=True):
    verdict = {"from": "check.verdict", "feedback": feedback, "prime": prime} if feedback else "check.verdict"
    return {
        "fwd_in": node(f"{P}.Producer", items=2, iters=0),
        "sink": node(f"{P}.Consumer", "target", {"item": "fwd_in.item"}, iters=0),
        "query": node(f"{P}.LayeredForward", "target", {"state": "sink.summary"}, iters=0),
        "reader": node(f"{P}.TapReader", "draft", {"hidden": "query.hidden"}, iters=0),
        "propose": node(f"{P}.Proposer", "draft", {"selection": "reader.selection", "first": "query.first", "verdict": verdict}, iters=0),
        "check": node(f"{P}.Checker", "target", {"proposal": "propose.proposal"}, rounds=3, iters=0),
    }


def error_of(nodes, resources=None) -> str:
    with pytest.raises(ConfigError) as e:
        make(nodes, resources)
    return str(e.value)


def test_valid_graph_builds_with_topological_order():
    spec, plan = make(demo_loop())
    assert spec.order == ["fwd_in", "sink", "query", "reader", "propose", "check"]
    assert [e for e in spec.edges if e.feedback][0].prime == 1
    assert spec.sinks() == [("check", "tokens")]


def test_unknown_target_suggests_the_close_class():
    nodes = {"a": node(f"{P}.Produser")}
    msg = error_of(nodes)
    assert "node 'a'" in msg and "unknown _target_ 'bench.synthetic.Produser'" in msg
    assert "bench.synthetic.Producer" in msg  # the suggestion


def test_unknown_module():
    msg = error_of({"a": node("stages.nosuch.Thing")})
    assert "node 'a'" in msg and "stages.nosuch.Thing" in msg


def test_target_that_is_not_a_stage():
    msg = error_of({"a": node("collections.OrderedDict")})
    assert "not a stage" in msg


def test_kwargs_that_do_not_bind_the_constructor():
    msg = error_of({"a": node(f"{P}.Producer", itemz=3)})
    assert "node 'a'" in msg and "Producer()" in msg and "'itemz'" in msg
    assert "did you mean 'items'" in msg and "It accepts: items, size, iters, fail_at, seed" in msg


def test_unbound_input_lists_candidates():
    nodes = {"src": node(f"{P}.Producer"), "c": node(f"{P}.Consumer", "target")}
    msg = error_of(nodes)
    assert "node 'c' input 'item' (Payload) is not bound" in msg
    assert "graph.nodes.c.inputs.item=<node>.<port>" in msg and "src.item" in msg


def test_type_mismatch_names_both_types_and_the_fix():
    nodes = demo_loop()
    nodes["query"]["inputs"]["state"] = "check.tokens"  # Tokens into a Payload port
    msg = error_of(nodes)
    assert "node 'query' input 'state' expects Payload but check.tokens gives Tokens" in msg
    assert "Fix: bind it to a port of type Payload" in msg and "sink.summary" in msg


def test_binding_to_missing_node_or_port():
    nodes = demo_loop()
    nodes["sink"]["inputs"]["item"] = "nobody.item"
    assert "no node 'nobody'" in error_of(nodes)
    nodes["sink"]["inputs"]["item"] = "fwd_in.items"
    assert "has no output 'items'" in error_of(nodes)


def test_unknown_input_port():
    nodes = demo_loop()
    nodes["sink"]["inputs"]["extra"] = "fwd_in.item"
    assert "Consumer has no input 'extra'" in error_of(nodes)


def test_unmarked_cycle_names_the_loop_and_the_fix():
    msg = error_of(demo_loop(feedback=False))
    assert "cycle" in msg and "not marked as feedback" in msg
    assert "propose" in msg and "check" in msg
    assert "feedback: true" in msg


def test_feedback_needs_a_primed_item():
    msg = error_of(demo_loop(prime=0))
    assert "prime=0" in msg and "prime=1" in msg


def test_after_names_another_node_and_closes_no_loop():
    nodes = demo_loop()
    nodes["reader"]["after"] = ["nosuch"]
    assert "node 'reader': after: 'nosuch' is not another node" in error_of(nodes)
    nodes["reader"]["after"] = ["reader"]
    assert "after: 'reader' is not another node" in error_of(nodes)
    nodes["reader"]["after"] = ["check"]           # check needs reader's selection (through propose)
    msg = error_of(nodes)
    assert "node 'reader' waits (after:) for 'check', which needs it first (reader -> propose -> check)" in msg
    nodes["reader"]["after"] = []
    nodes["check"]["after"] = ["propose"]          # propose waits for check's verdicts: a feedback loop
    msg = error_of(nodes)
    assert "node 'check' waits (after:) for 'propose', which needs it first (check -> propose)" in msg
    nodes["check"]["after"] = []
    nodes["reader"]["after"] = 3
    assert "node 'reader': after: 3 is not a node name or a list of them" in error_of(nodes)
    nodes["reader"]["after"] = "sink"              # one name without a list is fine
    spec, _ = make(nodes)
    assert spec.nodes["reader"].after == ("sink",)


def test_a_run_constant_input_cannot_be_primed():
    nodes = {"a": node(f"{P}.Producer", items=1, iters=0),
             "b": node("tests.helpers.NeedsPayload", "target", {"value": {"from": "a.item", "prime": 1}})}
    assert "is a run constant" in error_of(nodes)


def test_feedback_that_closes_no_loop():
    nodes = {
        "src": node(f"{P}.Producer"),
        "c": node(f"{P}.Consumer", "target", {"item": {"from": "src.item", "feedback": True}}),
    }
    assert "closes no loop" in error_of(nodes)


def test_unknown_resource_suggests_and_lists_declared():
    nodes = {"a": node(f"{P}.Producer", on="targett")}
    msg = error_of(nodes)
    assert "unknown resource 'targett'" in msg and "Did you mean 'target'" in msg
    assert "cpu, decode, target, draft" in msg


def test_gpu_placement_under_strict_without_cuda():
    resources = {"strict": True, "pools": {"cpu": {"kind": "thread"}}, "streams": {"target": {"device": "cuda:0"}}}
    res, cores, strict = load_resources(resources, n_cuda=0)
    spec = build_graph({"nodes": {"a": node(f"{P}.Producer", on="target")}}, res)
    with pytest.raises(ConfigError) as e:
        compile_plan(spec, res, cores, strict=strict)
    assert "node 'a' is on GPU resource 'target' (cuda:0)" in str(e.value) and "resources=cpu" in str(e.value)


def test_a_process_pool_on_a_gpu_or_in_its_stead_on_the_cpu():
    """A process pool may work on a CUDA device (a process of its own, its own CUDA context); where
    the machine lacks it, it runs on the CPU as a stream does, and strict makes that an error."""
    resources = {"pools": {"cpu": {"kind": "thread"}, "draft": {"kind": "process", "device": "cuda:1"}}}
    res, _, _ = load_resources(resources, n_cuda=2)
    assert res["draft"].device == "cuda:1" and res["draft"].kind == "process" and res["draft"].is_gpu
    res, cores, _ = load_resources(resources, n_cuda=1)
    draft = res["draft"]
    assert (draft.device, draft.kind, draft.fallback_from, draft.is_gpu) == ("cpu", "process", "cuda:1", False)
    assert "no cuda:1" in draft.note
    spec = build_graph({"nodes": {"a": node(f"{P}.Producer", on="draft")}}, res)
    compile_plan(spec, res, cores)
    with pytest.raises(ConfigError, match="GPU resource 'draft' \\(cuda:1\\)"):
        compile_plan(spec, res, cores, strict=True)
    unnumbered = {"pools": {"d": {"kind": "process", "device": "cuda"}}, "streams": {"t": {"device": "cuda"}}}
    plain = load_resources(unnumbered, n_cuda=1)[0]
    assert plain["d"].device == plain["t"].device == "cuda:0"          # numbered, as set_device needs
    with pytest.raises(ConfigError, match="device=cuda:0 on a thread pool.*streams.cpu.device"):
        load_resources({"pools": {"cpu": {"kind": "thread", "device": "cuda:0"}}}, n_cuda=1)
    with pytest.raises(ConfigError, match="device=tpu on a process pool"):
        load_resources({"pools": {"cpu": {"kind": "process", "device": "tpu"}}}, n_cuda=1)


def test_cpu_stage_on_a_real_gpu_stream_is_rejected():
    resources = {"pools": {"cpu": {"kind": "thread"}}, "streams": {"target": {"device": "cuda:0"}}}
    res, cores, strict = load_resources(resources, n_cuda=1)
    spec = build_graph({"nodes": {"a": node("stages.source.Source", on="target")}}, res)
    with pytest.raises(ConfigError, match="placement cpu.*GPU resource 'target'"):
        compile_plan(spec, res, cores)


def test_all_problems_reported_together():
    nodes = {"a": node(f"{P}.Produser"), "b": node(f"{P}.Consumer", on="nowhere")}
    e = pytest.raises(ConfigError, make, nodes).value
    assert len(e.problems) >= 3  # unknown target, unknown resource, unbound input


def test_stage_preset_by_name():
    spec, _ = make({"a": {"stage": "producer", "on": "cpu"}})
    assert spec.nodes["a"].stage_cls.__name__ == "Producer"
    msg = error_of({"a": {"stage": "prodcer", "on": "cpu"}})
    assert "unknown stage preset 'prodcer'" in msg and "producer" in msg


def test_yaml_on_read_as_boolean_is_accepted():
    spec, _ = make({"a": {"stage": {"_target_": f"{P}.Producer"}, True: "cpu"}})
    assert spec.nodes["a"].on == "cpu"


def test_removed_node_is_skipped():
    nodes = demo_loop()
    nodes["extra"] = None
    spec, _ = make(nodes)
    assert "extra" not in spec.nodes
