"""The plan's workers: one pool per resource, built from the plan, and where a node's calls go.

A node's stage lives on its *home* worker (the worker its process-pool node is pinned to, or its
resource's first worker); any worker of a thread pool may run its calls, since the pool's workers
share the stage object. The sequential runner gives each resource one inline worker, all of them
on one shared thread, so nothing overlaps while trace rows and devices stay per resource.
"""

from __future__ import annotations

from typing import Iterator

from graph.schedule import Plan
from graph.workers import InlineWorker, ProcessWorker, SequentialThread, StreamWorker, ThreadWorker, Worker


class WorkerPools:
    def __init__(self, plan: Plan):
        self.plan = plan
        self._processes = {n.name: n.processes for n in plan.nodes}   # processes each node's stage starts
        self.pools: dict[str, list[Worker]] = {}
        self.pins: dict[str, Worker] = {}
        sequential = plan.runner == "sequential"
        thread = SequentialThread(plan.cores) if sequential else None
        for r in plan.resources:
            if sequential:
                self.pools[r.name] = [InlineWorker(f"{r.name}", plan.cores, r.device, thread)]
                continue
            made: list[Worker] = []
            for i in range(r.workers):
                name = f"{r.name}[{i}]" if r.workers > 1 else r.name
                if r.kind == "process":
                    made.append(ProcessWorker(name, r.torch_threads, r.device, affinity=r.affinity))
                elif r.kind == "stream":
                    made.append(StreamWorker(name, r.torch_threads, r.device, r.priority))
                else:
                    worker = ThreadWorker(name, r.torch_threads, r.device, affinity=r.affinity)
                    if r.elastic:
                        worker.elastic = lambda me=worker: self.elastic_threads(me)
                    made.append(worker)
            self.pools[r.name] = made
        for n in plan.nodes:
            if n.worker is not None and not sequential:
                self.pins[n.name] = self.pools[n.resource][n.worker]

    def __iter__(self) -> Iterator[Worker]:
        for pool in self.pools.values():
            yield from pool

    def home(self, node: str) -> Worker:
        """The worker that builds, sets up and closes the node's stage."""
        return self.pins.get(node) or self.pools[self.plan.node(node).resource][0]

    def free(self, node: str) -> Worker | None:
        """A worker that may start the node's next call now, if any."""
        pinned = self.pins.get(node)
        if pinned is not None:
            return None if pinned.busy else pinned
        return next((w for w in self.pools[self.plan.node(node).resource] if not w.busy), None)

    def named(self, resource: str, name: str) -> Worker:
        return next(w for w in self.pools[resource] if w.name == name)

    def elastic_threads(self, me: Worker) -> int:
        """An elastic worker's torch threads for its next call: the cores no other CPU worker is
        busy on (each busy one counted at its planned threads; one whose call waits on a full
        channel is not busy), never fewer than its planned share."""
        taken = sum(max(w.torch_threads, self._processes.get(w.running, 0)) for w in self
                    if w is not me and w.busy and not w.waiting and not str(w.device).startswith("cuda"))
        return max(me.torch_threads, self.plan.cores - taken)
