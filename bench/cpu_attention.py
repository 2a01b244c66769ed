"""The CPU prefix-attention kernel on this CPU against torch's products (scores, softmax, values: what
the compiled steps ran before it), at each thread count, for the query rows decoding attends with.

    LD_PRELOAD=$(python -m job.openmp) python -m bench.cpu_attention            # the toy target's layer
    python -m bench.cpu_attention --cached 8192 --kv-heads 4 --head-dim 128 --rows 7 28 --threads 1

(the preload: the OpenMP runtime `python -m run` uses; without it, torch's own). torch's products
run eagerly here; inside a compiled step inductor fuses the softmax between them, so a step gains
less than this table says (bench_step times the steps).

Rows are query heads × tokens grouped by the KV head they read: 2 for a one-token step of the toy
target (4 heads over 2 KV heads), 22 for its 10-6-2 tree with the pending token. The keys and values
are views of buffers with spare room, as a cache holds them. Both ways give the same attention and
log-sum-exp within float32 rounding (checked here). Each figure is the best of three passes, in µs
a layer's attention; the two ways run one after the other inside each pass, so the machine's drift
falls on both alike. Timings only.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import cpu_attention


def by_products(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float):
    """The attention and its log-sum-exp as torch's products: q [KV, R, hd] -> [KV, R, hd], [KV, R]."""
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    top = scores.amax(-1, keepdim=True)
    p = (scores - top).exp()
    total = p.sum(-1, keepdim=True)
    return torch.matmul(p, values) / total, (top + total.log()).squeeze(-1)


def per_call_us(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cached", type=int, default=1091, help="cached entries attended over")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 8, 22, 62])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--calls", type=int, default=300, help="calls a timing")
    args = parser.parse_args(argv)
    if not cpu_attention.serves(args.head_dim, torch.float32, "cpu"):
        raise SystemExit(f"the CPU attention kernel does not serve head size {args.head_dim} here "
                         f"(built for {cpu_attention.HEAD_SIZES}, float32; models.cpu_kernels says why if not built)")
    kv, hd, length = args.kv_heads, args.head_dim, args.cached
    keys = torch.randn(kv, length + 256, hd)[:, :length]
    values = torch.randn(kv, length + 256, hd)[:, :length]
    scaling = hd ** -0.5
    before = torch.get_num_threads()
    print(f"{kv} KV heads × {length} cached entries × head size {hd}; µs a layer's attention, best of 3")
    print("| threads | rows | torch's products | kernel | kernel / products |")
    print("|---|---|---|---|---|")
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                q = torch.randn(kv, rows, hd) * 0.3
                ways = {"products": lambda: by_products(q, keys, values, scaling),
                        "kernel": lambda: cpu_attention.prefix_attention(q, keys, values, scaling)}
                (want, want_lse), (got, got_lse) = ways["products"](), ways["kernel"]()
                # float32 sums over `length` terms in two orders: a few 1e-7 of O(1) values; 1e-4 flags a wrong result
                if not (torch.allclose(got, want, atol=1e-4) and torch.allclose(got_lse, want_lse, atol=1e-4)):
                    raise SystemExit("the kernel and torch's products gave different attention")
                best: dict[str, float] = {}
                for _ in range(3):
                    for name, fn in ways.items():
                        us = per_call_us(fn, args.calls)
                        best[name] = min(us, best.get(name, us))
                print(f"| {threads} | {rows} | {best['products']:.1f} | {best['kernel']:.1f} | "
                      f"{best['kernel'] / best['products']:.2f} |", flush=True)
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
