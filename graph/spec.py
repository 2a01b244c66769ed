"""Turn a `graph:` config into a validated GraphSpec, before anything heavy is built.

A graph config is a dict of nodes::

    nodes:
      decode:
        stage: {_target_: stages.decode.QuickCodec, workers: 2}   # or a preset name: quickcodec
        on: cpu
      prefill:
        stage: {_target_: stages.prefill.GroupPrefill}
        inputs: {group: decode.group}                             # port: node.port
        on: target
      draft:
        inputs:
          verdict: {from: verify.verdict, feedback: true, prime: 1}
      draft_encode:
        after: [decode]         # starts no call before decode has finished (its items wait)

Everything here is checked without instantiating a stage: the class is imported and its
constructor signature is bound to the config's kwargs. All problems are reported together, each
naming the node, the port, the types and a fix. `build_graph` is three steps: `parse_nodes`
(the config -> a NodeSpec per node: its stage class, resource and waits), `bind_inputs` (the
inputs -> typed edges) and `check_flow` (cycles, feedback edges, waits -> the topological order).
"""

from __future__ import annotations

import difflib
import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import networkx as nx

from graph.stage import In, Out
from graph.stage_lookup import plain_data, resolve_stage_cfg, stage_class

log = logging.getLogger(__name__)


class ConfigError(Exception):
    """A config problem a user can fix; its message is all they need to read."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        head = "invalid config" if len(self.problems) == 1 else f"invalid config ({len(self.problems)} problems)"
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class Edge:
    src: str            # producer node
    src_port: str
    dst: str            # consumer node
    dst_port: str
    feedback: bool = False
    prime: int = 0      # empty items (delivered as None) put on a streamed edge before the run starts
    capacity: int | None = None  # per-edge override of the channel bound

    def __str__(self) -> str:
        return f"{self.src}.{self.src_port} -> {self.dst}.{self.dst_port}" + (" (feedback)" if self.feedback else "")


@dataclass
class NodeSpec:
    name: str
    stage_cls: type
    stage_cfg: dict          # the `_target_` block with kwargs, plain data
    on: str
    inputs: dict[str, Edge] = field(default_factory=dict)
    after: tuple[str, ...] = ()   # nodes that must have finished before this one's first call

    @property
    def in_ports(self) -> dict[str, In]:
        return dict(self.stage_cls.inputs)

    @property
    def out_ports(self) -> dict[str, Out]:
        return dict(self.stage_cls.outputs)

    @property
    def stream_inputs(self) -> list[str]:
        return [p for p, port in self.in_ports.items() if port.stream]


@dataclass
class GraphSpec:
    nodes: dict[str, NodeSpec]
    edges: list[Edge]
    order: list[str]                          # topological order, feedback edges removed
    consumers: dict[tuple[str, str], list[Edge]]  # (node, out port) -> edges leaving it

    def sinks(self) -> list[tuple[str, str]]:
        """Output ports nobody consumes: their items are the run's results."""
        return [
            (n.name, p) for n in self.nodes.values() for p in n.out_ports if not self.consumers.get((n.name, p))
        ]


def build_graph(graph_cfg: Any, resources: Mapping[str, Any] | None = None) -> GraphSpec:
    """Validate a graph config (and, if given, its resource names) and return the spec."""
    problems: list[str] = []
    nodes, raw_inputs = parse_nodes(graph_cfg, resources, problems)
    edges = bind_inputs(nodes, raw_inputs, problems)
    if problems:
        raise ConfigError(problems)
    return check_flow(nodes, edges)


# --------------------------------------------------------------------------------------------
# parsing: the config -> node specs


def parse_nodes(graph_cfg: Any, resources: Mapping[str, Any] | None,
                problems: list[str]) -> tuple[dict[str, NodeSpec], dict[str, dict]]:
    """Every node the config declares -> its NodeSpec (a node whose stage cannot be resolved is
    left out, its problem noted), and each node's raw `inputs:`, for binding."""
    graph_cfg = plain_data(graph_cfg) or {}
    raw_nodes = graph_cfg.get("nodes") if isinstance(graph_cfg, Mapping) else None
    if not raw_nodes or not isinstance(raw_nodes, Mapping):
        raise ConfigError("the graph has no `nodes:` dict. Fix: choose a graph (graph=demo) or define graph.nodes.")

    nodes: dict[str, NodeSpec] = {}
    raw_inputs: dict[str, dict] = {}
    for name, raw in raw_nodes.items():
        if raw is None:
            continue  # `~graph.nodes.x` or `graph.nodes.x=null` removes a node
        parsed = _parse_node(name, raw, resources, problems)
        if parsed is not None:
            nodes[name], raw_inputs[name] = parsed

    for name, node in nodes.items():
        for other in node.after:
            if other == name or other not in raw_nodes or raw_nodes[other] is None:
                problems.append(f"node '{name}': after: '{other}' is not another node of this graph. "
                                f"Nodes: {', '.join(n for n in nodes if n != name)}.")
    return nodes, raw_inputs


def _parse_node(name: str, raw: Any, resources: Mapping[str, Any] | None,
                problems: list[str]) -> tuple[NodeSpec, dict] | None:
    if not isinstance(raw, Mapping):
        problems.append(f"node '{name}': expected a dict with stage/inputs/on, got {raw!r}")
        return None
    if True in raw and "on" not in raw:
        # YAML 1.1 reads a bare `on:` key as the boolean true; accept it, but only a quoted
        # "on": can be overridden from the command line.
        raw = {("on" if k is True else k): v for k, v in raw.items()}
        log.warning("graph node '%s': write the key as \"on\": (quoted) so graph.nodes.%s.on=... works", name, name)
    unknown_keys = set(raw) - {"stage", "inputs", "on", "after"}
    if unknown_keys:
        problems.append(f"node '{name}': unknown keys {sorted(unknown_keys)}; a node has stage, inputs, on, after.")
    after = raw.get("after") or ()
    after = (after,) if isinstance(after, str) else after
    if not isinstance(after, (list, tuple)):
        problems.append(f"node '{name}': after: {after!r} is not a node name or a list of them. "
                        f"Fix: graph.nodes.{name}.after=[<node>, ...]")
        after = ()
    cfg = resolve_stage_cfg(name, raw.get("stage"), problems)
    cls = stage_class(name, cfg, problems) if cfg else None
    on = raw.get("on")
    if not on:
        problems.append(f"node '{name}': no resource. Fix: graph.nodes.{name}.on=<resource>, e.g. cpu")
    elif resources is not None and on not in resources:
        close = difflib.get_close_matches(str(on), resources, n=1)
        problems.append(
            f"node '{name}': unknown resource '{on}'. Declared by the resources config: "
            f"{', '.join(resources)}." + (f" Did you mean '{close[0]}'?" if close else "")
            + f" Fix: graph.nodes.{name}.on=<one of them>, or declare '{on}' under resources.pools/streams."
        )
    if cls is None:
        return None
    return (NodeSpec(name=name, stage_cls=cls, stage_cfg=cfg, on=str(on), after=tuple(map(str, after))),
            dict(raw.get("inputs") or {}))


# --------------------------------------------------------------------------------------------
# binding: inputs -> typed edges


def bind_inputs(nodes: dict[str, NodeSpec], raw_inputs: dict[str, dict], problems: list[str]) -> list[Edge]:
    """Each node's `inputs:` -> one Edge per input port, checked against the producer's output
    port (it exists, its type fits) and the input's kind (feedback and `prime` on streams only)."""
    edges: list[Edge] = []
    for name, node in nodes.items():
        bound = raw_inputs[name]
        for port in bound:
            if port not in node.in_ports:
                problems.append(
                    f"node '{name}': {node.stage_cls.__name__} has no input '{port}'. "
                    f"Its inputs: {', '.join(node.in_ports) or 'none'}."
                )
        for port, spec_in in node.in_ports.items():
            want = _type_name(spec_in.type)
            if port not in bound or bound[port] is None:
                problems.append(
                    f"node '{name}' input '{port}' ({want}) is not bound. "
                    f"Fix: graph.nodes.{name}.inputs.{port}=<node>.<port>; candidates: "
                    f"{_candidates(nodes, spec_in.type, name)}."
                )
                continue
            b = _parse_binding(name, port, bound[port], problems)
            if b is None:
                continue
            src = nodes.get(b["src"])
            if src is None:
                problems.append(
                    f"node '{name}' input '{port}': no node '{b['src']}'. Nodes: {', '.join(nodes)}."
                )
                continue
            out = src.out_ports.get(b["src_port"])
            if out is None:
                problems.append(
                    f"node '{name}' input '{port}': {b['src']} ({src.stage_cls.__name__}) has no output "
                    f"'{b['src_port']}'. Its outputs: {', '.join(src.out_ports) or 'none'}."
                )
                continue
            if not issubclass(out.type, spec_in.type):
                problems.append(
                    f"node '{name}' input '{port}' expects {want} but {b['src']}.{b['src_port']} gives "
                    f"{_type_name(out.type)}. Fix: bind it to a port of type {want}: "
                    f"{_candidates(nodes, spec_in.type, name)}."
                )
                continue
            if b["feedback"] and b["prime"] < 1:
                problems.append(
                    f"node '{name}' input '{port}' is a feedback edge with prime={b['prime']}: the loop would wait "
                    f"for itself. Fix: graph.nodes.{name}.inputs.{port}.prime=1 (draft, then verify) or 2 (draft one round ahead)."
                )
                continue
            if b["prime"] and not spec_in.stream:
                problems.append(
                    f"node '{name}' input '{port}' has prime={b['prime']} but is a run constant: only a streamed "
                    f"input can start with empty items. Fix: drop `prime` from graph.nodes.{name}.inputs.{port}."
                )
                continue
            if b["feedback"] and not spec_in.stream:
                problems.append(
                    f"node '{name}' input '{port}' is marked feedback but is not a streamed input, so the loop "
                    "could never advance. Fix: feedback edges must end at an In(..., stream=True) port."
                )
                continue
            edges.append(Edge(src=b["src"], src_port=b["src_port"], dst=name, dst_port=port,
                              feedback=b["feedback"], prime=b["prime"], capacity=b["capacity"]))
    return edges


def _parse_binding(node: str, port: str, raw: Any, problems: list[str]) -> dict | None:
    if isinstance(raw, str):
        raw = {"from": raw}
    if not isinstance(raw, Mapping) or not isinstance(raw.get("from"), str) or "." not in raw["from"]:
        problems.append(
            f"node '{node}' input '{port}': binding {raw!r} is not `node.port`. "
            f"Fix: graph.nodes.{node}.inputs.{port}=<producer>.<port>"
        )
        return None
    extra = set(raw) - {"from", "feedback", "prime", "capacity"}
    if extra:
        problems.append(
            f"node '{node}' input '{port}': unknown binding keys {sorted(extra)}; allowed: from, feedback, prime, capacity."
        )
        return None
    src, src_port = raw["from"].rsplit(".", 1)
    return {
        "src": src,
        "src_port": src_port,
        "feedback": bool(raw.get("feedback", False)),
        "prime": int(raw.get("prime", 1 if raw.get("feedback") else 0)),
        "capacity": raw.get("capacity"),
    }


def _candidates(nodes: dict[str, NodeSpec], want: type, exclude: str) -> str:
    found = [
        f"{n.name}.{p}" for n in nodes.values() if n.name != exclude
        for p, out in n.out_ports.items() if issubclass(out.type, want)
    ]
    return ", ".join(found) if found else "none in this graph"


def _type_name(t: type) -> str:
    return getattr(t, "__name__", str(t))


# --------------------------------------------------------------------------------------------
# checking the flow: cycles, feedback, waits -> the order


def check_flow(nodes: dict[str, NodeSpec], edges: list[Edge]) -> GraphSpec:
    """The one legal cycle is marked feedback, a feedback edge closes a loop, no wait (`after:`)
    is on a path back to itself; the nodes in topological order (feedback edges removed)."""
    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((e.src, e.dst) for e in edges if not e.feedback)
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        back = next(e for e in edges if (e.src, e.dst) == cycle[-1] and not e.feedback)
        raise ConfigError(
            f"cycle {path} is not marked as feedback. Fix: mark its back edge, e.g. "
            f"graph.nodes.{back.dst}.inputs.{back.dst_port}={{from: {back.src}.{back.src_port}, feedback: true, prime: 1}}"
        )
    _check_waits(nodes, edges)
    for e in edges:
        if e.feedback and not nx.has_path(dag, e.dst, e.src):
            raise ConfigError(
                f"edge {e} is marked feedback but closes no loop ({e.dst} does not lead back to {e.src}). "
                f"Fix: drop `feedback: true` from graph.nodes.{e.dst}.inputs.{e.dst_port}."
            )
    order = list(nx.lexicographical_topological_sort(dag, key=lambda n: list(nodes).index(n)))
    consumers: dict[tuple[str, str], list[Edge]] = {}
    for e in edges:
        consumers.setdefault((e.src, e.src_port), []).append(e)
    return GraphSpec(nodes=nodes, edges=edges, order=order, consumers=consumers)


def _check_waits(nodes: dict[str, NodeSpec], edges: list[Edge]) -> None:
    """A node that waits (`after:`) for a node that needs its output, through any edges (the
    feedback loop's too) or other waits, would wait forever."""
    flow = nx.DiGraph()
    flow.add_nodes_from(nodes)
    flow.add_edges_from((e.src, e.dst) for e in edges)
    flow.add_edges_from((other, n.name) for n in nodes.values() for other in n.after)
    for n in nodes.values():
        for other in n.after:
            if nx.has_path(flow, n.name, other):
                path = " -> ".join(nx.shortest_path(flow, n.name, other))
                raise ConfigError(f"node '{n.name}' waits (after:) for '{other}', which needs it first ({path}): it would "
                                  f"wait forever. Fix: drop '{other}' from graph.nodes.{n.name}.after.")
