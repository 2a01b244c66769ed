"""A job's config check (job.prepare): the model entries' settings are checked as the loader checks
them, and each stage's values as its constructor checks them, so a misspelt value stops the run
before anything loads."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from graph.resources import load_resources
from graph.spec import ConfigError, build_graph
from job.prepare import EXECUTOR_KEYS, executor_problems, model_entry_problems, prepare, stage_value_problems
from tests.conf.test_experiments import composed
from tests.helpers import CPU, node

ENTRY = {"path": "zoo/weights/qwen-target", "dtype": "float32", "lean": True, "compile": "off", "pack": "auto"}


def models(**changes) -> OmegaConf:
    return OmegaConf.create({"target": {**ENTRY, **changes.get("target", {})},
                             "draft": {**ENTRY, **changes.get("draft", {})},
                             "sparrow": "zoo/weights/qwen-sparrow", "uv_layers": [1, 2, 3]})


def test_good_entries_and_other_model_keys_pass():
    assert model_entry_problems(models()) == []
    assert model_entry_problems(None) == []                                  # model=none


@pytest.mark.parametrize("change,expect", [
    ({"target": {"compile": "bogus"}}, "model.target.compile='bogus': use one of auto, off, default"),
    ({"draft": {"pack": "tilde"}}, "model.draft.pack='tilde': use auto, true, false or tiled"),
    ({"target": {"dtype": "float8"}}, "model.target.dtype='float8': use one of float32"),
    ({"target": {"lean": False, "compile": "default"}}, "model.target.compile needs the lean path"),
    ({"target": {"pack": "tiled"}}, "model.target.pack=tiled serves the compiled steps' products"),
    ({"target": {"compil": "default"}}, "model.target.compil: no such key; a model entry takes path"),
])
def test_each_bad_setting_is_named_with_what_it_takes(change, expect):
    problems = model_entry_problems(models(**change))
    assert len(problems) == 1 and problems[0].startswith(expect), problems


def test_every_problem_at_once_before_the_graph_is_built():
    cfg = OmegaConf.create({"model": models(target={"compile": "bogus"}, draft={"pack": "tilde"}),
                            "graph": {"nodes": {}}})
    with pytest.raises(ConfigError, match=r"2 problems") as info:
        prepare(cfg)
    assert [p.split("=")[0] for p in info.value.problems] == ["model.target.compile", "model.draft.pack"]


def test_an_entry_whose_interpolation_does_not_resolve_is_left_to_the_graph_check():
    entry = OmegaConf.create({"target": {**ENTRY, "fps": "${bench.fps}"}, "uv_layers": "${nowhere.x}"})
    assert model_entry_problems(entry) == []


def test_the_entry_is_read_as_the_loader_reads_it():
    # YAML's unquoted `off` is False, which the loader takes as "off"; a null pack is no setting it takes
    assert model_entry_problems(models(target={"compile": False}, draft={"compile": None, "dtype": None})) == []
    assert model_entry_problems(models(target={"pack": None})) == [
        "model.target.pack=None: use auto, true, false or tiled"]
    assert model_entry_problems(models(target={"lean": None, "compile": "default"})) == [
        "model.target.compile needs the lean path (lean: true): it compiles the lean step"]


def test_a_value_a_stage_refuses_is_a_config_problem_naming_the_node():
    resources = load_resources(CPU)[0]
    spec = build_graph({"nodes": {"a": node("bench.synthetic.Producer", items=0),
                                  "b": node("bench.synthetic.Consumer", "target", {"item": "a.item"}, iters=-1)}},
                       resources)
    problems = stage_value_problems(spec)
    assert [p.split(":")[0] for p in problems] == ["node 'a' (Producer)", "node 'b' (Consumer)"]
    assert "items must be" in problems[0] and "iters ≥ 0" in problems[1]


def test_the_executor_takes_the_keys_of_the_default_config_and_a_misspelt_one_is_named():
    assert set(composed([]).executor) == set(EXECUTOR_KEYS)        # conf/config.yaml's executor block
    assert executor_problems(composed([]).executor) == [] and executor_problems(None) == []
    assert executor_problems(OmegaConf.create({"runner": "threaded", "runer": "sequential", "zzz": 1})) == [
        "executor.runer: no such key; did you mean executor.runner? the executor takes "
        "runner, capacity, warmup, cancel_timeout_s, progress, openmp",
        "executor.zzz: no such key; the executor takes runner, capacity, warmup, cancel_timeout_s, progress, openmp"]
