"""One loaded copy of each model per process, shared by the stages that use it (encode,
prefill and generate all run the same target weights).

    lm = get_model({"path": "zoo/weights/qwen-target", "dtype": "float32"}, device="cpu")
"""

from __future__ import annotations

import threading
from typing import Any

from models.load import load_model

_LOCK = threading.Lock()
_MODELS: dict[tuple, Any] = {}
SPEC_KEYS = ("path", "dtype", "device", "attn_implementation", "lean", "compile", "pack", "name", "fps", "size")


def model_key(spec: dict, device: str) -> tuple:
    return (spec["path"], spec.get("dtype") or "float32", spec.get("device") or device,
            spec.get("attn_implementation") or "sdpa", bool(spec.get("lean", True)), str(spec.get("compile") or "off"),
            spec.get("pack", "auto"))


def get_model(spec: dict, device: str = "cpu"):
    """The VideoLM for `spec` (a `model.target` / `model.draft` config entry), loaded on first use."""
    spec = dict(spec or {})
    if not spec.get("path"):
        raise ValueError("no model path: set model.target.path (or choose a model config: model=toy_qwen)")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown model keys {unknown}; a model entry takes {', '.join(SPEC_KEYS)}")
    key = model_key(spec, device)
    with _LOCK:
        if key not in _MODELS:
            _MODELS[key] = load_model(key[0], dtype=key[1], device=key[2], attn_implementation=key[3],
                                      lean=key[4], compile=key[5], pack=key[6], name=spec.get("name"))
        return _MODELS[key]


def release_all() -> None:
    """Drop every loaded model (tests; a long-lived process switching models)."""
    with _LOCK:
        _MODELS.clear()
