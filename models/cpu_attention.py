"""Attention of a few query rows over a cached prefix on the CPU, by reelflow's C++ kernel
(models/csrc/prefix_attention.cpp), returning the softmax's log-sum-exp beside the output so the
compiled steps merge it with the new tokens' part (models.compiled_step.split_attention).

    if cpu_attention.serves(lean.head_dim, dtype, device):     # builds the CPU kernels once per machine and environment
        out, lse = cpu_attention.prefix_attention(q, keys, values, scaling)
            q [KV, R, hd] (the rows grouped by the KV head they read); keys, values [KV, L, hd]
            (a cache buffer's view is read in place) -> out float32 [KV, R, hd], lse float32 [KV, R]

Why: as two matrix products with a softmax between, a one-token step's attention over 1,091
cached entries took 80-90 µs a layer on an AMD EPYC core, at about a quarter of the rate its
cache's bytes stream from the core's caches; the kernel streams each split of the prefix once per
4 query rows and keeps the softmax's running maximum and sum in registers (33-40 µs). For a dozen
rows or more the core's arithmetic bounds both ways alike; above 24 rows a KV head the kernel takes
MKL's products itself, with one vectorised softmax pass between them.

It sums in another order than the products do: a float32 rounding apart from them, as the compiled
steps already are from the eager path (the exact reference). Up to 24 rows the results do not
depend on the thread count (the prefix's splits are fixed in size); MKL's products above may.
"""

from __future__ import annotations

import functools

import torch

HEAD_SIZES = (16, 32, 64, 128)          # what the kernel is built for (its vector loops are unrolled per size)


@functools.cache
def _register_shape() -> None:
    """The operator's shape function, for torch.compile's tracing (once the kernel is loaded)."""
    torch.library.register_fake("reelflow_cpu::prefix_attention")(_shape)


def _shape(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2])


def serves(head_dim: int, dtype: torch.dtype, device) -> bool:
    """Whether the kernel serves a model of this head size, dtype and device: float32 on the CPU, a
    head size it is built for, and the kernels built here (models.cpu_kernels builds them on the
    first call)."""
    if torch.device(device).type != "cpu" or dtype != torch.float32 or head_dim not in HEAD_SIZES:
        return False
    from models import cpu_kernels

    if not cpu_kernels.available():
        return False
    _register_shape()
    return True


def prefix_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module doc (call `serves` first: it loads the operator)."""
    return torch.ops.reelflow_cpu.prefix_attention(q, keys, values, scaling)
