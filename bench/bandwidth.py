"""The device's copy bandwidth: what a step's memory floor divides its bytes by.

A step cannot stream its weights and cache faster than the device copies memory, so the floor of a
memory-bound step is its bytes over this. Measured after the clocks have risen (a copy timed first
thing after loading reads idle clocks, a third lower) and launched from the host, never replayed
from a CUDA graph: a graph turns a device-to-device copy into a memcpy node that the copy engines
run, a third slower than the kernel the host launch runs (2.76 against 4.14 TB/s on an H200),
which would set the floor below what the step's own kernels reach.
"""

from __future__ import annotations

import statistics
import time

import torch


def copy_bandwidth(device, repeats: int = 20, size: int = 2**30, warm_s: float = 0.5) -> float:
    """Bytes a second a device-to-device copy of `size` bytes moves, counting what it reads and
    what it writes (1/16 of the size on a CPU). The median of `repeats` timed copies."""
    cuda = torch.device(device).type == "cuda"
    size = size if cuda else size // 16
    source = torch.ones(size // 2, dtype=torch.bfloat16, device=device)
    target = torch.empty_like(source)
    until = time.perf_counter() + warm_s
    while time.perf_counter() < until:
        target.copy_(source)
    seconds = []
    for _ in range(max(3, repeats)):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            target.copy_(source)
            end.record()
            end.synchronize()
            seconds.append(begin.elapsed_time(end) / 1000)
        else:
            start = time.perf_counter()
            target.copy_(source)
            seconds.append(time.perf_counter() - start)
    return 2 * size / statistics.median(seconds)
