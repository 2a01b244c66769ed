"""How much memory a piece of work needs above what was already held: the peak of a block.

    with PeakMemory(device) as probe:
        lm.prefill(cache, embeds, positions)
    probe.peak_bytes        # most bytes held at once inside the block, minus those held before

On a CUDA device this is the allocator's own peak (`max_memory_allocated`, reset on entry). On a
CPU it is the process's resident-set high-water mark, reset on entry through
/proc/self/clear_refs (Linux ≥ 4.0): it also counts what other threads allocate meanwhile and
what the C allocator keeps after a free, so it is a bound, best read as a comparison between
runs of one process shape. Elsewhere `peak_bytes` is None.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _rss_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


class PeakMemory:
    def __init__(self, device=None):
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.device = device
        self.peak_bytes: int | None = None
        self._base = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            _CLEAR_REFS.write_text("5")       # 5: reset the peak RSS to the current RSS
            self._base = _rss_kib("VmRSS")
        except OSError:
            self._base = None
        return self

    def __exit__(self, *exc) -> None:
        if self._base is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
        else:
            peak = _rss_kib("VmHWM")
            self.peak_bytes = None if peak is None else max(0, peak - self._base) * 1024
