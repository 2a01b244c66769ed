"""Benchmarks and the stages only they use: the synthetic stages of the demo and the engine
benchmarks (`bench.synthetic`), the cost probes of bench_step and bench_verify (`bench.cost`), and
real-size prefill and decode on a GPU (`python -m bench.bench_realsize`)."""

import models  # noqa: F401  (first: hides a torchvision that cannot load from transformers, which this package uses)
