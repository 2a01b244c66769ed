"""The tiled product kernel on this CPU: float32 against bfloat16 tiles, weights from memory against
weights in the caches, at each thread count, for the row counts decoding multiplies.

    LD_PRELOAD=$(python -m job.openmp) python -m bench.tiled_kernel              # a [256, 1536] weight
    python -m bench.tiled_kernel --shape 768 256 --rows 1 8 --threads 1

(the preload: the OpenMP runtime `python -m run` uses; without it, torch's own)

"cold" cycles through enough copies of the weight to pass the last-level cache (each product reads
its weight from memory, as a decode step does); "warm" multiplies by one copy again and again. The
weights are bfloat16 values, so both kinds of tiles hold them exactly and give the same products
(checked here). Each figure is the best of three passes, in µs a product; the two kinds of tiles
run one after the other inside each pass, so the machine's drift falls on both alike. Timings only.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import tiled


def per_product_us(x: torch.Tensor, tiles: list[torch.Tensor], width: int, calls: int) -> float:
    """µs a product of x by each of `tiles` in turn, over at least `calls` products."""
    rounds = max(1, calls // len(tiles))
    for t in tiles:
        tiled.product(x, t, None, width)
    start = time.perf_counter()
    for _ in range(rounds):
        for t in tiles:
            tiled.product(x, t, None, width)
    return (time.perf_counter() - start) / (rounds * len(tiles)) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=[256, 1536], metavar=("K", "N"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 11, 30])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cold-mib", type=float, default=64.0, help="float32 bytes cycled for 'cold'")
    args = parser.parse_args(argv)
    if not tiled.available():
        raise SystemExit(f"the tiled kernel is not built here: {tiled.unavailable_reason()}")
    k, n = args.shape
    copies = max(2, int(args.cold_mib * 2**20 // (k * n * 4)))
    weights = [torch.randn(k, n).bfloat16().float() for _ in range(copies)]
    kinds = {"float32": [tiled.tile(w, narrow=False) for w in weights], "bfloat16": [tiled.tile(w) for w in weights]}
    assert all(t.dtype == torch.bfloat16 for t in kinds["bfloat16"])
    before = torch.get_num_threads()
    print(f"[{k}, {n}] weight, {copies} copies for 'cold'; µs a product, best of 3")
    print("| threads | rows | cold float32 | cold bfloat16 | warm float32 | warm bfloat16 |")
    print("|---|---|---|---|---|---|")
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for rows in args.rows:
                x = torch.randn(rows, k)
                if not torch.equal(tiled.product(x, kinds["float32"][0], None, n),
                                   tiled.product(x, kinds["bfloat16"][0], None, n)):
                    raise SystemExit("float32 and bfloat16 tiles gave different products")
                best: dict[str, float] = {}
                for _ in range(3):
                    for kind, tiles in kinds.items():
                        for where, chosen, calls in (("cold", tiles, 2 * len(tiles)), ("warm", tiles[:1], 400)):
                            us = per_product_us(x, chosen, n, calls)
                            best[f"{where} {kind}"] = min(us, best.get(f"{where} {kind}", us))
                cells = " | ".join(f"{best[c]:.1f}" for c in ("cold float32", "cold bfloat16", "warm float32",
                                                             "warm bfloat16"))
                print(f"| {threads} | {rows} | {cells} |", flush=True)
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
