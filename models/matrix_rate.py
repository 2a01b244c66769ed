"""The rate a device multiplies matrices at, in a dtype: the yardstick a forward's arithmetic is
set against (a forward's FLOPs over its time, as a share of this rate; bench_step's arithmetic
floor, bench_quickvideo's vision-tower and prefill shares).

    run, flops = matmul_probe(device, dtype)      # one product, to time beside other work
    rate = matrix_rate(device, dtype)             # FLOP/s: the best of a few timed products
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Callable

import torch


def matmul_probe(device, dtype) -> tuple[Callable[[], torch.Tensor], int]:
    """A square matrix product in `dtype`, large enough to run at the device's matrix rate (1,024
    a side on a CPU, 8,192 on a GPU), and its floating-point operations."""
    side = 8192 if torch.device(device).type == "cuda" else 1024
    a, b = (torch.randn(side, side, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(side, side, device=device, dtype=dtype)
    return functools.partial(torch.matmul, a, b, out=out), 2 * side**3


@functools.lru_cache(maxsize=None)
def matrix_rate(device, dtype, seconds: float = 0.5, at_least: int = 10) -> float:
    """FLOP/s of the probe's product on `device` in `dtype`: the fastest of the products timed
    over `seconds` (and at least `at_least` of them) after an untimed one. The fastest is the most
    the device gave, so a share of it is not flattered by a slow probe, and half a second of them
    outlasts a moment of other work (a worker process starting beside a CPU probe). On a CPU the
    device is every core the calling thread may use (a pinned worker's own): the products run on
    that many torch threads, whatever the worker's own count (restored after), so a stage's share
    says how much of those cores its arithmetic used. Timed once a process for each device and
    dtype: every executor a job builds reads the same yardstick."""
    run, flops = matmul_probe(device, dtype)
    cuda = torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    threads = torch.get_num_threads()
    if not cuda:
        torch.set_num_threads(_usable_cores())
    try:
        run()
        sync()
        best, timed, start = math.inf, 0, time.perf_counter()
        while timed < at_least or time.perf_counter() - start < seconds:
            t0 = time.perf_counter()
            run()
            sync()
            best, timed = min(best, time.perf_counter() - t0), timed + 1
    finally:
        torch.set_num_threads(threads)
    return flops / best


def _usable_cores() -> int:
    """Cores the calling thread may run on (every core where the platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:          # macOS, Windows
        return os.cpu_count() or 1
