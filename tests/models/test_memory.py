"""models/memory.py on a CPU: the peak of the tensors a block creates, without what it keeps."""

from __future__ import annotations

import torch

from models.memory import PeakMemory


def test_transient_tensors_count_and_kept_ones_do_not():
    with PeakMemory() as probe:
        a = torch.ones(1000, 1000)           # 4 MB
        b = a * 2                             # 4 MB more while a lives
        del a
        total = b.sum()
        del b
    assert abs(probe.peak_bytes - 8_000_000) <= 64     # (the 4-byte sum it returns is kept, so not counted)
    with PeakMemory() as probe:
        kept = torch.ones(1000, 1000)
    assert probe.peak_bytes == 0 and kept.numel() and total > 0


def test_a_view_keeps_its_storage_counted():
    with PeakMemory() as probe:
        base = torch.ones(1000, 1000)
        view = base[:10]
        del base
        torch.ones(250, 1000)                 # 1 MB more while the 4 MB storage lives through the view
        del view
    assert probe.peak_bytes >= 5_000_000


def test_a_bigger_group_needs_more_memory():
    weight = torch.randn(256, 1024)
    peaks = []
    for n in (16, 64, 256):
        x = torch.randn(n, 256)
        with PeakMemory() as probe:
            torch.relu(x @ weight).sum()
        peaks.append(probe.peak_bytes)
    assert peaks[0] < peaks[1] < peaks[2] and peaks[2] >= 256 * 1024 * 4
