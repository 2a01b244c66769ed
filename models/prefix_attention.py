"""Attention of a few query rows over a cached prefix held in a fixed buffer, returning the
softmax's log-sum-exp beside the output, so the caller can merge it with the new tokens' part.

    out, lse = prefix_attention(q, keys, values, length, scaling)
        q [KV, R, hd]: the query rows grouped by the KV head they read (R = group size × tokens);
        keys, values [KV, capacity, hd]: a layer's whole cache buffers, of which the first `length`
        entries (int64 [1] tensor, read on the device) are held and the rest is spare room;
        -> out float32 [KV, R, hd] (softmax-weighted values), lse float32 [KV, R]
    attn = held_attention(q, k, v, keys, values, length, mask, scaling)
        n new tokens (q [H, n, hd]) over the held prefix and the m new rows (k, v [KV, m, hd],
        mask bool [n, m]) -> [n, H * hd]: what a captured step's layer calls

Why a kernel: a decode step has one to a few dozen query rows per KV head and thousands of keys.
As two matrix products (scores, then probabilities × values) the second one reduces over the
whole prefix with a [rows × hd] output, which cuBLAS runs on a handful of thread blocks; on an H200
it took 150 µs a layer at 32K cached entries, six times the time to read the layer's keys and
values. Here the prefix is cut into splits that run side by side (flash-decoding): each split keeps
a running maximum and sum over its keys and writes its partial output and log-sum-exp, and the
splits are merged by their log-sum-exps. The held length is read by the kernel, so one CUDA graph
serves every length up to the buffer's capacity; nothing of size rows × prefix is ever stored.

Backends: on CUDA with Triton installed and a power-of-two head size (`KERNEL` says which ran),
`held_attention` runs two Triton kernels, the splits and then one that merges them and the new
tokens' part (dozens of small operations otherwise, a few microseconds each even inside a CUDA
graph); otherwise `prefix_attention_reference`, the same function in plain torch (scores
materialised), which is also what the kernels are tested against, on the CPU through Triton's
interpreter. The kernels sit behind custom operators (`reelflow::prefix_attention`,
`reelflow::grouped_held_attention`), so torch.compile treats each call as opaque.

The split kernel's launch (programs per multiprocessor, keys per iteration, query rows per
program, warps, pipeline stages) is `TUNING`: defaults that served an H200, or what
$REELFLOW_PREFIX_KERNEL says ("splits_per_sm=8,block_n=128"); `bench.step_anatomy --kernel-sweep`
times the choices on a card.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import torch

try:                                   # Triton ships with CUDA builds of torch, not with CPU ones
    import triton
    import triton.language as tl
except ImportError:                    # pragma: no cover - depends on the install
    triton = None

MAX_NEW = 64            # new rows the merging kernel takes in one tile; more go through plain torch
COMBINE_CHUNK = 32      # splits the merging kernel reads at once ([CHUNK, head size] float32 a program)
ENV = "REELFLOW_PREFIX_KERNEL"


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the split kernel is launched. The work is fixed (every held key read once per block of
    query rows); these trade parallelism against the merge's work and re-reads."""

    splits_per_sm: int = 2      # aim for this many programs per multiprocessor (more: smaller splits)
    block_n: int = 64           # keys a program takes per iteration (a power of two ≥ 16)
    max_block_r: int = 64       # most query rows a program takes (16-128): fewer re-reads of the keys, more registers
    num_warps: int = 4          # Triton's defaults
    num_stages: int = 3

    def __post_init__(self):
        def power_of_two(x):
            return x >= 1 and x & (x - 1) == 0

        if not (power_of_two(self.block_n) and self.block_n >= 16):
            raise ValueError(f"block_n={self.block_n}: a power of two ≥ 16")
        if self.max_block_r not in (16, 32, 64, 128):
            raise ValueError(f"max_block_r={self.max_block_r}: 16, 32, 64 or 128")
        if self.splits_per_sm < 1 or not power_of_two(self.num_warps) or self.num_stages < 1:
            raise ValueError(f"splits_per_sm ≥ 1, num_warps a power of two, num_stages ≥ 1: got {self}")

    def block_r(self, rows: int) -> int:
        """Query rows a program takes for `rows` rows."""
        return min(self.max_block_r, max(16, 1 << max(0, rows - 1).bit_length()))


def tuning_from(text: str) -> Tuning:
    """A Tuning from "key=value,..." (the Tuning's fields; the rest keep their defaults)."""
    names = {f.name for f in dataclasses.fields(Tuning)}
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key.strip() not in names or not value.strip().isdigit():
            raise ValueError(f"{ENV}={text!r}: {item!r} is not one of {', '.join(sorted(names))} = a whole number")
        settings[key.strip()] = int(value)
    try:
        return Tuning(**settings)
    except ValueError as e:
        raise ValueError(f"{ENV}={text!r}: {e}") from None


def _from_environment() -> tuple[Tuning, str | None]:
    """The environment's Tuning, or the defaults and what is wrong with the variable: a bad value
    is reported where a run is checked (environment_problem) and where the kernel would use it,
    not as a failure to import this module."""
    try:
        return tuning_from(os.environ.get(ENV, "")), None
    except (ValueError, TypeError) as e:
        return Tuning(), str(e)


TUNING, _ENV_PROBLEM = _from_environment()


def environment_problem() -> str | None:
    """What is wrong with $REELFLOW_PREFIX_KERNEL, or None."""
    return _ENV_PROBLEM


@contextlib.contextmanager
def tuned(**settings):
    """Inside the block the split kernel launches with `settings` (Tuning's fields) over TUNING."""
    global TUNING
    saved, TUNING = TUNING, dataclasses.replace(TUNING, **settings)
    try:
        yield TUNING
    finally:
        TUNING = saved


def prefix_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                               scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix_attention in plain torch (see the module doc): q [KV, R, hd]; keys, values
    [KV, capacity, hd]; length int64 [1]. -> out float32 [KV, R, hd], lse float32 [KV, R]."""
    held = torch.arange(keys.shape[1], device=q.device) < length                           # [capacity]
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling                      # [KV, R, capacity]
    scores = scores.masked_fill(~held, float("-inf"))
    top = scores.amax(-1, keepdim=True)                                                     # [KV, R, 1]
    top = top.masked_fill(top == float("-inf"), 0.0)        # nothing held: weights 0, not exp(-inf + inf)
    p = (scores - top).exp()
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p.to(values.dtype), values).float() / total.clamp_min(torch.finfo(torch.float32).tiny)
    return out, (top + total.log()).squeeze(-1)             # -inf for an empty prefix: no weight in a merge


def merge_with_new(out: torch.Tensor, lse: torch.Tensor, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax over the prefix and the new tokens together, from the prefix's (out [KV, R, hd],
    lse [KV, R], float32) and the new tokens' masked scores [KV, R, m] (float32, -inf where
    unseen) with their values v [KV, m, hd]. -> float32 [KV, R, hd]."""
    top = torch.maximum(lse, scores.amax(-1))[..., None]                                   # [KV, R, 1]
    w_prefix = (lse[..., None] - top).exp()                                                 # [KV, R, 1]
    p_new = (scores - top).exp()
    total = w_prefix + p_new.sum(-1, keepdim=True)
    return (out * w_prefix + torch.matmul(p_new.to(v.dtype), v).float()) / total


def held_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   length: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of n new tokens over a buffer's held prefix and among the new rows: q [H, n, hd];
    k, v [KV, m, hd] (the new rows', m ≥ n: rows drafted earlier may come first); keys, values
    [KV, capacity, hd] with `length` (int64 [1]) entries held; mask bool [n, m] (which new rows
    each token sees, itself included). Heads grouped as transformers' repeat_kv lays them out.
    -> [n, H * hd] in q's dtype."""
    heads, n, hd = q.shape
    kv, m = k.shape[0], k.shape[1]
    group = heads // kv
    qg = q.reshape(kv, group * n, hd)                                                       # [KV, G*n, hd]
    if kernel_available(q) and m <= MAX_NEW:
        merged = grouped_held_attention(qg, k, v, keys, values, length, mask, scaling)      # [KV, G*n, hd]
    else:
        out, lse = prefix_attention_reference(qg, keys, values, length, scaling)
        new = (torch.matmul(qg, k.transpose(-1, -2)).float() * scaling).view(kv, group, n, m)
        new = new.masked_fill(~mask, float("-inf")).view(kv, group * n, m)                 # [KV, G*n, m]
        merged = merge_with_new(out, lse, new, v).to(q.dtype)                               # [KV, G*n, hd]
    return merged.view(kv, group, n, hd).reshape(heads, n, hd).transpose(0, 1).reshape(n, heads * hd)


# ----------------------------------------------------------------------------- the kernel

if triton is not None:
    @triton.jit
    def _split_kernel(q, keys, values, length, out, lse, rows, scaling,
                      sq_h, sq_r, sk_h, sk_n, sv_h, sv_n, so_h, so_s, so_r, sl_h, sl_s,
                      HD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                      SPLIT: tl.constexpr, PRECISION: tl.constexpr):
        """One (KV head, block of query rows, split of the prefix): online softmax over the split's
        held keys; writes the split's normalised output and log-sum-exp (-inf when it holds none)."""
        head = tl.program_id(0) // ROW_BLOCKS
        block = tl.program_id(0) % ROW_BLOCKS
        split = tl.program_id(1)
        r = block * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, HD)
        query = tl.load(q + head * sq_h + r[:, None] * sq_r + d[None, :], mask=r[:, None] < rows, other=0.0)
        held = tl.load(length)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, held)
        top = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, HD], tl.float32)
        # a loop of fixed trip count (a split's size, a power of two: few compiled variants) with
        # the held length as a mask: the same code for every length; keys past it are never loaded
        for i in range(0, SPLIT, BLOCK_N):
            n = start + i + tl.arange(0, BLOCK_N)
            seen = n < end
            k = tl.load(keys + head * sk_h + n[:, None] * sk_n + d[None, :], mask=seen[:, None], other=0.0)
            score = tl.dot(query, tl.trans(k), input_precision=PRECISION) * scaling     # [BLOCK_R, BLOCK_N]
            score = tl.where(seen[None, :], score, float("-inf"))
            new_top = tl.maximum(top, tl.max(score, 1))
            # rows that have seen no key yet keep top -inf: exp(-inf - -inf) must read as 1, not NaN
            keep = tl.where(new_top == float("-inf"), 1.0, tl.exp(top - new_top))
            p = tl.where(seen[None, :], tl.exp(score - new_top[:, None]), 0.0)
            total = total * keep + tl.sum(p, 1)
            v = tl.load(values + head * sv_h + n[:, None] * sv_n + d[None, :], mask=seen[:, None], other=0.0)
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            top = new_top
        some = total > 0
        result = tl.where(some[:, None], acc / tl.where(some, total, 1.0)[:, None], 0.0)
        tl.store(out + head * so_h + split * so_s + r[:, None] * so_r + d[None, :], result, mask=r[:, None] < rows)
        tl.store(lse + head * sl_h + split * sl_s + r, tl.where(some, top + tl.log(total), float("-inf")),
                 mask=r < rows)


def kernel_available(q: torch.Tensor) -> bool:
    """Whether the Triton kernel serves these queries: Triton present, a CUDA tensor (or Triton's
    interpreter, TRITON_INTERPRET=1, which runs it on the CPU), a power-of-two head size ≥ 16 and
    a 16- or 32-bit float dtype."""
    hd = q.shape[-1]
    on_device = q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
    return (triton is not None and on_device and hd >= 16 and hd & (hd - 1) == 0
            and q.dtype in (torch.float16, torch.bfloat16, torch.float32))


def precision(q: torch.Tensor) -> str:
    """tl.dot's precision for q's dtype: float32 exactly ("ieee"; Triton's default for float32 is
    TF32 on recent cards, about 1e-3 off, where the eager path computes in float32), other dtypes
    as they are (the argument applies to float32 inputs only)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def split_size(capacity: int, programs_per_split: int, device: torch.device, tuning: Tuning | None = None) -> int:
    """Keys per split, a power of two ≥ the tuning's block_n: about enough splits that the grid
    covers the multiprocessors splits_per_sm times."""
    tuning = tuning or TUNING
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = max(1, tuning.splits_per_sm * sms // programs_per_split)
    return max(tuning.block_n, 1 << max(0, math.ceil(capacity / want) - 1).bit_length())


def _split_parts(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                 scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernel's launch: q [KV, R, hd] -> each split's output float32 [KV, S, R, hd] and
    log-sum-exp float32 [KV, S, R] (-inf for a split past the held length)."""
    if _ENV_PROBLEM:
        raise ValueError(_ENV_PROBLEM)
    kv, rows, hd = q.shape
    capacity = keys.shape[1]
    tuning = TUNING
    block_r = tuning.block_r(rows)
    row_blocks = math.ceil(rows / block_r)
    split = split_size(capacity, kv * row_blocks, q.device, tuning)
    splits = math.ceil(capacity / split)
    parts = torch.empty(kv, splits, rows, hd, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(kv, splits, rows, dtype=torch.float32, device=q.device)
    _split_kernel[(kv * row_blocks, splits)](
        q, keys, values, length, parts, part_lse, rows, scaling,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0), part_lse.stride(1),
        HD=hd, BLOCK_R=block_r, BLOCK_N=tuning.block_n, ROW_BLOCKS=row_blocks, SPLIT=split, PRECISION=precision(q),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    return parts, part_lse


def prefix_attention_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                            scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix_attention through the split kernel, the splits merged in torch (kernel_available(q)
    must hold): what the tests compare with the reference, split by split."""
    q, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, keys, values))
    parts, part_lse = _split_parts(q, keys, values, length, scaling)
    top = part_lse.amax(1, keepdim=True)                                 # [KV, 1, R]: finite, split 0 holds keys
    weight = (part_lse - top).exp()                                                       # [KV, S, R]
    total = weight.sum(1)                                                                 # [KV, R]
    out = (parts * weight[..., None]).sum(1) / total[..., None]
    return out, top.squeeze(1) + total.log()


if triton is not None:
    @triton.jit
    def _combine_kernel(parts, part_lse, q, k, v, mask, out, splits, tokens, new_rows, scaling,
                        sp_h, sp_s, sp_r, sl_h, sl_s, sq_h, sq_r, sk_h, sk_n, sv_h, sv_n, sm_r, so_h, so_r,
                        HD: tl.constexpr, BLOCK_M: tl.constexpr, MAX_SPLITS: tl.constexpr, CHUNK: tl.constexpr):
        """One (KV head, query row): the splits merged by their log-sum-exps, then the softmax
        shared with the new rows' part (their keys k, values v [KV, m, hd] with m = new_rows,
        `mask` bool [n, m] with n = tokens: query row r is token r % n of its group), written in
        the output's dtype. A program a row, each reading its splits CHUNK at a time: with a
        program per block of rows, a step's few programs read the splits one after another, which
        cost more than the split kernel itself at 8K entries (about 0.2 µs a split, per layer)."""
        head = tl.program_id(0)
        r = tl.program_id(1)
        d = tl.arange(0, HD)
        # the splits' log-sum-exps, a power-of-two tile ≥ the splits (the rest masked: few compiled
        # variants); split 0 always holds keys when anything is held
        si = tl.arange(0, MAX_SPLITS)
        lses = tl.load(part_lse + head * sl_h + si * sl_s + r, mask=si < splits, other=float("-inf"))
        top = tl.max(lses, 0)
        top = tl.where(top == float("-inf"), 0.0, top)          # nothing held: weights 0, not exp(-inf + inf)
        total = tl.sum(tl.where(si < splits, tl.exp(lses - top), 0.0), 0)
        acc = tl.zeros([HD], tl.float32)
        for c in range(0, MAX_SPLITS, CHUNK):
            ci = c + tl.arange(0, CHUNK)
            there = ci < splits
            w = tl.where(there, tl.exp(tl.load(part_lse + head * sl_h + ci * sl_s + r, mask=there,
                                               other=float("-inf")) - top), 0.0)              # [CHUNK]
            part = tl.load(parts + head * sp_h + ci[:, None] * sp_s + r * sp_r + d[None, :], mask=there[:, None],
                           other=0.0)                                                          # [CHUNK, HD]
            acc += tl.sum(w[:, None] * part, 0)
        lse = top + tl.log(total)                                 # the prefix's; -inf when empty
        prefix = acc / tl.maximum(total, 1e-30)
        query = tl.load(q + head * sq_h + r * sq_r + d).to(tl.float32)                         # [HD]
        j = tl.arange(0, BLOCK_M)
        present = j < new_rows
        new_k = tl.load(k + head * sk_h + j[:, None] * sk_n + d[None, :], mask=present[:, None], other=0.0)
        new_v = tl.load(v + head * sv_h + j[:, None] * sv_n + d[None, :], mask=present[:, None], other=0.0)
        seen = tl.load(mask + (r % tokens) * sm_r + j, mask=present, other=0) != 0           # [BLOCK_M]
        score = tl.where(seen, tl.sum(query[None, :] * new_k.to(tl.float32), 1) * scaling, float("-inf"))
        new_top = tl.maximum(lse, tl.max(score, 0))              # finite: every row sees itself
        w_prefix = tl.exp(lse - new_top)
        p = tl.where(seen, tl.exp(score - new_top), 0.0)
        merged = (prefix * w_prefix + tl.sum(p[:, None] * new_v.to(tl.float32), 0)) / (w_prefix + tl.sum(p, 0))
        tl.store(out + head * so_h + r * so_r + d, merged.to(out.dtype.element_ty))


def held_attention_kernel(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                          values: torch.Tensor, length: torch.Tensor, mask: torch.Tensor,
                          scaling: float) -> torch.Tensor:
    """The grouped queries qg [KV, G*n, hd] of n tokens over the held prefix and the m ≤ MAX_NEW
    new rows (k, v [KV, m, hd], mask bool [n, m]) in two launches: the split kernel, then one that
    merges the splits and the new rows. -> [KV, G*n, hd] in qg's dtype."""
    qg, k, v, keys, values = (t if t.stride(-1) == 1 else t.contiguous() for t in (qg, k, v, keys, values))
    mask = mask.contiguous()
    parts, part_lse = _split_parts(qg, keys, values, length, scaling)
    kv, rows, hd = qg.shape
    out = torch.empty_like(qg)
    max_splits = triton.next_power_of_2(parts.shape[1])
    _combine_kernel[(kv, rows)](
        parts, part_lse, qg, k, v, mask, out, parts.shape[1], mask.shape[0], k.shape[1], scaling,
        parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0), part_lse.stride(1),
        qg.stride(0), qg.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), mask.stride(0),
        out.stride(0), out.stride(1),
        HD=hd, BLOCK_M=max(16, triton.next_power_of_2(k.shape[1])), MAX_SPLITS=max_splits,
        CHUNK=min(COMBINE_CHUNK, max_splits))
    return out


# ----------------------------------------------------------------------------- the operator

KERNEL = {"last": None}       # which backend the latest call on a CUDA tensor took: "triton" or "torch"


@torch.library.custom_op("reelflow::prefix_attention", mutates_args=())
def prefix_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: torch.Tensor,
                     scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module doc."""
    if kernel_available(q):
        KERNEL["last"] = "triton"
        return prefix_attention_kernel(q, keys, values, length, scaling)
    if q.is_cuda:
        KERNEL["last"] = "torch"
    return prefix_attention_reference(q, keys, values, length, scaling)


@prefix_attention.register_fake
def _(q, keys, values, length, scaling):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("reelflow::grouped_held_attention", mutates_args=())
def grouped_held_attention(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor,
                           values: torch.Tensor, length: torch.Tensor, mask: torch.Tensor,
                           scaling: float) -> torch.Tensor:
    """held_attention_kernel as one operator (torch.compile leaves it whole): qg [KV, G*n, hd] ->
    [KV, G*n, hd]. Only where kernel_available holds (held_attention checks)."""
    KERNEL["last"] = "triton"
    return held_attention_kernel(qg, k, v, keys, values, length, mask, scaling)


@grouped_held_attention.register_fake
def _(qg, k, v, keys, values, length, mask, scaling):
    return torch.empty_like(qg)
