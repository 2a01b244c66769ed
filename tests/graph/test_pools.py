"""The plan's workers: an elastic worker's threads are the cores the others leave idle."""

from graph.pools import WorkerPools
from tests.helpers import make, node

P = "bench.synthetic"


def test_an_elastic_worker_takes_the_cores_of_idle_workers_and_of_workers_waiting_on_backpressure():
    resources = {"cores": 4, "pools": {"cpu": {"kind": "thread", "workers": 1, "torch_threads": "auto"},
                                       "target": {"kind": "thread", "workers": 1, "torch_threads": "elastic"}}}
    nodes = {"src": node(f"{P}.Producer", items=2, size=8, iters=1),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, size=8, iters=1)}
    spec, plan = make(nodes, resources=resources)
    pools = WorkerPools(plan)        # workers built, never started: nothing to stop
    cpu, target = pools.home("src"), pools.home("sink")
    assert target.elastic is not None and cpu.elastic is None
    assert (cpu.torch_threads, target.torch_threads) == (2, 2)

    assert pools.elastic_threads(target) == 4          # the cpu worker is idle: all cores
    cpu.busy, cpu.running = True, "src"
    assert pools.elastic_threads(target) == 2          # it computes on its 2 threads
    cpu.waiting = True
    assert pools.elastic_threads(target) == 4          # it waits on a full channel: on no core
    assert target.elastic() == 4


def test_a_free_worker_is_one_that_is_not_busy():
    resources = {"cores": 2, "pools": {"cpu": {"kind": "thread", "workers": 2, "torch_threads": 1}}}
    spec, plan = make({"src": node(f"{P}.Producer", items=1, size=8, iters=1)}, resources=resources)
    pools = WorkerPools(plan)
    first, second = pools.pools["cpu"]
    assert pools.home("src") is first and pools.free("src") is first
    first.busy = True
    assert pools.free("src") is second
    second.busy = True
    assert pools.free("src") is None
    assert pools.named("cpu", second.name) is second
