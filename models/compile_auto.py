"""`compile: auto`: whichever of the eager lean path and the compiled ones steps fastest for a
model on this machine, measured once and remembered. On the CPU the candidates are the eager path
and inductor's default; on a GPU also the two CUDA-graph modes (models.captured_step).

    mode = choose_mode(lm, key)        # e.g. "default" or "off"; key: checkpoint, dtype, device, threads, torch
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from models.steps import CAPTURED, build_step

log = logging.getLogger("reelflow.models")

CHOICES_FILE = "compile-choices.json"       # under the cache dir: what `auto` chose per model and device


def cache_dir() -> Path:
    """reelflow's own cache ($REELFLOW_CACHE, else ~/.cache/reelflow)."""
    return Path(os.environ.get("REELFLOW_CACHE") or Path.home() / ".cache" / "reelflow")


def choose_mode(lm, key: str, *, cached: int = 1024, rounds: int = 20) -> str:
    """`compile: auto`: the candidate (candidates()) that steps fastest for `lm` on its device, measured
    once (one-token steps and 8-token verifications over a `cached`-entry cache, the two paths
    interleaved, medians) and remembered in the cache dir under `key` (model, dtype, device, torch
    version), so later runs only read the choice."""
    return remembered(CHOICES_FILE, key, "mode", lambda: measure_modes(lm, cached=cached, rounds=rounds),
                      "compile auto", "a step and an 8-token verification", extra={"cached": cached})


def remembered(file: str, key: str, field: str, measure, what: str, timed: str, extra: dict | None = None):
    """The choice stored under `key` in the cache dir's `file` (its `field`), else the fastest of
    measure() -> {choice: ms}, stored there so that later runs read it: a choice that changed from
    run to run would change the numbers a run computes (kernels sum in other orders)."""
    where = cache_dir() / file
    try:
        choices = json.loads(where.read_text())
    except (OSError, ValueError):
        choices = {}
    if key in choices:
        return choices[key][field]
    timings = measure()
    choice = min(timings, key=timings.get)
    choices[key] = {field: choice, "ms": {str(m): round(t, 3) for m, t in timings.items()}, **(extra or {})}
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(choices, indent=1))
        tmp.replace(where)            # atomic; of two processes measuring at once, one's choice is kept
    except OSError as e:                       # a read-only home: choose again next time
        tmp.unlink(missing_ok=True)
        log.warning("%s: could not remember the choice in %s (%s)", what, where, e)
    log.info("%s for %s: %s (%s, ms: %s)", what, key, choice, timed,
             ", ".join(f"{m} {t:.2f}" for m, t in timings.items()))
    return choice


def candidates(device) -> tuple[str, ...]:
    """The settings `auto` chooses among on `device`."""
    return ("off", "default") + (CAPTURED if torch.device(device).type == "cuda" else ())


@torch.inference_mode()
def measure_modes(lm, *, cached: int, rounds: int) -> dict[str, float]:
    """Milliseconds of a one-token step plus an 8-token verification over a `cached`-entry cache
    of random states, for each candidate setting, interleaved call by call."""
    from models.cache import growing_cache

    lean = lm.lean
    steps = {"off": None}
    for mode in candidates(lm.device)[1:]:      # compiled here, the step load_model then builds reuses the compile
        steps[mode] = build_step(lean, mode)
        steps[mode].warm(lm.device, lm.dtype, name=f"{lm.name} (auto)")
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = lean.layers[0].q.shape[1]
    cache = growing_cache(lm.text_config)
    lean.forward(cache, torch.randn(cached, hidden, generator=g).to(lm.device, lm.dtype), torch.arange(cached))
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    try:
        for _ in range(rounds + 2):           # both paths call by call; the first two rounds untimed
            for mode in times:
                lean.step = steps[mode]
                t0 = time.perf_counter()
                for n in (1, 8):              # a step, an 8-token verification, each rolled back
                    lean.forward(cache, torch.randn(n, hidden, generator=g).to(lm.device, lm.dtype),
                                 torch.arange(cached, cached + n))
                    cache.crop(-n)            # transformers 5: a negative count of entries to drop
                if lm.device.type == "cuda":
                    torch.cuda.synchronize(lm.device)
                times[mode].append(time.perf_counter() - t0)
    finally:
        lean.step = None
    return {mode: 1000 * statistics.median(t[2:]) for mode, t in times.items()}
