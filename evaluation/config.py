"""A reelflow config from lmms-eval's `model_args`: `experiment` and `model` choose the graph and
the models, every other key is a Hydra override, checked here with one clear message each.

    cfg = compose_config({"experiment": "sparrow", "model": "toy_qwen", "model.target.compile": "auto"})
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

CONF = Path(__file__).resolve().parent.parent / "conf"
RESERVED = ("experiment", "model")


class ModelArgsError(ValueError):
    """model_args that do not make a reelflow run."""


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def hydra_value(value) -> str:
    """A model_args value (lmms-eval turns "true" and numbers into Python values) as Hydra reads it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def compose_config(args: dict) -> DictConfig:
    """The config `python -m run +experiment=E model=M k=v ...` would run, with `data` left out
    (lmms-eval gives the videos). Raises ModelArgsError naming what is wrong and what exists."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf.errors import OmegaConfBaseException

    args = dict(args)
    experiment, model = args.pop("experiment", "ar"), args.pop("model", "toy_qwen")
    experiments, models = _choices("experiment"), _choices("model")
    if experiment not in experiments:
        raise ModelArgsError(f"reelflow: experiment={experiment} is not one of reelflow's experiments "
                             f"({', '.join(experiments)})")
    if model not in models:
        raise ModelArgsError(f"reelflow: model={model} is not one of reelflow's model entries ({', '.join(models)})")
    overrides = [f"+experiment={experiment}", f"model={model}", *(f"{k}={hydra_value(v)}" for k, v in args.items())]
    try:
        if GlobalHydra.instance().is_initialized():      # inside a `python -m run` job: its search path
            cfg = compose("config", overrides=overrides)
        else:
            with initialize_config_dir(str(CONF), version_base="1.3"):
                cfg = compose("config", overrides=overrides)
    except MissingConfigException as e:
        raise ModelArgsError(f"reelflow model_args: {str(e).splitlines()[0]}") from None
    except (HydraException, OmegaConfBaseException) as e:
        bad = next((f"{k}={hydra_value(v)}" for k, v in args.items() if k.split(".")[0] in str(e)), None)
        lines = [line for line in str(e).splitlines() if line.strip() and not line.startswith("To append")]
        why = "; ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
        raise ModelArgsError(f"reelflow model_args: {bad + ': ' if bad else ''}{why}") from None
    if cfg.get("train"):
        raise ModelArgsError(f"reelflow: experiment={experiment} trains a model; give a graph that answers "
                             "(ar, sparrow, vanilla_sd, parallelvlm, quickvideo, ...)")
    return cfg


def check_graph(cfg: DictConfig) -> None:
    """Validate and compile the graph now, before any video is read (job.prepare's checks)."""
    from graph.spec import ConfigError
    from job.prepare import prepare

    try:
        prepare(cfg)
    except ConfigError as e:
        raise ModelArgsError(f"reelflow: {e}") from None
