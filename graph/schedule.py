"""Compile a validated graph onto resources: a plan that is plain data.

Policy, decided here once so the executor only follows it:
- every node runs on the resource its config names; calls of one node never overlap;
- torch threads: a pool with `torch_threads: auto` gets (cores − processes the stages declare) //
  (workers of all CPU resources the graph uses), at least 1, so concurrent torch workers never
  oversubscribe the cores, not even beside QuickCodec's decoder processes; `elastic`
  starts from the same share and, at each call, takes every core the other CPU workers leave idle
  (QuickVideo: the target prefills on one core while the decoders run, on all once they are done);
- channels hold `capacity` items; a streamed edge between two nodes sharing a one-worker resource is
  unbounded (the producer holds the only worker, so a bound would deadlock it); a primed edge
  holds at least its primed items; an edge into a node that waits (`after:`) for its producer, or
  for a node its producer feeds, is unbounded (its items wait until the node may start; a bound
  would stop the producer the node waits for), and so is such an edge into anything downstream of
  a waiting node; the sequential runner makes every channel unbounded (a producer that shares a
  one-worker pool with a waiting node's upstream can still block: the executor reports it);
- process-pool nodes are pinned to one worker process each (their stage lives there), round-robin.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from graph.resources import Resource, strict_gpu_problems
from graph.spec import ConfigError, GraphSpec

log = logging.getLogger(__name__)
RUNNERS = ("threaded", "sequential")


@dataclass(frozen=True)
class PlannedResource:
    name: str
    kind: str
    workers: int
    torch_threads: int
    device: str
    priority: int
    note: str = ""
    elastic: bool = False        # torch_threads: elastic (see the module doc)
    affinity: tuple[int, ...] | None = None   # the cores its workers are pinned to


@dataclass(frozen=True)
class PlannedNode:
    name: str
    stage: str            # dotted class path
    resource: str
    worker: int | None    # pinned worker (process pools), else None = any free worker
    calls: str            # "once" or "per <port>[, <port>]"
    rank: int             # topological rank: earlier = upstream
    processes: int = 0    # processes the stage itself starts (Stage.declared_processes)
    after: tuple[str, ...] = ()   # nodes that must have finished before its first call


@dataclass(frozen=True)
class PlannedChannel:
    edge: str
    src: str
    src_port: str
    dst: str
    dst_port: str
    capacity: int | None  # None = unbounded
    prime: int
    feedback: bool
    note: str = ""


@dataclass(frozen=True)
class Plan:
    runner: str
    cores: int
    resources: list[PlannedResource]
    nodes: list[PlannedNode]
    channels: list[PlannedChannel]
    warnings: list[str] = field(default_factory=list)

    def resource(self, name: str) -> PlannedResource:
        return next(r for r in self.resources if r.name == name)

    def node(self, name: str) -> PlannedNode:
        return next(n for n in self.nodes if n.name == name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        lines = [f"runner: {self.runner}   cores: {self.cores}", "", "resources:"]
        for r in self.resources:
            where = r.device if r.kind == "stream" else f"torch_threads={r.torch_threads}" + ("+elastic" if r.elastic else "")
            where += f"   {r.device}" if r.kind == "process" and r.device != "cpu" else ""
            where += f"   cores {','.join(map(str, r.affinity))}" if r.affinity else ""
            lines.append(f"  {r.name:<10} {r.kind:<8} workers={r.workers:<3} {where}"
                         + (f"   # {r.note}" if r.note else ""))
        lines += ["", "nodes (topological order):"]
        for n in self.nodes:
            pin = f"[{n.worker}]" if n.worker is not None else ""
            own = f"   # starts {n.processes} processes" if n.processes else ""
            own += f"   # after {', '.join(n.after)}" if n.after else ""
            lines.append(f"  {n.name:<12} on {n.resource + pin:<12} {n.calls:<22} {n.stage}{own}")
        lines += ["", "channels:"]
        for c in self.channels:
            cap = "unbounded" if c.capacity is None else f"capacity {c.capacity}"
            extra = f", prime {c.prime}" if c.prime else ""
            lines.append(f"  {c.edge:<44} {cap}{extra}" + (f"   # {c.note}" if c.note else ""))
        if self.warnings:
            lines += ["", "warnings:"] + [f"  {w}" for w in self.warnings]
        return "\n".join(lines) + "\n"


def _waited_on(spec: GraphSpec) -> dict[str, set[str]]:
    """node -> the producers whose items into it may have to wait for a node that waits
    (`after:`): for the waiting node and everything downstream of it, the nodes it waits for and
    everything upstream of them (a bound on such an edge could stop a producer that the waiting
    node needs finished)."""
    import networkx as nx

    dag = nx.DiGraph()
    dag.add_nodes_from(spec.nodes)
    dag.add_edges_from((e.src, e.dst) for e in spec.edges if not e.feedback)
    out: dict[str, set[str]] = {name: set() for name in spec.nodes}
    for name, node in spec.nodes.items():
        if node.after:
            waited = set().union(*({a} | nx.ancestors(dag, a) for a in node.after))
            for held in {name} | nx.descendants(dag, name):
                out[held] |= waited
    return out


def declared_processes(node) -> int:
    """The processes a node's stage starts, from its validated constructor arguments (the
    signature's defaults filling what the config leaves out)."""
    import inspect

    kwargs = {k: v for k, v in node.stage_cfg.items() if k != "_target_"}
    try:
        bound = inspect.signature(node.stage_cls).bind_partial(**kwargs)
        bound.apply_defaults()
        kwargs = dict(bound.arguments)
    except (TypeError, ValueError):     # validation has reported any mismatch already
        pass
    return int(node.stage_cls.declared_processes(kwargs)) if hasattr(node.stage_cls, "declared_processes") else 0


def compile_plan(
    spec: GraphSpec,
    resources: dict[str, Resource],
    cores: int,
    *,
    strict: bool = False,
    runner: str = "threaded",
    capacity: int = 2,
) -> Plan:
    if runner not in RUNNERS:
        raise ConfigError(f"unknown runner '{runner}'. Fix: executor.runner={' or '.join(RUNNERS)}")
    if capacity < 1:
        raise ConfigError(f"executor.capacity={capacity}; channels need room for one item. Fix: executor.capacity=2")
    placements = {n.name: n.on for n in spec.nodes.values()}
    problems = []
    for name, node in spec.nodes.items():
        res = resources[node.on]
        if res.is_gpu and node.stage_cls.placement == "cpu":
            cpu_pools = [r.name for r in resources.values() if not r.is_gpu]
            problems.append(
                f"node '{name}' ({node.stage_cls.__name__}, placement cpu) is on GPU resource '{node.on}'. "
                f"Fix: graph.nodes.{name}.on=<a CPU pool: {', '.join(cpu_pools) or 'declare one'}>"
            )
    if strict:
        problems += strict_gpu_problems(placements, resources)
    if problems:
        raise ConfigError(problems)

    used = [r for r in resources.values() if r.name in placements.values()]
    cpu_workers = sum(r.workers for r in used if not r.is_gpu)
    processes = {name: declared_processes(node) for name, node in spec.nodes.items()}
    auto_threads = max(1, (cores - sum(processes.values())) // max(1, cpu_workers))
    warnings = []
    planned_res = []
    for r in used:
        threads = auto_threads if r.torch_threads in ("auto", "elastic") else int(r.torch_threads)
        planned_res.append(PlannedResource(r.name, r.kind, r.workers, threads, r.device, r.priority, r.note,
                                           elastic=r.torch_threads == "elastic", affinity=r.affinity))
    demand = sum(r.workers * r.torch_threads for r in planned_res if r.kind != "stream")
    # automatic counts give each worker one thread at least, so more workers than cores share them
    # by design; a count someone set for a thread pool that asks for more than the cores is worth a
    # warning (a process pool's count is its own processes', the decoders' one FFmpeg thread each)
    chosen = any(r.kind == "thread" and r.torch_threads not in ("auto", "elastic") for r in used)
    if runner == "threaded" and demand > cores and chosen:
        warnings.append(f"{cpu_workers} CPU workers with {demand} torch threads in all on {cores} cores: "
                        "workers that run at the same time share cores")

    rank = {n: i for i, n in enumerate(spec.order)}
    pins: dict[str, int] = {}
    nodes = []
    for name in spec.order:
        node = spec.nodes[name]
        res = resources[node.on]
        worker = None
        if res.kind == "process":
            worker = pins[node.on] = (pins.get(node.on, -1) + 1) % res.workers
        streamed = node.stream_inputs
        calls = f"per {', '.join(streamed)}" if streamed else "once"
        cls = node.stage_cls
        nodes.append(PlannedNode(name, f"{cls.__module__}.{cls.__qualname__}", node.on, worker, calls, rank[name],
                                 processes[name], tuple(node.after)))

    problems = resident_problems(spec, resources, {n.name: n.worker for n in nodes})
    if problems:
        raise ConfigError(problems)
    waited_on = _waited_on(spec)
    channels = []
    for e in spec.edges:
        src_node, dst_node = spec.nodes[e.src], spec.nodes[e.dst]
        out = src_node.out_ports[e.src_port]
        cap: int | None = int(e.capacity) if e.capacity is not None else capacity
        note = ""
        same = src_node.on == dst_node.on and resources[src_node.on].workers == 1
        if runner == "sequential":
            cap, note = None, "sequential runner"
        elif same and out.stream and not e.feedback:
            cap, note = None, f"both on one-worker '{src_node.on}': cannot overlap"
        elif e.src in waited_on[e.dst] and e.capacity is None:
            cap, note = None, f"{e.dst} waits for {', '.join(dst_node.after) or 'a node upstream'} to finish"
        if cap is not None and cap < e.prime:
            cap = e.prime
        channels.append(PlannedChannel(str(e), e.src, e.src_port, e.dst, e.dst_port, cap,
                                       e.prime, e.feedback, note))
    for w in warnings:
        log.warning(w)
    return Plan(runner, cores, planned_res, nodes, channels, warnings)


def resident_problems(spec: GraphSpec, resources: dict[str, Resource], pinned: dict[str, int | None]) -> list[str]:
    """A resident output (Out(resident=True)) made in a process pool never leaves its process: every
    consumer must be pinned to the same process worker."""
    problems = []
    for e in spec.edges:
        src, dst = spec.nodes[e.src], spec.nodes[e.dst]
        if not src.out_ports[e.src_port].resident or resources[src.on].kind != "process":
            continue
        if dst.on != src.on or pinned.get(e.dst) != pinned.get(e.src):
            problems.append(f"{e.src}.{e.src_port} stays in the process of '{src.on}' worker {pinned.get(e.src)} "
                            f"(a resident output), but {e.dst} runs on '{dst.on}'"
                            + (f" worker {pinned.get(e.dst)}" if dst.on == src.on else "")
                            + f". Fix: graph.nodes.{e.dst}.on={src.on}, with resources.pools.{src.on}.workers=1")
    return problems
