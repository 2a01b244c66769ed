"""The engine's speculative decoding against the plain loop, interleaved in one process.

    LD_PRELOAD=$(python -m job.openmp) python -m bench.engine_vs_loop     # vanilla SD, 8 fps, 2 videos, 6 rounds
    LD_PRELOAD=$(python -m job.openmp) python -m bench.engine_vs_loop --method sparrow -- bench.fps=2
    python -m bench.engine_vs_loop --method sparrow --device cuda --profile -- resources=gpu \
        model.target.compile=cudagraph                   # on a GPU, with where the loop's rounds spend their time

(the preload: the OpenMP runtime `python -m run` uses; without it, torch's own)

Each round runs every video twice: once through the whole graph on the engine (`Executor.run`),
once as the plain loop (`speculative.reference.speculative_decode`) on the same graph's prefills
with the same drafter and verifier settings, on this process's main thread. Both decode the same
tokens (tests/speculative/test_reference.py); this times them. The figure is the decode time per
generated token after the first (the engine: the request's wall time less its time to the first
token; the loop: its own wall time), the median over the rounds after the first, which warms up.
On a machine whose speed drifts within minutes, only ratios of interleaved timings mean anything;
this is why both sides run in one process, round by round.

Overrides after `--` are Hydra overrides of `+experiment=bench_sd` (compiled steps by default).
--profile runs one more round, untimed, and prints torch.profiler's tables of its plain loops (the
rounds' timed regions and operations by total and by own host time): where a host-bound round spends its time, as a
small model's rounds are on a GPU. Timings only; nothing here is a unit test.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from graph.executor import Executor
from job.prepare import prepare
from speculative.reference import speculative_decode
from stages.source import load_requests

CONF = Path(__file__).resolve().parents[1] / "conf"


def prime(edge) -> int:
    return int(edge.get("prime", 0)) if OmegaConf.is_dict(edge) else 0


def prefills_only(cfg) -> tuple:
    """The same graph without its draft and verify nodes, and the two ports whose items are the
    target's and the draft's prefills (record them to run the plain loop on them): (cfg, ports)."""
    nodes = cfg.graph.nodes
    draft_input = next(name for name in ("kv", "taps") if name in nodes.draft.inputs)
    ports = (str(nodes.verify.inputs.kv), str(nodes.draft.inputs[draft_input]))
    prefix = cfg.copy()
    with open_dict(prefix):
        del prefix.graph.nodes.draft, prefix.graph.nodes.verify, prefix.graph.first_token, prefix.graph.answer
    return prefix, ports


def loop_settings(nodes) -> dict:
    """speculative_decode's keywords for a graph: how far the drafter runs ahead (the verdict
    edge's prime) and whether the first token comes from the prefill (the proposal edge's)."""
    return {"ahead": prime(nodes.draft.inputs.verdict), "first_from_prefill": prime(nodes.verify.inputs.proposal) == 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="vanilla_sd", help="a speculative method (conf/method/)")
    parser.add_argument("--videos", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="rounds over the videos; the first warms up")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the loop's stages load the models (cuda: add resources=gpu for the engine)")
    parser.add_argument("--profile", action="store_true",
                        help="one more round, its loops under the profiler (not in the figures): print its tables")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first warms up)")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=["+experiment=bench_sd", f"method={args.method}", "bench.fps=8",
                                           f"data.toy.videos={args.videos}", "model.target.compile=default",
                                           "model.draft.compile=${model.target.compile}", *args.overrides])
    nodes = cfg.graph.nodes
    prefix, ports = prefills_only(cfg)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    n_cuda = torch.cuda.device_count() if cuda else 0
    device = "cuda:0" if cuda else "cpu"
    spec, plan = prepare(cfg, n_cuda=n_cuda)
    prefix_spec, prefix_plan = prepare(prefix, n_cuda=n_cuda)
    first, answer = str(cfg.graph.first_token), str(cfg.graph.answer)
    requests = load_requests(cfg.data)
    per_token: dict[str, list[float]] = {"engine": [], "loop": []}
    with Executor(spec, plan, progress=False) as engine, \
            Executor(prefix_spec, prefix_plan, progress=False, record=ports) as prefills:
        verifier_stage, draft_stage = instantiate(nodes.verify.stage), instantiate(nodes.draft.stage)
        verifier_stage.setup(SimpleNamespace(device=device))
        draft_stage.setup(SimpleNamespace(device=device))
        profiler = None
        # the timed rounds, then (--profile) one more whose loops run under the profiler, left out
        # of the figures (the profiler's own cost would be in them)
        for round_ in range(args.rounds + (1 if args.profile else 0)):
            if round_ == args.rounds:
                kinds = torch.profiler.ProfilerActivity
                # acc_events: one profile over every loop of the round, entered once per loop (the
                # engine's and the prefills' runs between them stay out)
                profiler = torch.profiler.profile(activities=[kinds.CPU] + ([kinds.CUDA] if cuda else []),
                                                  acc_events=True)
            for request in requests:
                result = engine.run(request)
                n = len(result.outputs[answer].ids)
                engine_s = result.t_end - result.t_start - result.port_times[first]["first_s"]
                outputs = prefills.run(request).outputs
                target = verifier_stage.verifier_for(outputs[ports[0]])
                drafter = draft_stage.drafter_for(outputs[ports[1]])
                with profiler if profiler is not None else contextlib.nullcontext():
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    ids = speculative_decode(target, drafter, **loop_settings(nodes))
                    if cuda:
                        torch.cuda.synchronize()
                    loop_s = time.perf_counter() - t0
                if ids != list(result.outputs[answer].ids):
                    raise SystemExit(f"the engine and the loop decoded different tokens for {request.id}")
                if 0 < round_ < args.rounds:
                    per_token["engine"].append(1000 * engine_s / n)
                    per_token["loop"].append(1000 * loop_s / len(ids))
            if 0 < round_ < args.rounds:
                engine_ms, loop_ms = (statistics.median(per_token[k]) for k in ("engine", "loop"))
                print(f"round {round_}: ms a token, engine {engine_ms:.2f}, plain loop {loop_ms:.2f} "
                      f"(engine / loop {engine_ms / loop_ms:.2f})", flush=True)
    if profiler is not None:
        print_profile(profiler)


def print_profile(profiler, rows: int = 30) -> None:
    """The profiled loops' work: each region (the drafter's "head" or "draft", the target's
    "verify": what Tq and Tp time) and operation by its total host time, then the operations by
    their own host time (launches and host work; on a GPU, CUDA time beside it)."""
    averages = profiler.key_averages()
    print(f"\nthe profiled round's plain loops by total host time (regions: the rounds' timers; top {rows}):")
    print(averages.table(sort_by="cpu_time_total", row_limit=rows))
    print(f"\nthe same by their own host time (top {rows}):")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))


if __name__ == "__main__":
    main()
