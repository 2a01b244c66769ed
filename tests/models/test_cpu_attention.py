"""The CPU prefix-attention kernel (models.cpu_attention): softmax(q kᵀ s) v and the log-sum-exp for
any row count (streamed up to 24 rows, by products above), head size and prefix length (whole and
partial 16-key blocks and 256-key splits, an empty prefix), read from a cache buffer's view in
place, the same bits at any thread count where it streams, a torch operator that compiled steps call.

Tolerance: against float64. Each score sums hd products, so it is off by at most
E = γ_hd max_j Σ_d |q_d k_jd| s (γ_n = n u / (1 − n u), u = 2⁻²⁴); a weight exp(score − max)
then carries a relative error of at most η = 2E + u·W + 2u (both scores' errors, the subtraction's
rounding of a difference at most W, the row's range of scores, and exp's one ulp), the weighted
mean of the values, summed over L entries in any order, is off by at most (2η + 2γ_L) Σ p|v| / Σ p,
and the log-sum-exp (the maximum plus the log of the sum) by E + η + γ_L + u |lse|. The tests
check twice those bounds, whatever the CPU's kernels."""

from __future__ import annotations

import pytest
import torch

from models import cpu_attention
from models.prefix_attention import merge_with_new

U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.serves(64, torch.float32, "cpu"), "the CPU kernels did not build"


def assert_within_rounding(q, keys, values, scaling, out, lse):
    q64, k64, v64 = q.double(), keys.double(), values.double()
    scores = q64 @ k64.transpose(1, 2) * scaling                                      # [KV, R, L]
    p = (scores - scores.amax(2, keepdim=True)).exp()
    want = (p @ v64) / p.sum(2, keepdim=True)
    want_lse = scores.logsumexp(2)
    hd, length = q.shape[2], keys.shape[1]
    score_error = (gamma(hd) * (q64.abs() @ k64.abs().transpose(1, 2)) * scaling).amax(2)     # [KV, R]
    score_range = scores.amax(2) - scores.amin(2)                                          # [KV, R]
    weight_error = 2 * score_error + U * score_range + 2 * U
    spread = (p @ v64.abs()) / p.sum(2, keepdim=True)                                  # [KV, R, hd]
    bound = 2 * (2 * weight_error + 2 * gamma(length))[..., None] * spread
    assert out.shape == want.shape and out.dtype == torch.float32 and lse.shape == want_lse.shape
    assert ((out.double() - want).abs() - bound).max() <= 0, "output beyond float32 rounding"
    lse_bound = 2 * (score_error + weight_error + gamma(length) + U * want_lse.abs())
    assert ((lse.double() - want_lse).abs() - lse_bound).max() <= 0, "log-sum-exp beyond float32 rounding"


def buffers(kv: int, length: int, hd: int, seed: int, spare: int = 37):
    """Keys and values as a cache holds them: views of [KV, length + spare, hd] buffers."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(kv, length + spare, hd, generator=g)[:, :length]
    values = torch.randn(kv, length + spare, hd, generator=g)[:, :length]
    return keys, values, g


@pytest.mark.parametrize("kv, rows, hd, length", [
    (2, 2, 64, 1091), (2, 22, 64, 1091), (2, 62, 64, 1091),      # a toy step, a 10-6-2 tree, a 30-node tree
    (1, 1, 16, 1), (3, 5, 32, 17), (2, 7, 128, 300), (4, 3, 64, 15), (2, 9, 64, 16),
    (2, 24, 64, 256), (2, 25, 64, 257), (1, 40, 32, 7), (2, 6, 128, 513),
])
def test_the_attention_and_its_log_sum_exp_are_the_softmax_over_the_prefix(kv, rows, hd, length):
    keys, values, g = buffers(kv, length, hd, seed=kv * 1000 + rows * 10 + length)
    q = torch.randn(kv, rows, hd, generator=g)
    out, lse = cpu_attention.prefix_attention(q, keys, values, hd ** -0.5)
    assert_within_rounding(q, keys, values, hd ** -0.5, out, lse)


@pytest.mark.parametrize("rows", [3, 40])
def test_a_cache_buffers_view_gives_what_a_contiguous_copy_gives(rows):
    keys, values, g = buffers(2, 300, 64, seed=rows)
    q = torch.randn(2, rows, 64, generator=g)
    assert not keys.is_contiguous()
    a = cpu_attention.prefix_attention(q, keys, values, 0.125)
    b = cpu_attention.prefix_attention(q, keys.contiguous(), values.contiguous(), 0.125)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("rows", [2, 40])
def test_an_empty_prefix_weighs_nothing_in_the_merge(rows):
    keys, values, g = buffers(2, 0, 64, seed=rows)
    q = torch.randn(2, rows, 64, generator=g)
    out, lse = cpu_attention.prefix_attention(q, keys, values, 0.125)
    assert not out.any() and torch.isinf(lse).all() and (lse < 0).all()
    # merged with new rows, only the new rows count
    k, v = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    scores = q @ k.transpose(1, 2) * 0.125
    merged = merge_with_new(out, lse, scores, v)
    torch.testing.assert_close(merged, scores.softmax(-1) @ v)


def test_the_result_is_the_same_bits_at_one_and_two_threads():
    """Up to 24 rows the prefix's splits are fixed in size, not in number: no thread count changes a
    sum's order. (The OpenMP build that makes two threads run is tested beside the tiled kernel.)"""
    keys, values, g = buffers(2, 1091, 64, seed=7)
    q = torch.randn(2, 24, 64, generator=g)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(cpu_attention.prefix_attention(q, keys, values, 0.125))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_it_serves_float32_on_the_cpu_for_the_head_sizes_it_is_built_for():
    assert cpu_attention.serves(128, torch.float32, "cpu")
    assert not cpu_attention.serves(64, torch.float64, "cpu")
    assert not cpu_attention.serves(64, torch.bfloat16, "cpu")
    assert not cpu_attention.serves(48, torch.float32, "cpu")
    assert not cpu_attention.serves(64, torch.float32, "cuda:0")


def test_bad_inputs_are_refused_with_the_shapes():
    keys, values, g = buffers(2, 10, 64, seed=0)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_attention.prefix_attention(torch.randn(2, 3, 64, dtype=torch.float64), keys, values, 0.125)
    with pytest.raises(RuntimeError, match="head size 48"):
        cpu_attention.prefix_attention(torch.randn(2, 3, 48), keys[..., :48], values[..., :48], 0.125)
    with pytest.raises(RuntimeError, match="shapes disagree"):
        cpu_attention.prefix_attention(torch.randn(3, 3, 64), keys, values, 0.125)


def test_compiled_split_attention_with_the_kernel_gives_the_torch_paths_attention_without_recompiling():
    """What a compiled step runs: the prefix by the kernel, merged with the new tokens' part. The
    first two calls compile (static shapes, then the sizes that changed as symbols); later token
    counts and prefix lengths, on either side of the kernel's 24 streamed rows, compile no more.
    Both paths are within float32 rounding of the same attention of O(1) values: 1e-5 apart at most."""
    from models.compiled_step import split_attention

    torch._dynamo.reset()
    fn = torch.compile(split_attention, dynamic=None, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    for call, (n, length) in enumerate(((2, 100), (5, 300), (20, 1091), (3, 17), (9, 256))):
        q = torch.randn(4, n, 64, generator=g)
        k, v = torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g)
        keys, values, _ = buffers(2, length, 64, seed=n)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        with torch._dynamo.config.patch(error_on_recompile=call >= 2):
            got = fn(q, k, v, keys, values, mask, 0.125, None, True)
        want = split_attention(q, k, v, keys, values, mask, 0.125)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
