"""A job's config checked and compiled before anything is built for the run: the model entries'
settings, the graph spec and each stage's values, the plan, and the ports the job reads its
figures from (graph.first_token, graph.answer)."""

from __future__ import annotations

from omegaconf import DictConfig

from graph.jobs import build_stage
from graph.resources import load_resources
from graph.schedule import Plan, compile_plan
from graph.spec import ConfigError, GraphSpec, build_graph


def prepare(cfg: DictConfig, n_cuda: int | None = None) -> tuple[GraphSpec, Plan]:
    """The config's whole validation, before anything is built for the run (stages are built once
    and dropped, models not loaded): the spec and the plan, or a ConfigError naming every problem."""
    from omegaconf.errors import InterpolationResolutionError

    from models.prefix_attention import environment_problem

    problems = (executor_problems(cfg.get("executor")) + model_entry_problems(cfg.get("model"))
                + [p for p in [environment_problem()] if p])
    if problems:
        raise ConfigError(problems)
    resources, cores, strict = load_resources(cfg.get("resources"), n_cuda=n_cuda)
    try:
        spec = build_graph(cfg.get("graph"), resources)
    except InterpolationResolutionError as e:   # e.g. ${model.target.fps} with model=none
        key = getattr(e, "full_key", "") or "a graph key"
        detail = str(e).splitlines()[0]
        raise ConfigError(f"{key}: {detail}. Fix: choose what it refers to, e.g. model=toy_qwen "
                          "(graphs with models need model.target).") from None
    stage_problems = stage_value_problems(spec)
    if stage_problems:
        raise ConfigError(stage_problems)
    ex = cfg.get("executor") or {}
    plan = compile_plan(spec, resources, cores, strict=strict, runner=ex.get("runner", "threaded"),
                        capacity=int(ex.get("capacity", 2)))
    for key, example in (("first_token", "generate.first"), ("answer", "generate.tokens")):
        ref = (cfg.get("graph") or {}).get(key)
        if ref and ("." not in ref or ref.rsplit(".", 1)[1] not in getattr(spec.nodes.get(ref.rsplit(".", 1)[0]), "out_ports", {})):
            raise ConfigError(f"graph.{key}={ref} names no node.port of this graph. Fix: e.g. graph.{key}={example}")
    return spec, plan


def stage_value_problems(spec: GraphSpec) -> list[str]:
    """Each node's stage built once from its config and dropped: a stage's constructor only checks
    and keeps its settings (setup loads models and starts decoders), so a value it refuses
    (`max_new_tokens=-1`) is one more config problem, found before anything is built for the run."""
    problems = []
    for name, node in spec.nodes.items():
        try:
            build_stage(node.stage_cfg)
        except (ValueError, TypeError) as e:
            problems.append(f"node '{name}' ({node.stage_cls.__name__}): {e}. Fix: graph.nodes.{name}.stage.<key>=...")
    return problems


EXECUTOR_KEYS = ("runner", "capacity", "warmup", "cancel_timeout_s", "progress", "openmp")   # conf/config.yaml's


def executor_problems(executor) -> list[str]:
    """A key of `executor` no part of the job reads (`+executor.runer=...` adds one where Hydra
    would refuse `executor.runer=...`): one problem each, naming the closest known key."""
    import difflib

    problems = []
    for key in sorted(set(executor or {}) - set(EXECUTOR_KEYS)):
        close = difflib.get_close_matches(key, EXECUTOR_KEYS, n=1)
        hint = f"did you mean executor.{close[0]}? " if close else ""
        problems.append(f"executor.{key}: no such key; {hint}the executor takes {', '.join(EXECUTOR_KEYS)}")
    return problems


def model_entry_problems(models: DictConfig | None) -> list[str]:
    """The settings of each model entry (`model.target`, `model.draft`: a mapping with a path),
    checked as the model loader would check them, so that a misspelt key or value stops the run
    before any model loads. An entry whose interpolations do not resolve is left to the graph's
    check, which names what they refer to."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from models.load import setting_problems
    from models.registry import SPEC_KEYS, model_key

    problems = []
    for role in list(models.keys()) if models is not None else []:
        try:                 # another key of the group (model.uv_layers) may not resolve: not an entry's
            entry = OmegaConf.to_container(models[role], resolve=True) if isinstance(models[role], DictConfig) else None
        except OmegaConfBaseException:
            continue
        if not entry or "path" not in entry:
            continue
        unknown = sorted(set(entry) - set(SPEC_KEYS))
        problems += [f"model.{role}.{key}: no such key; a model entry takes {', '.join(SPEC_KEYS)}" for key in unknown]
        _, dtype, _, _, lean, compile, pack = model_key(entry, "cpu")       # as the loader reads the entry
        problems += [f"model.{role}.{p}" for p in setting_problems(dtype=dtype, lean=lean, compile=compile, pack=pack)]
    return problems


def graph_ports(cfg: DictConfig) -> tuple[str | None, str | None]:
    """The graph's first-token port and answer port (graph.first_token, graph.answer)."""
    graph = cfg.get("graph") or {}
    return graph.get("first_token"), graph.get("answer")
