"""models.matrix_rate: the probe's product is the arithmetic it claims, and the CPU rate is taken on
every core without changing the calling worker's own thread count."""

import os

import torch
from torch.utils.flop_counter import FlopCounterMode

from models.matrix_rate import matmul_probe, matrix_rate


def test_the_probe_does_the_flops_it_reports():
    run, flops = matmul_probe("cpu", torch.float32)
    with FlopCounterMode(display=False) as counter:
        run()
    assert counter.get_total_flops() == flops == 2 * 1024**3


def test_the_cpu_rate_uses_every_core_and_gives_the_worker_its_threads_back(monkeypatch):
    seen = []
    real = torch.matmul

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "matmul", spy)
    matrix_rate.cache_clear()                  # timed once a process: this test's own timing
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert matrix_rate("cpu", torch.float32, seconds=0, at_least=2) > 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen == [len(os.sched_getaffinity(0))] * 3       # the untimed product and two timed ones
    assert matrix_rate("cpu", torch.float32, seconds=0, at_least=2) > 0 and len(seen) == 3   # the same rate again
