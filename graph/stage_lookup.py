"""A node's stage, found from its config without building it: a preset name or a `_target_` block
becomes the stage class, its constructor bound to the config's kwargs. Each problem is appended
to the caller's list with the closest names that exist (presets, stage classes, kwargs)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, ListConfig, OmegaConf

from graph.stage import is_stage_class

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
HYDRA_KEYS = {"_target_", "_partial_", "_convert_", "_recursive_", "_args_"}
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


def plain_data(cfg: Any) -> Any:
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg


def resolve_stage_cfg(name: str, raw: Any, problems: list[str]) -> dict | None:
    """A node's `stage:` (a preset name or a `_target_` block) -> its `_target_` block, as plain data."""
    if isinstance(raw, str):
        presets = stage_presets()
        if raw not in presets:
            close = difflib.get_close_matches(raw, presets, n=3)
            problems.append(
                f"node '{name}': unknown stage preset '{raw}'. Fix: use one of "
                f"{', '.join(close or sorted(presets))} (files under conf/stage/), or a `_target_` block."
            )
            return None
        raw = plain_data(OmegaConf.load(presets[raw]))
        if isinstance(raw, dict) and len(raw) == 1 and "_target_" not in raw and isinstance(next(iter(raw.values())), dict):
            raw = next(iter(raw.values()))  # tolerate a preset written under a package key
    if not isinstance(raw, Mapping) or "_target_" not in raw:
        problems.append(
            f"node '{name}': `stage` must be a `_target_` block or a preset name, got {raw!r}. "
            f"Fix: graph.nodes.{name}.stage={{_target_: stages.<kind>.<Class>, ...}}"
        )
        return None
    return dict(raw)


def stage_class(name: str, cfg: dict, problems: list[str]) -> type | None:
    """The stage class a `_target_` block names, if it is a stage whose constructor takes the block's kwargs."""
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

