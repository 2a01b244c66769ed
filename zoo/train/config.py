"""What a training run is told, as dataclasses, checked before anything is built or trained.

The user writes one flat block of keys (conf/experiment/train_toy.yaml's `train:`, or `train.KEY=...`
on the command line); `parse` sorts them into the loop's settings (`LoopConfig`, the same for every
recipe) and the recipe's (`ToyConfig`, grouped into its data and its losses). Everything wrong is
reported at once, the way the engine reports a graph: an unknown key with the closest valid
names, a value of the wrong type, a value out of range, a checkpoint that does not fit, all as
one graph.spec.ConfigError (`python -m run` prints it and exits with status 2).

A second recipe declares its own dataclass and calls `parse_flat(raw, LoopConfig, ItsConfig)`.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph.spec import ConfigError

PRECISIONS = ("bf16", "fp32")


@dataclass(frozen=True)
class LoopConfig:
    """The shared loop's settings (zoo.train.loop)."""

    steps: int = 2000
    lr: float = 5e-4
    warmup: int = 100                  # steps of linear warmup, then a cosine decay to 0 at `steps`
    seed: int = 0
    precision: str = "bf16"            # bf16: autocast matmuls, fp32 weights and optimizer; fp32
    device: str = "auto"               # auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N
    loader_workers: int | None = None  # processes making batches (None: the device's default)
    max_minutes: float | None = None   # stop after this much training time and save what is there
    log_every: int = 50
    eval_every: int = 250              # the recipe's quick check every this many steps (0: never)
    out: str | None = None             # where the checkpoint goes (None: the recipe's default)
    checkpoint_every: int = 500        # save the training state this often (and on Ctrl-C; 0: only on Ctrl-C)
    resume: bool = False               # go on from the training state saved in `out` (same settings)
    overwrite: bool = False            # replace a trained model already in `out` (else that is refused)

    def problems(self) -> list[str]:
        from zoo.train.device import (
            resolve_device,  # torch: only when a config is checked
        )

        out = _at_least(self, steps=1, warmup=1, log_every=1, eval_every=0, checkpoint_every=0)
        if self.precision not in PRECISIONS:
            out.append(f"precision={self.precision!r}: bf16 (autocast, fp32 master weights) or fp32")
        if not self.lr > 0:
            out.append(f"lr={self.lr}: the peak learning rate, > 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            out.append(f"max_minutes={self.max_minutes}: the training time allowed, > 0 (null: no limit)")
        if self.loader_workers is not None and self.loader_workers < 0:
            out.append(f"loader_workers={self.loader_workers}: the processes making batches, an int >= 0 "
                       "(0: in the training process), or null for the device's default")
        try:
            resolve_device(self.device)
        except ValueError as e:
            out.append(str(e))
        return out


@dataclass(frozen=True)
class ToyData:
    """What the toy recipe's batches hold (zoo.train.data.Batches)."""

    batch_size: int = 8
    seconds: tuple[float, float] = (8, 32)        # each batch's video length is drawn from this range (s)
    warm_seconds: tuple[float, float] = (2, 12)   # ... starting from this one
    ramp: float = 0.5                             # fraction of the steps over which the range widens
    stretch: float = 1.0                          # Qwen: temporal spacing spread by a factor in [1, stretch]
    text_shift: int = 0
    clause_gap: int = 0
    ground_before: bool = False
    codec: bool = False
    dense_gap: tuple[float, float] | None = None
    dense_share: float = 0.5
    fps_scale: tuple[int, int] | None = None
    fps_share: float = 0.5

    def problems(self) -> list[str]:
        from zoo import world

        out = _at_least(self, batch_size=1, text_shift=0, clause_gap=0)
        for name in ("seconds", "warm_seconds"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                out.append(f"{name}={list(getattr(self, name))}: [low, high] s of video, 0 < low <= high")
        if not 0.0 <= self.ramp <= 1.0:
            out.append(f"ramp={self.ramp}: the fraction of the steps over which the lengths widen, in [0, 1]")
        if not self.stretch >= 1.0:
            out.append(f"stretch={self.stretch}: a factor >= 1 on the temporal spacing (1: off)")
        if self.dense_gap is not None and not world.MOVE_S <= self.dense_gap[0] <= self.dense_gap[1]:
            out.append(f"dense_gap={list(self.dense_gap)}: [low, high] s between events, "
                       f"{world.MOVE_S} <= low <= high (a move glides for {world.MOVE_S} s)")
        if self.fps_scale is not None and not 1 <= self.fps_scale[0] <= self.fps_scale[1]:
            out.append(f"fps_scale={list(self.fps_scale)}: [low, high] integers, 1 <= low <= high, that multiply "
                       "the zoo's frame rate")
        for name, what in (("dense_share", "examples from the denser world"),
                           ("fps_share", "batches at a scaled frame rate")):
            if not 0.0 <= getattr(self, name) <= 1.0:
                out.append(f"{name}={getattr(self, name)}: the fraction of {what}, in [0, 1]")
        return out


@dataclass(frozen=True)
class ToyLosses:
    """Which of the toy recipe's loss terms are on, and their weights (zoo.train.toy)."""

    aux_weight: float = 1.0            # the cell probe on the visual tokens (0: off)
    event_weight: float = 0.0          # the event probe at the middle layer (0: off)
    ground_weight: float = 0.0         # one upper-layer head looks where the clause being stated is shown
    ground_layer: int | None = None    # that layer (None: the second-to-last)
    chain_weight: float = 0.0          # one middle-layer head looks from event j at event j - 1
    chain_layer: int | None = None     # that layer (None: the middle one)
    ground_margin: float = 1.0         # both looking losses ask for logit gaps this many times what suffices
    teacher: str | None = None         # a trained target whose distribution the model is distilled towards
    distill_weight: float = 1.0
    label_weight: float = 1.0          # the cross-entropy on the reference answer (0: learn from the teacher alone)

    def problems(self) -> list[str]:
        out = [f"{name}={getattr(self, name)}: a weight, >= 0 (0: off)"
               for name in ("aux_weight", "event_weight", "ground_weight", "chain_weight", "distill_weight",
                            "label_weight") if not getattr(self, name) >= 0]
        if not self.ground_margin >= 1.0:
            out.append(f"ground_margin={self.ground_margin}: >= 1 (1: the plain attention mass)")
        if self.label_weight == 0 and not (self.teacher and self.distill_weight > 0):
            out.append("label_weight=0 needs a teacher with distill_weight > 0: else nothing says what the answer is")
        return out


def visual_drop_problems(visual_drop: float, visual_uv_share: float, visual_keep: tuple[float, float]) -> list[str]:
    """What is wrong with visual-token dropout's shares (the toy recipe's and train_draft's)."""
    out = [f"{name}={value}: a share of the examples, in [0, 1]"
           for name, value in (("visual_drop", visual_drop), ("visual_uv_share", visual_uv_share))
           if not 0.0 <= value <= 1.0]
    low, high = visual_keep
    if not 0 < low <= high <= 1:
        out.append(f"visual_keep={list(visual_keep)}: [low, high] fractions of the visual tokens kept, "
                   "0 < low <= high <= 1")
    return out


@dataclass(frozen=True)
class ToyVisualDrop:
    """Visual-token dropout (zoo.train.toy.visual_keep): for a share of the examples the model sees
    only a subset of its visual tokens, each at its own position, as a draft does after
    ParallelVLM's UV-Prune (stages.prefill.SelectedPrefill), so that pruning costs it little."""

    visual_drop: float = 0.0                      # the share of examples that see a subset (0: off)
    visual_keep: tuple[float, float] = (0.1, 1.0)  # the kept fraction, uniform in [low, high]
    visual_uv_share: float = 0.0                  # of those, the share chosen by UV-Prune on the teacher (else random)
    uv_layers: tuple[int, int] = (0, 2)           # the teacher's layers l_0 and L whose similarity change scores them

    def problems(self) -> list[str]:
        out = visual_drop_problems(self.visual_drop, self.visual_uv_share, self.visual_keep)
        if not 0 <= self.uv_layers[0] < self.uv_layers[1]:
            out.append(f"uv_layers={list(self.uv_layers)}: [l_0, L], the teacher's layers, 0 <= l_0 < L "
                       "(0: the embeddings)")
        return out


@dataclass(frozen=True)
class ToyConfig:
    """The toy recipe: which zoo model, from what, its data and losses, and its check."""

    model: str                         # a zoo shape (zoo/shapes.py SHAPES)
    init: str | None = None            # a checkpoint of the same shape to go on from
    rope_theta: float | None = None    # rotary base (None: zoo.shapes.ROPE_THETA); a checkpoint keeps its own
    eval_seconds: float = 30.0         # the held-out check at the end
    eval_videos: int = 8
    data: ToyData = field(default_factory=ToyData)
    losses: ToyLosses = field(default_factory=ToyLosses)
    drop: ToyVisualDrop = field(default_factory=ToyVisualDrop)

    def problems(self) -> list[str]:
        from zoo.shapes import SHAPES, zoo_config

        out = _at_least(self, eval_videos=1)
        if not self.eval_seconds > 0:
            out.append(f"eval_seconds={self.eval_seconds}: the held-out videos' length, > 0")
        if self.rope_theta is not None and not self.rope_theta > 0:
            out.append(f"rope_theta={self.rope_theta}: a rotary base, > 0 (null: the zoo's)")
        if self.model not in SHAPES:
            close = difflib.get_close_matches(self.model, SHAPES, n=3)
            out.append(f"model={self.model!r}: not a zoo model; the zoo has {', '.join(close or SHAPES)}")
            return out
        config = zoo_config(self.model, self.rope_theta)
        layers = config.text_config.num_hidden_layers
        for name in ("ground", "chain"):
            layer = getattr(self.losses, f"{name}_layer")
            if getattr(self.losses, f"{name}_weight") > 0 and layer is not None and not 0 <= layer < layers:
                out.append(f"{name}_layer={layer}: {self.model} has layers 0..{layers - 1}")
        if self.init:
            out += _init_problems(self.init, self.model, config, self.rope_theta)
        if self.losses.teacher:
            found = _checkpoint_config(self.losses.teacher)
            if isinstance(found, str):
                out.append(f"teacher={self.losses.teacher}: {found}")
            elif found.model_type != config.model_type:
                out.append(f"teacher={self.losses.teacher} is a {found.model_type} model; "
                           f"{self.model} is {config.model_type}")
            elif self.drop.visual_drop > 0 and self.drop.visual_uv_share > 0 \
                    and self.drop.uv_layers[1] > found.text_config.num_hidden_layers:
                out.append(f"uv_layers={list(self.drop.uv_layers)}: the teacher has layers 0..{found.text_config.num_hidden_layers}")
        elif self.drop.visual_drop > 0 and self.drop.visual_uv_share > 0:
            out.append("visual_uv_share > 0 chooses tokens from a teacher's hidden states: set teacher "
                       "(or visual_uv_share=0 for random subsets)")
        return out


def parse(raw: Mapping[str, Any]) -> tuple[LoopConfig, ToyConfig]:
    """The toy recipe's flat keys (the `train:` block) as (LoopConfig, ToyConfig), or a
    ConfigError naming every problem."""
    return parse_flat(raw, LoopConfig, ToyConfig)


def parse_flat(raw: Mapping[str, Any], *classes: type, where: str = "train") -> tuple:
    """One instance of each dataclass of `classes` from one flat mapping: a field whose type is a
    dataclass (a group) takes its own fields from the same mapping, so every key names a leaf and
    no two leaves may share a name. Unknown keys, missing required ones, wrong types and each
    instance's own `problems()` (ranges, and what a setting needs of the others) are gathered into
    one ConfigError, keys prefixed by `where`."""
    leaves = {}
    for cls in classes:
        leaves.update(_leaves(cls))
    problems = _unknown(raw, leaves, where)
    values = {}
    for key, (hint, required) in leaves.items():
        if key not in raw:
            if required:
                problems.append(f"{where}.{key}: required (no default)")
            continue
        value, error = _typed(raw[key], hint)
        if error:
            problems.append(f"{where}.{key}={raw[key]!r}: {error}")
        else:
            values[key] = value
    if any(required and key not in values for key, (_, required) in leaves.items()):
        raise ConfigError(problems)
    built = tuple(_build(cls, values) for cls in classes)     # a field of the wrong type keeps its default
    for obj in built:
        problems += [f"{where}.{p}" for p in _all_problems(obj)]
    if problems:
        raise ConfigError(problems)
    return built


def check_keys(keys, *classes: type, where: str = "train") -> None:
    """A ConfigError naming each of `keys` that no field of `classes` has (see parse_flat), with
    the closest valid names; for checking overrides before their values are known."""
    leaves = {}
    for cls in classes:
        leaves.update(_leaves(cls))
    problems = _unknown(keys, leaves, where)
    if problems:
        raise ConfigError(problems)


def flat(obj) -> dict[str, Any]:
    """A parsed config back as its flat keys (groups flattened), e.g. for a record of the run."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out.update(flat(value) if dataclasses.is_dataclass(value) else {f.name: value})
    return out


# --------------------------------------------------------------------------------------------- internals

def _unknown(keys, leaves: dict, where: str) -> list[str]:
    out = []
    for key in keys:
        if key not in leaves:
            close = difflib.get_close_matches(str(key), leaves, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(f'{where}.{c}' for c in close)}?" if close else \
                f"the keys are {', '.join(leaves)}"
            out.append(f"{where}.{key}: no such key; {hint}")
    return out


def _at_least(obj, **lows: int) -> list[str]:
    return [f"{name}={getattr(obj, name)}: >= {low}" for name, low in lows.items() if not getattr(obj, name) >= low]


def _all_problems(obj) -> list[str]:
    """`obj.problems()` and its groups' (the groups first: a parent's checks may assume them)."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out += _all_problems(value)
    return out + (list(obj.problems()) if hasattr(obj, "problems") else [])


def _leaves(cls) -> dict[str, tuple[Any, bool]]:
    """{key: (type hint, required)} of `cls`'s fields, groups flattened."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            inner = _leaves(hint)
            clash = set(inner) & set(out)
            if clash:
                raise TypeError(f"{cls.__name__}: keys {sorted(clash)} appear twice")
            out.update(inner)
        else:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            out[f.name] = (hint, required)
    return out


def _build(cls, values: dict):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)


def _typed(value, hint) -> tuple[Any, str | None]:
    """(value as the field holds it, None) or (None, what is wrong). Numbers keep their own type
    (an int where a float is asked stays an int, as the YAML wrote it); lists become tuples."""
    args = typing.get_args(hint)
    if hint is Any:                    # a field that checks its own value (its problems())
        return value, None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if value is None and type(None) in args:
            return None, None
        (inner,) = [a for a in args if a is not type(None)]
        value, error = _typed(value, inner)
        return value, (f"{error} or null" if error else None)
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:     # tuple[T, ...]
        if not isinstance(value, (list, tuple)):
            return None, f"a list of {args[0].__name__}"
        checked = [_typed(v, args[0]) for v in value]
        if any(error for _, error in checked):
            return None, f"a list of {args[0].__name__}"
        return tuple(v for v, _ in checked), None
    if typing.get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return None, f"a list of {len(args)} ({', '.join(a.__name__ for a in args)})"
        checked = [_typed(v, a) for v, a in zip(value, args)]
        if any(error for _, error in checked):
            return None, f"a list of {len(args)} ({', '.join(a.__name__ for a in args)})"
        return tuple(v for v, _ in checked), None
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return (value, None) if ok else (None, "a number")
    if hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return (value, None) if ok else (None, "an integer")
    if hint is bool:
        return (value, None) if isinstance(value, bool) else (None, "true or false")
    if hint is str:
        return (value, None) if isinstance(value, str) else (None, "a string")
    raise TypeError(f"no check for fields of type {hint}")


def _checkpoint_config(path: str):
    """The transformers config of checkpoint `path` (config.json only, no weights), or what is wrong."""
    from transformers import AutoConfig

    from models.load import resolve

    where = resolve(path)
    if not (Path(where) / "config.json").is_file():
        return "no checkpoint there (a directory with config.json)"
    try:
        return AutoConfig.from_pretrained(where, trust_remote_code=False)
    except (OSError, ValueError) as e:
        return f"its config does not load ({str(e).splitlines()[0]})"


def _init_problems(init: str, model: str, config, rope_theta: float | None) -> list[str]:
    found = _checkpoint_config(init)
    if isinstance(found, str):
        return [f"init={init}: {found}"]
    a, b = found, config
    if (a.model_type, a.text_config.hidden_size, a.text_config.num_hidden_layers) != (
            b.model_type, b.text_config.hidden_size, b.text_config.num_hidden_layers):
        return [(f"init={init} is not a {model} checkpoint ({a.model_type}, "
                 f"{a.text_config.num_hidden_layers} layers of {a.text_config.hidden_size})")]
    theta = a.text_config.rope_parameters["rope_theta"]
    if rope_theta is not None and float(rope_theta) != theta:
        return [(f"rope_theta={rope_theta} but init={init} was trained with {theta:g}: "
                 "the rotary base is part of the checkpoint; leave rope_theta unset")]
    return []
