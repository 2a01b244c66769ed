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
naming the node, the port, the types and a fix.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import inspect
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import networkx as nx
from omegaconf import DictConfig, ListConfig, OmegaConf

from graph.stage import In, Out, is_stage_class

log = logging.getLogger(__name__)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}


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


# --------------------------------------------------------------------------------------------
# resolving stage classes


def _type_name(t: type) -> str:
    return getattr(t, "__name__", str(t))


STAGE_PACKAGES = ("stages", "bench")   # where stage classes live: the product's, then the benchmarks'


def known_stage_classes() -> dict[str, str]:
    """Stage classes under STAGE_PACKAGES: short name -> dotted path (for suggestions)."""
    found: dict[str, str] = {}
    for package in STAGE_PACKAGES:
        try:
            pkg = importlib.import_module(package)
        except ImportError:
            continue
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                mod = importlib.import_module(f"{package}.{info.name}")
            except Exception:  # a broken optional module must not break suggestions
                continue
            for name, obj in vars(mod).items():
                if is_stage_class(obj) and obj.__module__ == mod.__name__:
                    found.setdefault(name, f"{mod.__name__}.{name}")
    return found


def locate(path: str) -> Any:
    """Import `pkg.module.Attr`; raise LookupError with the reason."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue  # this prefix is not a module; try a shorter one
            raise LookupError(f"importing {module_name} failed: {e}") from e
        except Exception as e:
            raise LookupError(f"importing {module_name} failed: {type(e).__name__}: {e}") from e
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise LookupError(f"{module_name} has no {'.'.join(parts[cut:])}")
            obj = getattr(obj, attr)
        return obj
    raise LookupError(f"no module found for {path}")


def stage_presets() -> dict[str, Path]:
    """conf/stage/<kind>/<name>.yaml, addressable as `<kind>/<name>` or (if unique) `<name>`."""
    presets: dict[str, Path] = {}
    names: dict[str, list[Path]] = {}
    for f in sorted((CONF_DIR / "stage").glob("*/*.yaml")):
        presets[f"{f.parent.name}/{f.stem}"] = f
        names.setdefault(f.stem, []).append(f)
    for stem, files in names.items():
        if len(files) == 1:
            presets.setdefault(stem, files[0])
    return presets


def _plain(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def _resolve_stage_cfg(name: str, raw: Any, problems: list[str]) -> dict | None:
    if isinstance(raw, str):
        presets = stage_presets()
        if raw not in presets:
            close = difflib.get_close_matches(raw, presets, n=3)
            problems.append(
                f"node '{name}': unknown stage preset '{raw}'. Fix: use one of "
                f"{', '.join(close or sorted(presets))} (files under conf/stage/), or a `_target_` block."
            )
            return None
        raw = _plain(OmegaConf.load(presets[raw]))
        if isinstance(raw, dict) and len(raw) == 1 and "_target_" not in raw and isinstance(next(iter(raw.values())), dict):
            raw = next(iter(raw.values()))  # tolerate a preset written under a package key
    if not isinstance(raw, Mapping) or "_target_" not in raw:
        problems.append(
            f"node '{name}': `stage` must be a `_target_` block or a preset name, got {raw!r}. "
            f"Fix: graph.nodes.{name}.stage={{_target_: stages.<kind>.<Class>, ...}}"
        )
        return None
    return dict(raw)


def _check_stage_class(name: str, cfg: dict, problems: list[str]) -> type | None:
    target = cfg["_target_"]
    try:
        cls = locate(target)
    except LookupError as e:
        known = known_stage_classes()
        short = target.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(short, known, n=3) + difflib.get_close_matches(target, known.values(), n=2)
        hint = f" Did you mean {', '.join(dict.fromkeys(known.get(c, c) for c in close))}?" if close else ""
        problems.append(f"node '{name}': unknown _target_ '{target}' ({e}).{hint}")
        return None
    if not is_stage_class(cls):
        problems.append(
            f"node '{name}': _target_ '{target}' is not a stage (it declares no inputs/outputs/placement). "
            "Fix: point it at a subclass of graph.stage.Stage."
        )
        return None
    kwargs = {k: v for k, v in cfg.items() if k not in HYDRA_KEYS}
    sig = inspect.signature(cls)
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        accepted = [p for p in sig.parameters if p not in ("self", "args", "kwargs")]
        unexpected = [k for k in kwargs if k not in sig.parameters]
        fixes = []
        for k in unexpected:
            close = difflib.get_close_matches(k, accepted, n=1)
            fixes.append(f"'{k}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        detail = f"unexpected {', '.join(fixes)}" if fixes else str(e)
        problems.append(
            f"node '{name}': {cls.__name__}() does not accept these kwargs: {detail}. "
            f"It accepts: {', '.join(accepted) or 'nothing'}."
        )
        return None
    return cls


# --------------------------------------------------------------------------------------------
# bindings


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


def _candidates(nodes: dict[str, NodeSpec], want: type, exclude: str) -> str:
    found = [
        f"{n.name}.{p}" for n in nodes.values() if n.name != exclude
        for p, out in n.out_ports.items() if issubclass(out.type, want)
    ]
    return ", ".join(found) if found else "none in this graph"


def build_graph(graph_cfg: Any, resources: Mapping[str, Any] | None = None) -> GraphSpec:
    """Validate a graph config (and, if given, its resource names) and return the spec."""
    problems: list[str] = []
    graph_cfg = _plain(graph_cfg) or {}
    raw_nodes = graph_cfg.get("nodes") if isinstance(graph_cfg, Mapping) else None
    if not raw_nodes or not isinstance(raw_nodes, Mapping):
        raise ConfigError("the graph has no `nodes:` dict. Fix: choose a graph (graph=demo) or define graph.nodes.")

    nodes: dict[str, NodeSpec] = {}
    raw_inputs: dict[str, dict] = {}
    for name, raw in raw_nodes.items():
        if raw is None:
            continue  # `~graph.nodes.x` or `graph.nodes.x=null` removes a node
        if not isinstance(raw, Mapping):
            problems.append(f"node '{name}': expected a dict with stage/inputs/on, got {raw!r}")
            continue
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
        cfg = _resolve_stage_cfg(name, raw.get("stage"), problems)
        cls = _check_stage_class(name, cfg, problems) if cfg else None
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
        if cls is not None:
            nodes[name] = NodeSpec(name=name, stage_cls=cls, stage_cfg=cfg, on=str(on), after=tuple(map(str, after)))
            raw_inputs[name] = dict(raw.get("inputs") or {})

    for name, node in nodes.items():
        for other in node.after:
            if other == name or other not in raw_nodes or raw_nodes[other] is None:
                problems.append(f"node '{name}': after: '{other}' is not another node of this graph. "
                                f"Nodes: {', '.join(n for n in nodes if n != name)}.")
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
    if problems:
        raise ConfigError(problems)

    dag = nx.DiGraph()
    dag.add_nodes_from(nodes)
    dag.add_edges_from((e.src, e.dst) for e in edges if not e.feedback)
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle is None:
        _check_waits(nodes, edges)
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        back = next(e for e in edges if (e.src, e.dst) == cycle[-1] and not e.feedback)
        raise ConfigError(
            f"cycle {path} is not marked as feedback. Fix: mark its back edge, e.g. "
            f"graph.nodes.{back.dst}.inputs.{back.dst_port}={{from: {back.src}.{back.src_port}, feedback: true, prime: 1}}"
        )
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
