"""Every experiment in conf/experiment/ composes and validates, with no model loaded: the graph,
its stages' keys, the resources and the compiled plan (or, for training, the train block); and
so does every value its saved sweep goes through. A misspelt key in any experiment fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import run  # noqa: F401  (registers the config's resolvers)
from job.run import prepare

CONF = Path(__file__).resolve().parents[2] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def composed(overrides: list[str], hydra_config: bool = False):
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_config)


def validate(cfg) -> None:
    """What `python -m run` checks before it builds anything."""
    if cfg.get("train"):
        from zoo.train.recipes import check, recipe_of

        check(*recipe_of(OmegaConf.to_container(cfg.train, resolve=True)))
    else:
        prepare(cfg, n_cuda=0)


def sweep_points(name: str) -> list[list[str]]:
    """One override list per value of each key the experiment's saved sweep goes through."""
    params = composed([f"+experiment={name}"], hydra_config=True).hydra.sweeper.params or {}
    points = []
    for key, values in params.items():
        for value in str(values).split(","):
            points.append([f"{key}={value.strip()}"])
    return points


def test_there_are_experiments():
    assert {"ar", "demo", "quickvideo", "parallelvlm", "bench_sd", "train_toy"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_and_validates(name):
    validate(composed([f"+experiment={name}"]))
    for point in sweep_points(name):
        validate(composed([f"+experiment={name}", *point]))


def test_a_misspelt_stage_key_is_refused():
    from graph.spec import ConfigError

    with pytest.raises(ConfigError, match="group_framez"):
        validate(composed(["+experiment=quickvideo", "+graph.nodes.prefill.stage.group_framez=4"]))


def test_the_old_pruning_keys_are_refused_before_anything_loads_and_the_errors_name_keep():
    """Every pruner takes `keep`, the share kept: a config still written with QuickPrefill's `ratio`
    or UV-Prune's `alpha` (the share dropped) must fail, not run with the default share (the
    group prefill's own prune keys: tests/stages/test_prune.py)."""
    from hydra.errors import ConfigCompositionException

    from graph.spec import ConfigError

    with pytest.raises(ConfigCompositionException, match="alpha"):
        composed(["+experiment=parallelvlm", "graph.uv.alpha=0.9"])
    with pytest.raises(ConfigCompositionException, match="ratio"):
        composed(["+experiment=quickvideo", "graph.prune.ratio=0.2"])
    with pytest.raises(ConfigError, match=r"UVPrune\(\) does not accept these kwargs: unexpected 'alpha'.*accepts: keep"):
        validate(composed(["+experiment=parallelvlm", "+graph.nodes.prune.stage.alpha=0.9"]))
    with pytest.raises(ConfigError, match=r"AttentionPrune\(\) does not accept these kwargs: unexpected 'alpha'.*accepts: keep"):
        validate(composed(["+experiment=specvlm", "+graph.nodes.prune.stage.alpha=0.9"]))


@pytest.mark.parametrize("experiment", ["sparrow", "quickvideo_sparrow"])
def test_sparrows_tree_fits_the_machine_and_the_papers_shape_is_one_override_away(experiment):
    """10-6-2 on CPU cores, where a big tree costs several target steps to verify; 30-4-8 on GPUs."""
    def shape(*overrides):
        stage = composed([f"+experiment={experiment}", *overrides]).graph.nodes.draft.stage
        return stage.total, stage.depth, stage.topk

    assert shape() == shape("resources=split") == (10, 6, 2)
    assert shape("resources=gpu") == shape("resources=gpu2") == shape("resources=gpu_split") == (30, 4, 8)
    assert shape('graph.tree_shape={total: 30, depth: 4, topk: 8}') == (30, 4, 8)
    assert shape("graph.tree_shape.total=16") == (16, 6, 2)


def config_columns(cfg) -> list[str]:
    """The report's columns read from the composed config: neither derived by the block, nor a
    metric (summary.*), nor the method's name."""
    report = OmegaConf.to_container(cfg.report, resolve=False) if cfg.get("report") else {}
    derived = set(report.get("derived") or {})
    return [c for c in report.get("columns") or []
            if "." in c and c not in derived and not c.startswith("summary.")]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_report_columns_from_the_config_exist_for_every_method_swept(name):
    """A column the report reads from the config must be in every method's config, else a sweep
    of methods without it (`method=ar,sparrow` of bench_sparrow, say) has no report (it names the
    column no job has): such a key is an optional derived column instead."""
    base = composed([f"+experiment={name}"])
    methods = [p[0].split("=", 1)[1] for p in sweep_points(name) if p[0].startswith("method=")]
    for method in methods:
        cfg = composed([f"+experiment={name}", f"method={method}"])
        for column in config_columns(base):
            assert OmegaConf.select(cfg, column, default=None) is not None, (name, method, column)
