"""Which recipe a `train:` block runs (its `recipe` key: toy, the default, sparrow or draft), its keys
checked before anything is built, and the recipe's trainer.

    name, keys = recipe_of(block)             # the block without its `recipe` key
    check(name, keys)                         # graph.spec.ConfigError naming every problem
    result = trainer(name)(progress=True, **keys)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RECIPES = ("toy", "sparrow", "draft")


def recipe_of(block: Mapping[str, Any]) -> tuple[str, dict]:
    keys = dict(block)
    name = keys.pop("recipe", "toy")
    if name not in RECIPES:
        from graph.spec import ConfigError

        raise ConfigError([f"train.recipe={name!r}: one of {', '.join(RECIPES)}"])
    return name, keys


def config_classes(name: str) -> tuple[type, ...]:
    from zoo.train.config import LoopConfig, ToyConfig

    if name == "sparrow":
        from zoo.train.sparrow import SparrowTrainConfig
        from zoo.train.user_data import UserDataConfig

        return LoopConfig, UserDataConfig, SparrowTrainConfig
    if name == "draft":
        from zoo.train.draft import DraftTrainConfig
        from zoo.train.user_data import UserDataConfig

        return LoopConfig, UserDataConfig, DraftTrainConfig
    return LoopConfig, ToyConfig


def check(name: str, keys: Mapping[str, Any]) -> None:
    from zoo.train.config import parse_flat

    parse_flat(keys, *config_classes(name))


def trainer(name: str):
    if name == "sparrow":
        from zoo.train.sparrow import train
    elif name == "draft":
        from zoo.train.draft import train
    else:
        from zoo.train.toy import train
    return train
