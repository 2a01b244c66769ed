"""Where training runs: the device a config names and the processes that make its batches. A leaf
of zoo.train, so the config can check a device before the loop is imported."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str) -> torch.device:
    """The device `device` names: "auto" (the GPU when CUDA has one, else the CPU), "cpu", "cuda" or
    "cuda:N". A ValueError naming the setting for anything else, or for a GPU this machine lacks."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: auto, cpu, cuda or cuda:N")
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: CUDA has no GPU here (torch {torch.__version__}); "
                             "use device=cpu, or auto")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: this machine has GPUs 0..{torch.cuda.device_count() - 1}")
    return resolved


def loader_workers_for(device: torch.device, loader_workers: int | None) -> int:
    """The DataLoader processes that make batches: `loader_workers`, or by default 1 on the CPU (the
    training itself needs the cores) and on a GPU all cores but two (the training loop and the
    pinning thread): rendering a batch, more so through H.264, can take longer than a toy model's
    step on a GPU."""
    if loader_workers is None:
        if device.type == "cpu":
            return 1
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(16, cores - 2))
    if isinstance(loader_workers, bool) or not isinstance(loader_workers, int) or loader_workers < 0:
        raise ValueError(f"loader_workers={loader_workers!r}: the processes making batches, an int >= 0 "
                         "(0: in the training process), or null for the device's default")
    return loader_workers
