"""Resources: CPU pools and GPU streams, as declared by `conf/resources/*.yaml`.

    cores: auto                      # cores reelflow may use (auto: this process's affinity)
    strict: false                    # true: a GPU stream without CUDA is an error, not a fallback
    pools:
      cpu:    {kind: thread,  workers: 1, torch_threads: auto}
      decode: {kind: process, workers: 2, torch_threads: 1}
      draft:  {kind: process, workers: 1, torch_threads: 1, affinity: [1]}   # pinned to core 1
      draft:  {kind: process, workers: 1, torch_threads: 1, device: cuda:0}   # or: a process on a GPU
    streams:
      target: {device: cuda:0, priority: 0}

Without CUDA a stream becomes a one-worker CPU thread pool and a process pool on a GPU a CPU one;
that is logged once per process (resources.strict=true makes it an error).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf

from graph.spec import ConfigError

log = logging.getLogger(__name__)
_fallback_logged = False


@dataclass(frozen=True)
class Resource:
    name: str
    kind: str                 # thread | process | stream
    workers: int
    torch_threads: int | str  # an int, or "auto" until the schedule fixes it
    device: str = "cpu"
    priority: int = 0
    note: str = ""
    fallback_from: str | None = None  # the CUDA device a stream asked for, when it runs on CPU
    affinity: tuple[int, ...] | None = None  # the cores the pool's workers run on (None: any)

    @property
    def is_gpu(self) -> bool:
        """A CUDA stream, or a process pool whose processes work on a CUDA device."""
        return self.kind == "stream" or self.device.startswith("cuda")


def _named(device: str) -> str:
    """"cuda" as "cuda:0": torch.cuda.set_device, which a worker calls, takes only a numbered one."""
    return "cuda:0" if device == "cuda" else device


def _cuda_index(device: str) -> int:
    """The device number in "cuda:N" ("cuda" alone: 0)."""
    return int(device.split(":")[1]) if ":" in device else 0


def cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def allowed_cores() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:
        return set(range(os.cpu_count() or 1))


def pin_to(cores: tuple[int, ...] | None) -> None:
    """Run the calling thread (on Linux, a thread's affinity is its own), and the threads it
    starts, on `cores` only; None leaves it where it may run."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def load_resources(cfg: Any, n_cuda: int | None = None) -> tuple[dict[str, Resource], int, bool]:
    """Parse a resources config. Returns (resources by name, cores, strict)."""
    global _fallback_logged
    if isinstance(cfg, DictConfig):
        cfg = OmegaConf.to_container(cfg, resolve=True)
    cfg = dict(cfg or {})
    n_cuda = cuda_devices() if n_cuda is None else n_cuda
    cores = cfg.get("cores", "auto")
    cores = available_cores() if cores in (None, "auto") else int(cores)
    strict = bool(cfg.get("strict", False))
    problems: list[str] = []
    out: dict[str, Resource] = {}
    fallen: list[str] = []                    # GPU resources this machine lacks: run on its CPU

    for name, pool in (cfg.get("pools") or {}).items():
        pool = dict(pool or {})
        kind = pool.get("kind", "thread")
        if kind not in ("thread", "process"):
            problems.append(f"resource '{name}': kind '{kind}' is not thread or process. Fix: resources.pools.{name}.kind=thread")
            continue
        workers = pool.get("workers", 1)
        workers = cores if workers in (None, "auto") else int(workers)
        if workers < 1:
            problems.append(f"resource '{name}': workers={workers}; a pool needs at least one. Fix: resources.pools.{name}.workers=1")
            continue
        threads = pool.get("torch_threads", "auto")
        if threads == "elastic" and kind != "thread":
            problems.append(f"resource '{name}': torch_threads=elastic is for thread pools (a process keeps its "
                            f"count). Fix: resources.pools.{name}.torch_threads=auto")
            continue
        affinity = pool.get("affinity")
        if affinity is not None:
            allowed = allowed_cores()
            affinity = tuple(int(c) for c in (affinity if isinstance(affinity, (list, tuple)) else [affinity]))
            if not affinity or not set(affinity) <= allowed:
                problems.append(f"resource '{name}': affinity={list(affinity)}, but this process may run on cores "
                                f"{sorted(allowed)}. Fix: resources.pools.{name}.affinity=null, or cores from that list")
                continue
        threads = threads if threads in ("auto", "elastic") else int(threads)
        device = _named(str(pool.get("device") or "cpu"))
        if device != "cpu":
            if kind != "process" or not device.startswith("cuda"):
                problems.append(f"resource '{name}': device={device} on a {kind} pool. A pool's device is the CPU, "
                                f"or cuda:N for a process pool (its processes then work on that GPU); a thread's "
                                f"GPU work is a stream. Fix: resources.streams.{name}.device={device}, or "
                                f"resources.pools.{name}.kind=process")
                continue
            if _cuda_index(device) >= n_cuda:
                fallen.append(f"{name} ({device})")
                out[name] = Resource(name, kind, workers, threads, affinity=affinity,
                                     note=f"no {device}: CPU processes", fallback_from=device)
                continue
        out[name] = Resource(name, kind, workers, threads, device=device, affinity=affinity)

    for name, stream in (cfg.get("streams") or {}).items():
        stream = dict(stream or {})
        device = _named(str(stream.get("device", "cuda:0")))
        index = _cuda_index(device)
        if name in out:
            problems.append(f"resource '{name}' is declared both as a pool and as a stream; rename one.")
            continue
        if device.startswith("cuda") and index < n_cuda:
            out[name] = Resource(name, "stream", 1, 1, device=device, priority=int(stream.get("priority", 0)))
        else:
            fallen.append(f"{name} ({device})")
            out[name] = Resource(name, "thread", 1, "auto", device="cpu", priority=int(stream.get("priority", 0)),
                                 note=f"no {device}: CPU worker", fallback_from=device)
    if problems:
        raise ConfigError(problems)
    if fallen and not strict and not _fallback_logged:
        log.warning("no CUDA device for GPU resources %s: they run as CPU workers", ", ".join(fallen))
        _fallback_logged = True
    return out, cores, strict


def strict_gpu_problems(placements: Mapping[str, str], resources: Mapping[str, Resource]) -> list[str]:
    """Nodes placed on a fallen-back GPU stream while resources.strict=true."""
    problems = []
    for node, res_name in placements.items():
        res = resources.get(res_name)
        if res is not None and res.fallback_from:
            problems.append(
                f"node '{node}' is on GPU resource '{res_name}' ({res.fallback_from}) but this machine has "
                f"no such CUDA device and resources.strict=true. Fix: resources=cpu, or resources.strict=false to "
                "run GPU resources as CPU workers."
            )
    return problems
