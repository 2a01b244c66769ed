"""How much memory a piece of work needs above what was already held: the peak of a block.

    with PeakMemory(device) as probe:
        lm.prefill(cache, embeds, positions)
    probe.peak_bytes        # most bytes held at once inside the block, minus those held before

On a CUDA device this is the allocator's own peak (`max_memory_allocated`, reset on entry). On a
CPU, where torch keeps no allocator statistics, it counts tensors: every storage an operation
creates inside the block is tracked (a weak reference: it counts while anything, a view
included, keeps it alive), and the peak of their sum is taken after each operation. Storages still
alive at the end (what the block returns or stores, like new cache entries) are not part of the
peak, so what it reports is the work's transient memory: its activations. Exact, but every torch
operation in the block pays a Python call, so it is for measuring runs, not timed ones.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveStorages(TorchDispatchMode):
    """Sums the bytes of the storages created inside the mode that are still alive."""

    def __init__(self):
        super().__init__()
        self.tracked: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.tracked:
                    self.tracked[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        for key in [k for k, (ref, _) in self.tracked.items() if ref.expired()]:
            del self.tracked[key]
        return sum(n for _, n in self.tracked.values())


class PeakMemory:
    def __init__(self, device=None):
        self.cuda = torch.device(device or "cpu").type == "cuda"
        self.device = device
        self.peak_bytes: int | None = None
        self._base = None
        self._mode: _LiveStorages | None = None

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = max(0, torch.cuda.max_memory_allocated(self.device) - self._base)
            return
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)
        self.peak_bytes = max(0, mode.peak - mode.live())
