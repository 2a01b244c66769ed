"""The compiled plan is plain data; its text form is compared with checked-in snapshots.

Regenerate a snapshot after an intended change with: REELFLOW_UPDATE_SNAPSHOTS=1 pytest tests/graph/test_schedule.py
"""

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from graph.resources import load_resources
from graph.schedule import compile_plan
from graph.spec import ConfigError, build_graph
from tests.helpers import make, node

CONF = Path(__file__).resolve().parents[2] / "conf"
SNAPSHOTS = Path(__file__).parent / "snapshots"


def plan_for(graph: str, resources: str, n_cuda: int, **kw):
    res_cfg = OmegaConf.to_container(OmegaConf.load(CONF / "resources" / f"{resources}.yaml"))
    res_cfg["cores"] = 2  # snapshots must not depend on the machine
    res, cores, strict = load_resources(res_cfg, n_cuda=n_cuda)
    spec = build_graph(OmegaConf.load(CONF / "graph" / f"{graph}.yaml"), res)
    return compile_plan(spec, res, cores, strict=strict, **kw)


def check_snapshot(name: str, text: str):
    path = SNAPSHOTS / f"{name}.txt"
    if os.environ.get("REELFLOW_UPDATE_SNAPSHOTS"):
        path.write_text(text)
    assert path.exists(), f"no snapshot {path}; create it with REELFLOW_UPDATE_SNAPSHOTS=1"
    assert text == path.read_text(), f"plan differs from {path}; if intended, regenerate (see module docstring)"


@pytest.mark.parametrize("graph,resources,n_cuda,runner", [
    ("demo", "cpu", 0, "threaded"),
    ("demo", "cpu", 0, "sequential"),
    ("demo", "gpu", 0, "threaded"),    # no CUDA: streams fall back to CPU workers
    ("demo", "gpu", 1, "threaded"),
    ("demo", "gpu2", 2, "threaded"),
    ("chain", "cpu", 0, "threaded"),
])
def test_plan_snapshot(graph, resources, n_cuda, runner):
    plan = plan_for(graph, resources, n_cuda, runner=runner)
    check_snapshot(f"{graph}_{resources}_cuda{n_cuda}_{runner}", plan.to_text())


def test_plan_is_plain_data():
    plan = plan_for("demo", "cpu", 0)
    d = plan.to_dict()
    assert d["runner"] == "threaded" and d["cores"] == 2
    assert {r["name"] for r in d["resources"]} == {"cpu", "target", "draft"}  # only the used ones
    feedback = [c for c in d["channels"] if c["feedback"]]
    assert feedback == [dict(feedback[0], prime=2, capacity=2)]


def test_auto_torch_threads_split_cores_between_concurrent_workers():
    one = make({"a": node("bench.synthetic.Producer", "target")})[1]
    assert one.resource("target").torch_threads == 2  # alone on 2 cores: both
    two = make({"a": node("bench.synthetic.Producer", "cpu"),
                "b": node("bench.synthetic.Consumer", "target", {"item": "a.item"})})[1]
    assert two.resource("cpu").torch_threads == 1 and two.resource("target").torch_threads == 1
    assert not two.warnings


def test_workers_beyond_the_cores_warn_only_where_a_thread_count_was_set():
    nodes = {"a": node("bench.synthetic.Producer", "cpu"),
             "b": node("bench.synthetic.Consumer", "target", {"item": "a.item"}),
             "c": node("bench.synthetic.Consumer", "draft", {"item": "a.item"})}
    pools = {"cpu": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
             "target": {"kind": "thread", "workers": 1, "torch_threads": "elastic"},
             "draft": {"kind": "thread", "workers": 1, "torch_threads": "auto"}}
    automatic = make(nodes, {"cores": 2, "pools": pools})[1]
    assert [r.torch_threads for r in automatic.resources] == [1, 1, 1] and not automatic.warnings
    pools["draft"]["torch_threads"] = 2                     # asked for: 4 threads on 2 cores
    chosen = make(nodes, {"cores": 2, "pools": pools})[1]
    assert chosen.warnings == ["3 CPU workers with 4 torch threads in all on 2 cores: workers that run at the "
                               "same time share cores"]


def test_gpu_streams_get_devices_and_priorities():
    plan = plan_for("demo", "gpu", 1)
    target, draft = plan.resource("target"), plan.resource("draft")
    assert (target.kind, target.device, draft.device, draft.priority) == ("stream", "cuda:0", "cuda:0", -1)


def test_stream_between_nodes_on_one_worker_is_unbounded():
    _, plan = make({"a": node("bench.synthetic.Producer", "target"),
                    "b": node("bench.synthetic.Consumer", "target", {"item": "a.item"})})
    assert plan.channels[0].capacity is None and "cannot overlap" in plan.channels[0].note


def test_process_pool_nodes_are_pinned_round_robin():
    _, plan = make({"a": node("bench.synthetic.Producer", "decode"),
                    "b": node("bench.synthetic.Consumer", "decode", {"item": "a.item"}),
                    "c": node("bench.synthetic.LayeredForward", "decode", {"state": "b.summary"})})
    assert [n.worker for n in plan.nodes] == [0, 1, 0]


def test_bad_runner_and_capacity():
    res, cores, _ = load_resources({"pools": {"cpu": {}}}, n_cuda=0)
    spec = build_graph({"nodes": {"a": node("bench.synthetic.Producer")}}, res)
    with pytest.raises(ConfigError, match="unknown runner"):
        compile_plan(spec, res, cores, runner="parallel")
    with pytest.raises(ConfigError, match="capacity=0"):
        compile_plan(spec, res, cores, capacity=0)


def test_bad_resources_config():
    with pytest.raises(ConfigError, match="kind 'fiber'"):
        load_resources({"pools": {"cpu": {"kind": "fiber"}}})
    with pytest.raises(ConfigError, match="workers=0"):
        load_resources({"pools": {"cpu": {"workers": 0}}})


def test_processes_a_stage_declares_leave_their_cores_to_it():
    """QuickCodec's decoder processes each keep a core busy: torch's automatic share is what is
    left (on 16 cores with 12 decoders, a lone target stream would otherwise get 16 threads)."""
    from tests.helpers import make, node

    gpu_like = {"cores": 16, "pools": {"cpu": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
                                       "target": {"kind": "thread", "workers": 1, "torch_threads": "auto"}}}
    nodes = {"source": node("stages.source.Source", "cpu"),
             "decode": node("stages.decode.QuickCodec", "cpu", {"request": "source.request"}, workers=12)}
    _, plan = make(nodes, gpu_like)
    assert plan.node("decode").processes == 12
    assert plan.resource("cpu").torch_threads == (16 - 12) // 1
    assert "starts 12 processes" in plan.to_text()
    nodes["decode"]["stage"].pop("workers")          # the constructor's default counts too
    _, plan = make(nodes, gpu_like)
    assert plan.node("decode").processes == 2 and plan.resource("cpu").torch_threads == 14
