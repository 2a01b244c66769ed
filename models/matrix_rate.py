"""The rate a device multiplies matrices at, in a dtype: the yardstick a forward's arithmetic is
set against (a forward's FLOPs over its time, as a share of this rate; bench_step's arithmetic
floor, bench_quickvideo's vision-tower and prefill shares).

    run, flops = matmul_probe(device, dtype)      # one product, to time beside other work
    rate = matrix_rate(device, dtype)             # FLOP/s: the best of a few timed products
"""

from __future__ import annotations

import functools
import math
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


def matrix_rate(device, dtype, repeats: int = 10) -> float:
    """FLOP/s of the probe's product on `device` in `dtype`, with the calling thread's torch
    threads: the fastest of `repeats` timed products after an untimed one (the most the device
    gave, so a share of it is not flattered by a slow probe)."""
    run, flops = matmul_probe(device, dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    run()
    sync()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
    return flops / best
