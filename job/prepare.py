"""A job's config checked and compiled before any stage is built: the graph spec and its plan, and
the ports the job reads its figures from (graph.first_token, graph.answer)."""

from __future__ import annotations

from omegaconf import DictConfig

from graph.resources import load_resources
from graph.schedule import Plan, compile_plan
from graph.spec import ConfigError, GraphSpec, build_graph


def prepare(cfg: DictConfig, n_cuda: int | None = None) -> tuple[GraphSpec, Plan]:
    """Everything that can be checked without building a stage: the config's whole validation."""
    from omegaconf.errors import InterpolationResolutionError

    resources, cores, strict = load_resources(cfg.get("resources"), n_cuda=n_cuda)
    try:
        spec = build_graph(cfg.get("graph"), resources)
    except InterpolationResolutionError as e:   # e.g. ${model.target.fps} with model=none
        key = getattr(e, "full_key", "") or "a graph key"
        detail = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {detail}. Fix: choose what it refers to, e.g. model=toy_qwen "
                          "(graphs with models need model.target).") from None
    ex = cfg.get("executor") or {}
    plan = compile_plan(spec, resources, cores, strict=strict, runner=ex.get("runner", "threaded"),
                        capacity=int(ex.get("capacity", 2)))
    for key, example in (("first_token", "generate.first"), ("answer", "generate.tokens")):
        ref = (cfg.get("graph") or {}).get(key)
        if ref and ("." not in ref or ref.rsplit(".", 1)[1] not in getattr(spec.nodes.get(ref.rsplit(".", 1)[0]), "out_ports", {})):
            raise ConfigError(f"graph.{key}={ref} names no node.port of this graph. Fix: e.g. graph.{key}={example}")
    return spec, plan


def graph_ports(cfg: DictConfig) -> tuple[str | None, str | None]:
    """The graph's first-token port and answer port (graph.first_token, graph.answer)."""
    graph = cfg.get("graph") or {}
    return graph.get("first_token"), graph.get("answer")
