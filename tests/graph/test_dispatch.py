"""One request's run is an object of its own: the executor keeps nothing of it between runs."""

from graph.executor import Executor
from stages.types import Request
from tests.helpers import make, node

P = "bench.synthetic"


def test_a_run_leaves_no_state_on_the_executor_and_numbers_its_own_calls(no_leftovers):
    nodes = {"src": node(f"{P}.Producer", items=3, size=8, iters=1),
             "sink": node(f"{P}.Consumer", "target", {"item": "src.item"}, size=8, iters=1)}
    spec, plan = make(nodes)
    with Executor(spec, plan, progress=False) as ex:
        before = set(vars(ex))
        first = ex.run(Request())
        after_first = set(vars(ex))
        second = ex.run(Request())
    assert after_first == before, f"a run left {sorted(after_first - before)} on the executor"
    for result in (first, second):
        assert [c.id for c in result.calls] == list(range(len(result.calls)))
    assert sorted((c.node, c.phase, c.item) for c in second.calls) == sorted((c.node, c.phase, c.item) for c in first.calls)
    assert first.outputs.keys() == second.outputs.keys() and first.outputs
