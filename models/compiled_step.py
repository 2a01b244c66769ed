"""The lean step as one function of fixed roles, for torch.compile: the cached prefix goes in
read-only, the new tokens' keys and values come out, and the caller appends them to the cache.

    step = CompiledStep(lean, mode="default")                 # models.lean.LeanDecoder
    hidden, new_k, new_v = step(embeds, cos, sin, prefix_k, prefix_v, mask)
        embeds [n, hidden]; cos, sin [n, head_dim] (the rotary rows of the n positions);
        prefix_k, prefix_v: each layer's cached keys and values [kv_heads, L_l, head_dim];
        mask bool [n, n]: which new tokens each new token sees (causal, or a tree's ancestors)
        -> final-norm hidden [n, hidden], new keys and values [layers, kv_heads, n, head_dim]

Why this shape: a compiled function that writes into a cache buffer it captured has the write
functionalised, and the whole buffer is copied on every call (on 2 CPU cores a compiled toy step
that wrote its cache took 14-16 ms against 2.6 eager; written by the caller, 1.7 ms).

Attention is split in two and merged by log-sum-exp: the prefix with no mask at all, the new tokens
among themselves with their small mask. No mask of new tokens × context is ever built, and the
prefix stays read-only. Its results differ from the eager lean path (models.lean, the exact
reference) by float32 rounding: the same terms, summed in another order.

Compiled with dynamic shapes, so one compile serves every cache length and every number of new
tokens above one (torch specialises a dimension of size 1, so a one-token step is a second
compile); inductor's on-disk cache spares later processes most of the compile time.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger("reelflow.models")
_RECORDS: list[dict] = []          # what this process compiled: {what, mode, seconds, at}
_RECORDS_LOCK = threading.Lock()


def record_compile(what: str, mode: str, seconds: float) -> None:
    """Note a compile (its warm-up calls) for the run's metrics and plan.txt (compile_records)."""
    with _RECORDS_LOCK:
        _RECORDS.append({"what": what, "mode": mode, "seconds": round(seconds, 3), "at": time.time()})
    log.info("compiled %s (%s) in %.1f s", what, mode, seconds)


def compile_records(since: float = 0.0) -> list[dict]:
    """The compiles this process made since the time.time() `since`: {what, mode, seconds}."""
    with _RECORDS_LOCK:
        return [{k: r[k] for k in ("what", "mode", "seconds")} for r in _RECORDS if r["at"] >= since]

MODES = ("off", "default", "max-autotune-no-cudagraphs")   # model.<role>.compile, besides "auto" (choose_mode)
SETTINGS = ("auto",) + MODES


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [H, n, hd]; k, v [KV, m, hd] (the new tokens', m ≥ n when rows drafted earlier come
    first); keys, values [KV, L, hd] (the cached prefix, L ≥ 1, every entry seen); mask bool
    [n, m]: which of the m each query sees (each sees at least itself). Heads grouped as
    transformers' repeat_kv lays them out. -> [n, H * hd], softmax in float32."""
    heads, n, hd = q.shape
    kv, m = k.shape[0], k.shape[1]
    group = heads // kv
    qg = q.reshape(kv, group * n, hd)
    prefix = torch.matmul(qg, keys.transpose(-1, -2)).float() * scaling                  # [KV, G*n, L]
    new = (torch.matmul(qg, k.transpose(-1, -2)).float() * scaling).view(kv, group, n, m)
    new = new.masked_fill(~mask, float("-inf")).view(kv, group * n, m)                   # [KV, G*n, m]
    top = torch.maximum(prefix.amax(-1, keepdim=True), new.amax(-1, keepdim=True))     # [KV, G*n, 1]
    p_prefix, p_new = (prefix - top).exp(), (new - top).exp()
    total = p_prefix.sum(-1, keepdim=True) + p_new.sum(-1, keepdim=True)
    out = (torch.matmul(p_prefix.to(values.dtype), values).float()
           + torch.matmul(p_new.to(v.dtype), v).float()) / total                         # [KV, G*n, hd]
    return out.to(q.dtype).view(kv, group, n, hd).reshape(heads, n, hd).transpose(0, 1).reshape(n, heads * hd)


def layers_step(lean, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, prefix_k: list, prefix_v: list,
                mask: torch.Tensor):
    """The decoder layers of `lean` (models.lean.LeanDecoder.run_layers) over the new tokens, with
    split_attention over the given prefix, collecting the new keys and values. See the module doc."""
    new_k, new_v = [], []

    def attend(i, q, k, v):
        new_k.append(k)
        new_v.append(v)
        return split_attention(q, k, v, prefix_k[i], prefix_v[i], mask, lean.scaling)

    hidden = lean.run_layers(embeds, cos, sin, attend)
    return hidden, torch.stack(new_k), torch.stack(new_v)


def thread_counts(device) -> tuple[int, ...]:
    """The torch thread counts a compiled function is warmed for: the one set now and, on the CPU,
    every core of the process (an elastic pool, graph.pools, moves a worker between the two).
    torch.compile guards on the thread count: a call at a count it has not seen compiles again."""
    now = torch.get_num_threads()
    if torch.device(device).type != "cpu":
        return (now,)
    return tuple(sorted({now, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}))


def call_at_warmed_threads(fn, counts: tuple[int, ...], *args, **kwargs):
    """fn(*args, **kwargs) at the largest warmed thread count not above the current one (the
    smallest when all are above), so that a compiled function is never compiled again mid-run."""
    now = torch.get_num_threads()
    use = max((c for c in counts if c <= now), default=counts[0])
    if use == now:
        return fn(*args, **kwargs)
    torch.set_num_threads(use)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(now)


class CompiledStep:
    """layers_step for one LeanDecoder, through torch.compile in `mode` (MODES, "off" excluded)."""

    def __init__(self, lean, mode: str = "default"):
        if mode not in MODES or mode == "off":
            raise ValueError(f"compile={mode!r}: one of {', '.join(MODES)}")
        self.lean, self.mode = lean, mode
        self._fn = torch.compile(layers_step, dynamic=True, mode=None if mode == "default" else mode)
        self.threads: tuple[int, ...] = (torch.get_num_threads(),)       # what warm compiled for

    def __call__(self, embeds, cos, sin, prefix_k, prefix_v, mask):
        return call_at_warmed_threads(self._fn, self.threads, self.lean, embeds, cos, sin, prefix_k, prefix_v, mask)

    @torch.inference_mode()
    def warm(self, device, dtype, name: str = "step") -> float:
        """Compile now what a run calls (a one-token step; several tokens, one compile for every
        count above one) over a dummy prefix, so that no request pays for it. Returns the seconds."""
        lean, t0 = self.lean, time.perf_counter()
        self.threads, now = thread_counts(device), torch.get_num_threads()
        hidden = lean.layers[0].q.shape[1]
        # laid out as the cache's are (models.cache: views of buffers with spare room), or the
        # first request would recompile on the prefix's strides
        prefix_k, prefix_v = ([torch.zeros(1, lean.n_kv_heads, 8, lean.head_dim, device=device, dtype=dtype)[0, :, :3]
                               for _ in lean.layers] for _ in range(2))
        try:
            for threads in self.threads:
                torch.set_num_threads(threads)
                for n in (1, 2):
                    self._fn(lean, torch.zeros(n, hidden, device=device, dtype=dtype),
                             torch.ones(n, lean.head_dim, device=device, dtype=dtype),
                             torch.zeros(n, lean.head_dim, device=device, dtype=dtype), prefix_k, prefix_v,
                             torch.ones(n, n, dtype=torch.bool, device=device).tril())
        finally:
            torch.set_num_threads(now)
        seconds = time.perf_counter() - t0
        record_compile(f"{name} lean step, {'/'.join(map(str, self.threads))} threads", self.mode, seconds)
        return seconds


# ---------------------------------------------------------------------------- compile: auto

CHOICES_FILE = "compile-choices.json"       # under the cache dir: what `auto` chose per model and device


def cache_dir() -> Path:
    """reelflow's own cache ($REELFLOW_CACHE, else ~/.cache/reelflow)."""
    return Path(os.environ.get("REELFLOW_CACHE") or Path.home() / ".cache" / "reelflow")


def choose_mode(lm, key: str, *, cached: int = 1024, rounds: int = 20) -> str:
    """`compile: auto`: "default" or "off", whichever steps faster for `lm` on its device, measured
    once (one-token steps and 8-token verifications over a `cached`-entry cache, the two paths
    interleaved, medians) and remembered in the cache dir under `key` (model, dtype, device, torch
    version), so later runs only read the choice."""
    where = cache_dir() / CHOICES_FILE
    try:
        choices = json.loads(where.read_text())
    except (OSError, ValueError):
        choices = {}
    if key in choices:
        return choices[key]["mode"]
    timings = measure_modes(lm, cached=cached, rounds=rounds)
    mode = min(timings, key=timings.get)
    choices[key] = {"mode": mode, "ms": {m: round(t, 3) for m, t in timings.items()}, "cached": cached}
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = where.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choices, indent=1))
        tmp.replace(where)
    except OSError as e:                       # a read-only home: choose again next time
        log.warning("compile auto: could not remember the choice in %s (%s)", where, e)
    log.info("compile auto for %s: %s (a step and an 8-token verification, ms: %s)", key, mode,
             ", ".join(f"{m} {t:.2f}" for m, t in timings.items()))
    return mode


@torch.inference_mode()
def measure_modes(lm, *, cached: int, rounds: int) -> dict[str, float]:
    """Milliseconds of a one-token step plus an 8-token verification over a `cached`-entry cache
    of random states, eager ("off") and compiled ("default"), interleaved call by call."""
    from models.cache import growing_cache

    lean = lm.lean
    compiled = CompiledStep(lean, "default")
    compiled.warm(lm.device, lm.dtype, name=f"{lm.name} (auto)")
    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = lean.layers[0].q.shape[1]
    cache = growing_cache(lm.text_config)
    lean.forward(cache, torch.randn(cached, hidden, generator=g).to(lm.device, lm.dtype), torch.arange(cached))
    times: dict[str, list[float]] = {"off": [], "default": []}
    for _ in range(rounds + 2):
        for mode in times:
            lean.step = compiled if mode == "default" else None
            t0 = time.perf_counter()
            for n in (1, 8):
                lean.forward(cache, torch.randn(n, hidden, generator=g).to(lm.device, lm.dtype),
                             torch.arange(cached, cached + n))
                cache.crop(-n)                 # transformers 5: a negative count of entries to drop
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)
            times[mode].append(time.perf_counter() - t0)
    lean.step = None
    return {mode: 1000 * statistics.median(t[2:]) for mode, t in times.items()}
