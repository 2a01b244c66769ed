"""Weights in column tiles for products of a few rows on the CPU, and the kernel that reads them.

    if tiled.available():                      # builds reelflow's CPU kernels once per environment (models.cpu_kernels)
        tiles = tiled.tile(w)                  # w [K, N] -> [ceil(N / 32), K, 32]
        out = tiled.product(x, tiles, bias, n) # x [rows, K] -> x · w + bias, [rows, N]

Why: a decode step multiplies one row, a verification or a tree a few dozen, by each weight. MKL
takes such a product as a general matrix product: on an AMD EPYC core it streamed a [256, 1536]
weight at 22 GB/s for one row and 7 GB/s for eight (33 GFLOP/s of its 80). The kernel here
(models/csrc/tiled_mm.cpp) keeps each 32-column tile's sums for up to 8 rows in vector registers
while the tile streams through once, contiguous: one row ran at 37-52 GB/s there, five rows cost
what one did, and eight or more rows ran at 80-90 GFLOP/s, the core's arithmetic peak.

Weights that are bfloat16 values exactly (a bfloat16 checkpoint loaded in float32) are tiled in
bfloat16 and widened in registers: the same products, bit for bit, from half the bytes.

The tiles are a copy beside the model's own weights (which prefill and the eager path keep
reading), so `pack: tiled` holds the decoder layers' weights twice; models.load's `pack: auto`
takes it only where it measures faster and the copy fits in half of the free memory. The kernel is a torch operator
(`torch.ops.reelflow_tiled.tiled_mm`) with a shape function, so torch.compile calls it from a
compiled step as it calls MKL (models.cpu_kernels builds it). It sums each output over K in
order, a float32 rounding apart from MKL's blocking, as the compiled steps already are.
"""

from __future__ import annotations

import functools

import torch

TILE = 32                       # columns a tile holds (two 16-float vectors)


@functools.cache
def _register_shape() -> None:
    """The operator's shape function, for torch.compile's tracing (once the kernel is loaded)."""
    torch.library.register_fake("reelflow_tiled::tiled_mm")(_shape)


def _shape(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the operator returns: [rows, tiles × 32]."""
    return x.new_empty(x.shape[0], tiles.shape[0] * tiles.shape[2])


def available() -> bool:
    """Whether the kernel is built and loaded here (models.cpu_kernels builds it on first call).
    Ask before multiplying: `product` calls the operator this loads."""
    from models import cpu_kernels

    if not cpu_kernels.available():
        return False
    _register_shape()
    return True


def unavailable_reason() -> str | None:
    """Why the kernel did not build, or None when it did."""
    from models import cpu_kernels

    return cpu_kernels.unavailable_reason()


def holds_bfloat16(t: torch.Tensor) -> bool:
    """Whether every value of the float32 tensor t is a bfloat16 value exactly (a bfloat16
    checkpoint loaded in float32): what tiles, and a step's floor, may count at 2 bytes."""
    t = t.detach()
    return t.dtype == torch.float32 and torch.equal(t.bfloat16().float(), t)


def tile(weight: torch.Tensor, narrow: bool = True) -> torch.Tensor:
    """weight [K, N] (laid out [in, out]) -> its tiles [ceil(N / 32), K, 32], contiguous; columns
    past N are zeros. With `narrow`, in bfloat16 when the weights are bfloat16 values exactly
    (holds_bfloat16; the zoo's and most released checkpoints): the kernel widens each back to the
    same float32, so the product is the float32 tiles' bit for bit, for half the bytes a step
    streams. Otherwise float32."""
    k, n = weight.shape
    pad = -n % TILE
    if pad:
        weight = torch.cat([weight, weight.new_zeros(k, pad)], 1)
    tiles = weight.reshape(k, -1, TILE).permute(1, 0, 2)
    if not (narrow and holds_bfloat16(weight)):
        return tiles.contiguous()
    return tiles.to(torch.bfloat16)[..., _lane_order(weight.device)].contiguous()


@functools.cache
def _lane_order(device: torch.device) -> torch.Tensor:
    """Where a bfloat16 tile stores its 32 columns: the kernel widens them by interleaving with
    zeros inside each 128-bit lane, which reads words 0-3, 8-11, 16-19, 24-27 as columns 0-15 and
    words 4-7, 12-15, ... as columns 16-31; stored word p holds column order[p]."""
    where = [(i // 4) * 8 + i % 4 for i in range(16)] + [(i // 4) * 8 + 4 + i % 4 for i in range(16)]
    return torch.tensor(where, device=device).argsort()


def tile_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """bias [N] -> [ceil(N / 32) × 32], zeros past N (the tiles' output width)."""
    if bias is None:
        return None
    return torch.cat([bias, bias.new_zeros(-bias.shape[0] % TILE)]).contiguous()


def product(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """x [rows, K] · the tiled weight (+ bias, from tile_bias) -> [rows, width] (width: the
    weight's N, before padding)."""
    out = torch.ops.reelflow_tiled.tiled_mm(x, tiles, bias)
    return out if out.shape[1] == width else out[:, :width]
