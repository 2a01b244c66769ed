"""The tiled product kernel (models.tiled): x · W + b for any row count, any width (padded to whole
tiles; weights that are bfloat16 values tiled in bfloat16, with the float32 tiles' results bit for
bit), deterministic across thread counts, a torch operator that torch.compile calls without
breaking the graph or recompiling per row count.

Tolerance: the kernel and the float64 reference sum the same K products in different orders, so
each output may differ by at most about K float32 roundings of the sum of |x_k · w_k|
(|error| ≤ γ_K Σ_k |x_k w_k|, γ_K = K u / (1 − K u), u = 2⁻²⁴): the bound the tests check, with a
factor 2 to spare, whatever the CPU's kernels."""

from __future__ import annotations

import pytest
import torch

from models import tiled


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert tiled.available(), f"the tiled kernel did not build: {tiled.unavailable_reason()}"


def assert_within_rounding(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    want = x.double() @ w.double() + (b.double() if b is not None else 0)
    k = x.shape[1]
    u = 2.0 ** -24
    bound = 2 * (k + 1) * u / (1 - (k + 1) * u) * ((x.double().abs() @ w.double().abs())
                                                  + (b.double().abs() if b is not None else 0))
    assert got.shape == want.shape and got.dtype == torch.float32
    excess = (got.double() - want).abs() - bound
    assert excess.max() <= 0, f"beyond float32 rounding by {excess.max():.3g}"


def test_tiles_hold_the_weight_by_32_columns_with_zeros_past_its_width():
    w = torch.arange(5 * 40, dtype=torch.float32).reshape(5, 40) + 1 / 1024     # not bfloat16 values
    t = tiled.tile(w)
    assert t.shape == (2, 5, 32) and t.is_contiguous() and t.dtype == torch.float32
    assert torch.equal(t[0], w[:, :32]) and torch.equal(t[1, :, :8], w[:, 32:]) and not t[1, :, 8:].any()
    assert tiled.tile_bias(torch.ones(40)).shape == (64,) and tiled.tile_bias(None) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 9, 11, 16, 17, 30, 65])
@pytest.mark.parametrize("k, n, bias", [(64, 32, False), (70, 45, True), (256, 512, True), (768, 256, False)])
def test_the_product_is_x_times_w_plus_b_for_any_rows_and_width(rows, k, n, bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(k, n, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = tiled.product(x, tiled.tile(w), tiled.tile_bias(b), n)
    assert_within_rounding(got, x, w, b)


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 30])
@pytest.mark.parametrize("n", [96, 40])
def test_weights_that_are_bfloat16_values_tile_in_bfloat16_and_multiply_bit_for_bit(rows, n):
    """A bfloat16 checkpoint loaded in float32: its tiles take half the bytes, and each weight is
    widened back to the same float32, so the products equal the float32 tiles' exactly (a width
    that is not whole tiles too: the padding zeros are bfloat16 values)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(256, n, generator=g).bfloat16().float()
    x, b = torch.randn(rows, 256, generator=g), torch.randn(n, generator=g)
    narrow, wide = tiled.tile(w), tiled.tile(w, narrow=False)
    assert narrow.dtype == torch.bfloat16 and narrow.shape == wide.shape
    got = tiled.product(x, narrow, tiled.tile_bias(b), n)
    assert torch.equal(got, tiled.product(x, wide, tiled.tile_bias(b), n))
    assert_within_rounding(got, x, w, b)


def test_one_weight_off_bfloat16_keeps_the_tiles_in_float32():
    w = torch.randn(64, 32).bfloat16().float()
    w[5, 7] += 2.0 ** -20 * w[5, 7].abs().clamp_min(1)         # no longer a bfloat16 value
    assert tiled.tile(w).dtype == torch.float32 and not tiled.holds_bfloat16(w)
    assert torch.equal(tiled.tile(w), tiled.tile(w, narrow=False))


def test_no_rows_and_strided_rows():
    w = torch.randn(64, 96)
    assert tiled.product(torch.zeros(0, 64), tiled.tile(w), None, 96).shape == (0, 96)
    x = torch.randn(64, 6).t()                                   # [6, 64], not contiguous
    assert_within_rounding(tiled.product(x, tiled.tile(w), None, 96), x, w, None)


def test_each_output_is_summed_in_one_order_whatever_the_thread_count():
    x, w, b = torch.randn(9, 256), torch.randn(256, 1536), torch.randn(1536)
    tiles, bias = tiled.tile(w), tiled.tile_bias(b)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tiled.product(x, tiles, bias, 1536)
        torch.set_num_threads(2)
        two = tiled.product(x, tiles, bias, 1536)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_kernels_are_built_with_openmp_so_torch_threads_share_the_tiles():
    """Built without OpenMP, at::parallel_for runs every piece on the calling thread: the kernel
    would be bitwise the same at any thread count above, and never faster with two."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.reelflow_tiled.parallel_threads(64) == 2
        torch.set_num_threads(1)
        assert torch.ops.reelflow_tiled.parallel_threads(64) == 1
    finally:
        torch.set_num_threads(before)


def test_bad_inputs_are_refused_with_the_shapes():
    tiles = tiled.tile(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="x has 63 columns"):
        tiled.product(torch.randn(2, 63), tiles, None, 32)
    with pytest.raises(RuntimeError, match="float32 rows only"):
        tiled.product(torch.randn(2, 64, dtype=torch.float64), tiles, None, 32)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 tiles"):
        tiled.product(torch.randn(2, 64), tiles.half(), None, 32)
    with pytest.raises(RuntimeError, match="bias of 32"):
        tiled.product(torch.randn(2, 64), tiles, torch.randn(31), 32)


def test_compiled_calls_take_the_operator_whole_for_every_row_count():
    w, b = torch.randn(128, 200), torch.randn(200)
    tiles, bias = tiled.tile(w), tiled.tile_bias(b)

    def f(x):
        return torch.relu(tiled.product(x, tiles, bias, 200)) * 2

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    compiled(torch.randn(2, 128)), compiled(torch.randn(1, 128))          # one compile for many rows, one for a single
    with torch.compiler.set_stance("fail_on_recompile"):
        for rows in (1, 3, 8, 13):
            x = torch.randn(rows, 128)
            assert torch.equal(compiled(x), f(x))
