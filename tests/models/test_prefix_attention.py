"""models.prefix_attention: the prefix's attention with its log-sum-exp, in plain torch, through the
Triton kernel (on CUDA, and on the CPU through Triton's interpreter), and merged with new tokens."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from models.prefix_attention import held_attention, merge_with_new, prefix_attention, prefix_attention_reference

ROOT = Path(__file__).resolve().parents[2]
# where the test extra installs Triton (pyproject.toml's marker): there, a missing Triton is a broken install
TRITON_WHEELS = platform.system() == "Linux" and platform.machine() == "x86_64"


def exact_attention(q, keys, values, held, scaling):
    """Softmax attention in float64 over the first `held` keys: out [KV, R, hd], lse [KV, R]."""
    q, keys, values = q.double(), keys[:, :held].double(), values[:, :held].double()
    scores = q @ keys.transpose(-1, -2) * scaling
    return torch.softmax(scores, -1) @ values, torch.logsumexp(scores, -1)


def inputs(kv, rows, hd, capacity, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)      # noqa: E731
    return make(kv, rows, hd), make(kv, capacity, hd), make(kv, capacity, hd)


@pytest.mark.parametrize("kv,rows,hd,capacity,held", [(2, 7, 64, 300, 257), (4, 7, 128, 1000, 1),
                                                      (2, 40, 64, 700, 650), (1, 3, 32, 64, 64)])
def test_the_reference_is_softmax_attention_over_the_held_keys(kv, rows, hd, capacity, held):
    q, keys, values = inputs(kv, rows, hd, capacity)
    keys[:, held:] = 1e4              # spare room holding anything must not count
    out, lse = prefix_attention_reference(q, keys, values, torch.tensor([held]), hd ** -0.5)
    want_out, want_lse = exact_attention(q, keys, values, held, hd ** -0.5)
    # float32 sums of a few hundred terms: relative error well under 1e-5
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_merging_prefix_and_new_tokens_is_attention_over_both():
    kv, group, n, hd, capacity, held = 2, 3, 4, 32, 90, 70
    g = torch.Generator().manual_seed(1)
    q = torch.randn(kv * group, n, hd, generator=g)
    k, v = torch.randn(kv, n, hd, generator=g), torch.randn(kv, n, hd, generator=g)
    keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    got = held_attention(q, k, v, keys, values, torch.tensor([held]), mask, hd ** -0.5)     # [n, H*hd]
    # reference: every head over its KV head's held keys, then the new tokens it sees
    want = torch.empty(n, kv * group, hd, dtype=torch.float64)
    for h in range(kv * group):
        j = h // group
        allk = torch.cat([keys[j, :held], k[j]]).double()
        allv = torch.cat([values[j, :held], v[j]]).double()
        seen = torch.cat([torch.ones(n, held, dtype=torch.bool), mask], 1)
        scores = (q[h].double() @ allk.T * hd ** -0.5).masked_fill(~seen, float("-inf"))
        want[:, h] = torch.softmax(scores, -1) @ allv
    torch.testing.assert_close(got.double(), want.reshape(n, -1), rtol=1e-5, atol=1e-5)


def test_merge_of_a_prefix_with_no_weight_left_is_the_new_part_alone():
    out, lse = torch.zeros(1, 2, 4), torch.full((1, 2), -1e4)
    scores, v = torch.zeros(1, 2, 3), torch.arange(12.).view(1, 3, 4)
    torch.testing.assert_close(merge_with_new(out, lse, scores, v), v.mean(1, keepdim=True).expand(1, 2, 4))


INTERPRETED = textwrap.dedent("""
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"          # before the kernel is defined: Triton runs it on the CPU
    sys.path.insert(0, {root!r})
    import models.prefix_attention as pa
    assert pa.kernel_available(torch.zeros(1, 1, 64))
    g = torch.Generator().manual_seed(0)
    # several splits (a split holds 64+ keys, four programs per split on the interpreter's 4 "SMs"),
    # a held length mid-split, a single held key, more rows than one block, a length at capacity
    for kv, rows, hd, capacity, held in [(2, 7, 64, 300, 257), (4, 7, 128, 1000, 1), (2, 40, 64, 700, 650),
                                         (1, 3, 32, 64, 64), (1, 70, 16, 200, 130)]:
        q = torch.randn(kv, rows, hd, generator=g)
        keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
        keys[:, held:] = float("nan")             # spare room is never read
        length = torch.tensor([held])
        out, lse = pa.prefix_attention_kernel(q, keys, values, length, hd ** -0.5)
        ref_out, ref_lse = pa.prefix_attention_reference(q, keys[:, :held], values[:, :held], length, hd ** -0.5)
        # float32 throughout (the interpreter's bfloat16 products are not exact): summation order only
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # other launches (bench.step_anatomy --kernel-sweep's): more and smaller splits, rows over several
    # small blocks or one large one, other key blocks: the same attention
    for settings, (kv, rows, hd, capacity, held) in [
            (dict(splits_per_sm=8, block_n=32, max_block_r=16), (2, 40, 64, 700, 650)),
            (dict(block_n=128, max_block_r=128), (1, 70, 16, 600, 530)),
            (dict(splits_per_sm=1, block_n=16), (2, 7, 32, 300, 5))]:
        q = torch.randn(kv, rows, hd, generator=g)
        keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
        length = torch.tensor([held])
        with pa.tuned(**settings):
            out, lse = pa.prefix_attention_kernel(q, keys, values, length, hd ** -0.5)
        ref_out, ref_lse = pa.prefix_attention_reference(q, keys[:, :held], values[:, :held], length, hd ** -0.5)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    # both kernels through held_attention (what captured steps call): prefix and new tokens merged,
    # against split attention over the held part (models.compiled_step, two plain products)
    from models.compiled_step import split_attention
    # m new rows for n tokens (m > n: rows drafted earlier come first), and an empty prefix
    for kv, group, n, m, hd, capacity, held in [(2, 2, 1, 1, 64, 300, 257), (2, 3, 5, 5, 32, 700, 650),
                                                (1, 7, 32, 32, 16, 130, 64), (2, 2, 3, 7, 32, 100, 40),
                                                (1, 2, 2, 2, 16, 64, 0)]:
        q = torch.randn(kv * group, n, hd, generator=g)
        k, v = torch.randn(kv, m, hd, generator=g), torch.randn(kv, m, hd, generator=g)
        keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
        mask = torch.rand(n, m, generator=g) < 0.5
        mask[:, m - n:] |= torch.eye(n, dtype=torch.bool)              # a tree's mask: each row sees itself
        got = pa.held_attention(q, k, v, keys, values, torch.tensor([held]), mask, hd ** -0.5)
        assert pa.KERNEL["last"] == "triton"
        if held:
            want = split_attention(q, k, v, keys, values, mask, hd ** -0.5, torch.arange(capacity) < held)
        else:                                                           # the new rows alone
            scores = (q.reshape(kv, group * n, hd) @ k.transpose(-1, -2) * hd ** -0.5).view(kv, group, n, m)
            weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).view(kv, group * n, m)
            want = (weights @ v).view(kv, group, n, hd).reshape(kv * group, n, hd).transpose(0, 1).reshape(n, -1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        ref = pa.held_attention(q.double(), k.double(), v.double(), keys.double(), values.double(),
                                torch.tensor([held]), mask, hd ** -0.5)      # float64: the torch path
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # more splits than the merging kernel reads at once (63 splits of 16 keys: two chunks of 32)
    kv, group, n, hd, capacity, held = 1, 7, 1, 32, 1008, 1000
    q = torch.randn(kv * group, n, hd, generator=g)
    k, v = torch.randn(kv, n, hd, generator=g), torch.randn(kv, n, hd, generator=g)
    keys, values = torch.randn(kv, capacity, hd, generator=g), torch.randn(kv, capacity, hd, generator=g)
    mask = torch.ones(n, n, dtype=torch.bool)
    with pa.tuned(splits_per_sm=64, block_n=16):
        assert pa._split_parts(q.view(kv, group * n, hd), keys, values, torch.tensor([held]), 1.0)[0].shape[1] \
            > 2 * pa.COMBINE_CHUNK - 8
        got = pa.held_attention(q, k, v, keys, values, torch.tensor([held]), mask, hd ** -0.5)
    want = split_attention(q, k, v, keys, values, mask, hd ** -0.5, torch.arange(capacity) < held)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    print("kernel matches")
""")


def test_a_bad_setting_in_the_environment_stops_the_kernel_not_the_import(monkeypatch):
    from models import prefix_attention as pa

    monkeypatch.setattr(pa, "_ENV_PROBLEM", "REELFLOW_PREFIX_KERNEL='x': 'x' is not one of ...")
    assert pa.environment_problem().startswith("REELFLOW_PREFIX_KERNEL='x'")
    q = torch.zeros(1, 1, 16)
    with pytest.raises(ValueError, match="REELFLOW_PREFIX_KERNEL='x'"):
        pa._split_parts(q, q, q, torch.tensor([1]), 1.0)


def test_the_kernels_launch_settings_read_from_the_environment_and_checked():
    from models.prefix_attention import ENV, Tuning, tuned, tuning_from

    assert tuning_from("") == Tuning()
    assert tuning_from(" splits_per_sm=8, block_n=128 ") == Tuning(splits_per_sm=8, block_n=128)
    for bad in ("splits=8", "block_n=48", "block_n=x", "max_block_r=256", "num_warps=3"):
        with pytest.raises(ValueError, match="block_n|max_block_r|num_warps|splits_per_sm|" + ENV):
            tuning_from(bad)
    assert [Tuning().block_r(r) for r in (1, 7, 16, 17, 40, 224)] == [16, 16, 16, 32, 64, 64]
    assert Tuning(max_block_r=128).block_r(224) == 128 and Tuning(max_block_r=16).block_r(40) == 16
    from models import prefix_attention as pa

    before = pa.TUNING
    with tuned(block_n=32) as inside:
        assert pa.TUNING is inside and inside.block_n == 32
    assert pa.TUNING is before
    # more programs a multiprocessor: smaller splits, never under a key block
    assert pa.split_size(40960, 4, torch.device("cpu"), Tuning(splits_per_sm=8)) \
        < pa.split_size(40960, 4, torch.device("cpu"), Tuning())
    assert pa.split_size(100, 4, torch.device("cpu"), Tuning(block_n=128)) == 128


def test_the_triton_kernel_matches_the_reference_in_the_interpreter():
    """The kernel's own code, run by Triton's interpreter on the CPU (a fresh process: the
    interpreter is chosen when the kernel is defined)."""
    if importlib.util.find_spec("triton") is None:
        if not TRITON_WHEELS:        # the test extra leaves Triton out here: nothing was promised
            pytest.skip(f"Triton publishes no wheel for {platform.system()} {platform.machine()}, so the "
                        "test extra does not install it there")
        pytest.fail("Triton is a test dependency (pip install -e '.[test]'): the kernel is tested through "
                    "its interpreter")
    done = subprocess.run([sys.executable, "-c", INTERPRETED.format(root=str(ROOT))], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel matches" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel runs on a CUDA device")
@pytest.mark.parametrize("rows", [7, 28, 112, 224])
@pytest.mark.parametrize("capacity,held", [(10240, 8203), (40960, 32779), (640, 1)])
def test_the_kernel_on_cuda_in_bfloat16(rows, capacity, held):
    q, keys, values = inputs(4, rows, 128, capacity, seed=rows, dtype=torch.bfloat16, device="cuda")
    length = torch.tensor([held], device="cuda")
    out, lse = prefix_attention(q, keys, values, length, 128 ** -0.5)
    from models.prefix_attention import KERNEL

    assert KERNEL["last"] == "triton"
    want_out, want_lse = exact_attention(q.float(), keys.float(), values.float(), held, 128 ** -0.5)
    # bfloat16 inputs, float32 accumulation, probabilities rounded to bfloat16 before × values (as
    # flash attention does): a relative error of a few 1e-3, far under a logit's rounding at 7B
    err = (out.double() - want_out).norm() / want_out.norm()
    assert err < 1e-2, err
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels run on a CUDA device")
@pytest.mark.parametrize("n", [1, 5, 32])
def test_both_kernels_through_held_attention_on_cuda_in_bfloat16(n):
    from models.compiled_step import split_attention
    from models.prefix_attention import KERNEL

    kv, group, hd, capacity, held = 4, 7, 128, 10240, 8203
    q, keys, values = inputs(kv, group * n, hd, capacity, seed=n, dtype=torch.bfloat16, device="cuda")
    q = q.reshape(kv * group, n, hd)
    k, v = (t[:, :n].clone() for t in inputs(kv, n, hd, n, seed=n + 1, dtype=torch.bfloat16, device="cuda")[1:])
    mask = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    got = held_attention(q, k, v, keys, values, torch.tensor([held], device="cuda"), mask, hd ** -0.5)
    assert KERNEL["last"] == "triton"
    held_mask = torch.arange(capacity, device="cuda") < held
    want = split_attention(q.float(), k.float(), v.float(), keys.float(), values.float(), mask, hd ** -0.5, held_mask)
    # bf16 inputs and output, float32 accumulation (see the test above): a relative error of a few 1e-3
    err = (got.double() - want.double()).norm() / want.double().norm()
    assert err < 1e-2, err
