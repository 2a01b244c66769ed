"""zoo.train.device: the device a config names, refused when this machine lacks it, and the batch
makers' count by device."""

import os

import pytest
import torch

from zoo.train.device import loader_workers_for, resolve_device


def test_the_device_is_resolved_and_a_missing_gpu_is_refused(monkeypatch):
    gpu = torch.cuda.is_available()
    assert resolve_device("auto") == torch.device("cuda" if gpu else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not gpu:
        with pytest.raises(ValueError, match="device='cuda'.*no GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device='cuda:99'"):
        resolve_device("cuda:99")
    for bad in ("bogus", "mps", "meta"):
        with pytest.raises(ValueError, match=f"device='{bad}': auto, cpu, cuda or cuda:N"):
            resolve_device(bad)
    assert loader_workers_for(torch.device("cpu"), None) == 1 and loader_workers_for(torch.device("cpu"), 0) == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert loader_workers_for(torch.device("cuda"), None) == 14 and loader_workers_for(torch.device("cuda"), 3) == 3
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="loader_workers="):
            loader_workers_for(torch.device("cpu"), bad)
