"""Where a decode step's device time goes: the step's parts, each run as many times as the step
runs it (once per layer), against the whole captured step and the step's memory floor.

    python -m bench.step_anatomy random:qwen2.5-vl-7b --contexts 8192 32768

For each context (random embeddings prefilled to that many cached entries):
- the layers' weight products alone for 1, 4 and 16 rows: as loaded (q, k, v, o, gate, up, down,
  seven a layer) and packed (models.packing: q, k and v in one, gate and up in one, five a layer),
  and the LM head; and each packed product alone for one row, with the bytes it streams and its
  rate (which of them falls short of the copy rate);
- attention over the cache per layer: the prefix-attention kernel's path (models.prefix_attention,
  what captured steps run) and split attention (two matrix products, what compiled CPU steps run)
  for 1, 16 and 32 new tokens, beside SDPA over the held keys (a fused kernel, but one that returns
  no log-sum-exp and reads no buffer with spare room: a reference, not a drop-in);
- RMSNorm, eager, as many times as the step applies it;
- the captured step in each mode (models.captured_step; "+packed": over the packed copies): its
  graph's replay alone, and with the LM head, argmax and the host's work around it on the host
  clock (what a generated token costs).

The packed copies take the decoder layers' memory again (13 GB for the 7B shape).

On CUDA each part is captured as one CUDA graph and timed by replays with device events (launch
gaps left out: what remains is the kernels); on the CPU parts are timed by plain calls. The floor
is the step's bytes (its weights and the cache) over the copy bandwidth (bench.bandwidth: launched
from the host after the clocks have risen; a copy in a CUDA graph runs on the copy engines, slower).

Writes a markdown table per context to stdout and, with --out, anatomy.md there.

With --kernel-sweep (CUDA and Triton only), the prefix-attention kernel's launch settings
(models.prefix_attention.Tuning: programs per multiprocessor, keys per iteration, warps, rows per
program) are timed instead, the held attention of every layer for 1 and 32 new tokens per
setting, into kernel_sweep.md, with the fastest setting as a line for $REELFLOW_PREFIX_KERNEL
(kernel_choice.txt). Timings only; nothing here is a unit test.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bandwidth import copy_bandwidth
from models import prefix_attention
from models.captured_step import CapturedStep
from models.compiled_step import split_attention
from models.graph_capture import capture
from models.lean import rms_norm
from models.load import load_model
from models.packing import mlp_products, o_product, packed_layers, qkv_products
from models.prefix_attention import (
    KERNEL,
    Tuning,
    held_attention,
    kernel_available,
    tuned,
)
from models.steps import build_step


def device_ms(fn, repeats: int = 50) -> float:
    """Median ms of fn's work: on CUDA, fn captured as a CUDA graph and timed by replays with
    device events; on the CPU, plain calls on the host clock."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(max(3, repeats // 10)):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)
    graph, _ = capture(fn, torch.device("cuda", torch.cuda.current_device()))
    return replay_ms(graph, repeats)


def replay_ms(graph: torch.cuda.CUDAGraph, repeats: int = 50) -> float:
    """Median ms of a captured graph's replays, between device events (not captured again: a
    graph launched inside another capture is not portable across CUDA versions)."""
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def products(lean, x: torch.Tensor):
    """The weight products of every layer over x [n, hidden], chained so none is left out."""
    h = x
    for w in lean.layers:
        q = F.linear(h, w.q, w.q_bias)
        k = F.linear(h, w.k, w.k_bias)
        v = F.linear(h, w.v, w.v_bias)
        o = F.linear(q, w.o, w.o_bias)
        h = F.linear(F.silu(F.linear(o, w.gate)) * F.linear(o, w.up), w.down) + (k.sum() + v.sum()) * 0
    return h


def packed_products(packed: list, x: torch.Tensor):
    """products() over packed layers (models.packing.PackedLayer): five products a layer."""
    h = x
    for p in packed:
        q, k, v = qkv_products(h, p)
        h = mlp_products(o_product(q, p), p) + (k.sum() + v.sum()) * 0
    return h


def product_parts(packed: list, x: torch.Tensor) -> list[tuple[str, float]]:
    """Each packed product alone over every layer for one row x [1, hidden], with the bytes it
    streams and the rate: which of the four products falls short of the copy rate."""
    layers, rows = len(packed), []
    p0 = packed[0]
    inputs = {"q, k, v (one product)": (x, "qkv"), "o": (x.new_zeros(1, p0.o.shape[0]), "o"),
              "gate, up (one product)": (x, "gate_up"), "down": (x.new_zeros(1, p0.intermediate), "down")}
    for name, (h, field) in inputs.items():
        ms = device_ms(lambda h=h, field=field: [h @ getattr(p, field) for p in packed])
        gb = sum(getattr(p, field).numel() * getattr(p, field).element_size() for p in packed) / 1e9
        rows.append((f"{name} ×{layers}, 1 row: {gb:.2f} GB at {gb / ms:.2f} TB/s", ms))
    return rows


def attention_parts(lm, cache, context: int, g: torch.Generator) -> list[tuple[str, float]]:
    """Per-layer attention over the cache's buffers, every layer, for 1, 16 and 32 new tokens."""
    lean, device, rows = lm.lean, lm.device, []
    buffers = [(keys[0], values[0]) for keys, values in (layer.buffers() for layer in cache.layers)]
    capacity = buffers[0][0].shape[1]
    held = torch.arange(capacity, device=device) < context
    length = torch.tensor([context], device=device)
    layers = len(lean.layers)
    for n in (1, 16, 32):
        q = torch.randn(lean.n_heads, n, lean.head_dim, generator=g).to(device, lm.dtype)
        new = torch.randn(lean.n_kv_heads, n, lean.head_dim, generator=g).to(device, lm.dtype)
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        rows.append((f"prefix-attention path ×{layers}, {n} new tokens",
                     device_ms(lambda: [held_attention(q, new, new, k, v, length, mask, lean.scaling)
                                        for k, v in buffers])))
        rows.append((f"split attention ×{layers}, {n} new tokens",
                     device_ms(lambda: [split_attention(q, new, new, k, v, mask, lean.scaling, held)
                                        for k, v in buffers])))
        if torch.device(device).type == "cuda":
            rows.append((f"SDPA over the held keys ×{layers}, {n} new tokens (reference)",
                         device_ms(lambda: [F.scaled_dot_product_attention(q[None], k[None, :, :context],
                                                                           v[None, :, :context], enable_gqa=True)
                                            for k, v in buffers])))
    return rows


def step_parts(lm, cache, context: int, steps: dict, modes, packed) -> list[tuple[str, float]]:
    """The captured step in each mode (a mode "+packed" over `packed`, the layers' packed copies):
    its graph's replay, and a whole token on the host clock."""
    lean, rows = lm.lean, []
    embeds, position = lm.embed(torch.tensor([5])), torch.tensor([context + 10])
    for mode in modes:
        if mode not in steps:
            base = mode.removesuffix("+packed")
            steps[mode] = (CapturedStep(lean, base, packed=packed) if mode.endswith("+packed")
                           else build_step(lean, mode))
            steps[mode].warm(lm.device, lm.dtype, name="anatomy")
        lean.step = steps[mode]
        try:
            lean.forward(cache, embeds, position)              # captures over this cache's buffers
            cache.crop(-1)
            rows.append((f"captured step ({mode}): the graph's replay", replay_ms(lean.step.latest_graph(1))))
            times = []
            for i in range(40):
                torch.cuda.synchronize()
                start = time.perf_counter()
                int(lm.lm_head(lean.forward(cache, embeds, position)).float()[-1].argmax())
                if i >= 5:
                    times.append(1000 * (time.perf_counter() - start))
                cache.crop(-1)
            rows.append((f"captured step ({mode}) + LM head + argmax, host clock", statistics.median(times)))
        finally:
            lean.step = None
    return rows


@torch.inference_mode()
def anatomy(lm, context: int, bandwidth: float, steps: dict, modes, packed) -> tuple[str, list[tuple[str, float]]]:
    """(title, [(part, ms)]) for one context; the first row is the floor. packed: the layers'
    packed copies (models.packing), or None to leave the packed rows out."""
    g = torch.Generator().manual_seed(context)
    cache = lm.new_cache()
    embeds = (torch.randn(context, lm.hidden_size, generator=g) * 0.02).to(lm.device, lm.dtype)
    lm.prefill(cache, embeds, torch.arange(context)[None].expand(3, context), logits="none")
    weights, cached = lm.step_weight_bytes(), int(lm.cache_bytes(cache))
    rows = [("floor: the step's bytes over the copy bandwidth", 1000 * (weights + cached) / bandwidth)]
    layers = len(lm.lean.layers)
    for n in (1, 4, 16):
        x = (torch.randn(n, lm.hidden_size, generator=g) * 0.02).to(lm.device, lm.dtype)
        rows.append((f"the {layers} layers' weight products, {n} rows", device_ms(lambda: products(lm.lean, x))))
        if packed is not None:
            rows.append((f"the {layers} layers' weight products packed, {n} rows",
                         device_ms(lambda: packed_products(packed, x))))
        rows.append((f"LM head, {n} rows", device_ms(lambda: lm.lm_head(x).float())))
        if packed is not None and n == 1:
            rows += product_parts(packed, x)
    rows += attention_parts(lm, cache, context, g)
    x = torch.randn(1, lm.hidden_size, generator=g).to(lm.device, lm.dtype)
    norm = lm.lean.layers[0].input_norm
    rows.append((f"RMSNorm ×{2 * layers + 1}, eager",
                 device_ms(lambda: [rms_norm(x, norm, lm.lean.eps) for _ in range(2 * layers + 1)])))
    if torch.device(lm.device).type == "cuda":
        rows += step_parts(lm, cache, context, steps, modes, packed)
    title = (f"{lm.name}, {context} cached entries: weights {weights / 1e9:.2f} GB, cache {cached / 1e9:.3f} GB, "
             f"copy {bandwidth / 1e12:.2f} TB/s, attention backend {KERNEL['last'] or 'torch'}")
    return title, rows


def sweep_settings() -> list[Tuning]:
    """The launch settings the sweep times, the defaults first: programs per multiprocessor, keys
    per iteration and warps crossed, and with eight warps also 128 rows a program (one program
    then takes a 30-node tree's 210 rows of a KV head in two blocks, not four; for one token, 16
    rows either way)."""
    crossed = itertools.product((2, 4, 8, 16), (64, 128), (4, 8))
    base = [Tuning(splits_per_sm=s, block_n=b, num_warps=w) for s, b, w in crossed]
    base += [dataclasses.replace(t, max_block_r=128) for t in base if t.num_warps == 8]
    return sorted(base, key=lambda t: t != Tuning())


def describe(t: Tuning) -> str:
    """`t` as the environment variable's value, its fields that differ from the defaults."""
    default = Tuning()
    return ",".join(f"{f.name}={getattr(t, f.name)}" for f in dataclasses.fields(t)
                    if getattr(t, f.name) != getattr(default, f.name)) or "defaults"


# bf16 outputs (8 significant bits) of the same softmax summed in other splits and orders: a few
# units in the last place apart, as the kernel's own CUDA test allows (tests/models/test_prefix_attention.py)
SWEEP_TOL = 2e-2


@torch.inference_mode()
def kernel_sweep(lm, context: int, tokens=(1, 32)) -> tuple[str, dict[str, dict[int, float]], dict[str, str]]:
    """(title, {setting: {tokens: ms}}, {setting: why it was left out}): every layer's held
    attention (the kernel path a captured step runs), each layer over buffers of its own (one
    buffer read 28 times would sit in the card's L2 at 8K), at `context` cached entries, under each
    of sweep_settings. A setting that fails to launch (shared memory, say) or whose output differs
    from the defaults' by more than SWEEP_TOL is left out, with the reason."""
    lean, device = lm.lean, lm.device
    g = torch.Generator(device=device).manual_seed(context)
    capacity = context + context // 4                     # a grown cache's spare room, as models.cache keeps
    layers = len(lean.layers)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=lm.dtype)

    buffers = [(randn(lean.n_kv_heads, capacity, lean.head_dim), randn(lean.n_kv_heads, capacity, lean.head_dim))
               for _ in range(layers)]
    length = torch.tensor([context], device=device)
    times: dict[str, dict[int, float]] = {}
    failures: dict[str, str] = {}
    for n in tokens:
        q, new = randn(lean.n_heads, n, lean.head_dim), randn(lean.n_kv_heads, n, lean.head_dim)
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril()

        def attention():
            return [held_attention(q, new, new, k, v, length, mask, lean.scaling) for k, v in buffers]

        reference = None
        for setting in sweep_settings():
            name = describe(setting)
            if name in failures:
                continue
            try:
                with tuned(**dataclasses.asdict(setting)):
                    out = attention()[0]
                    if reference is None:
                        reference = out          # the defaults' (first)
                    torch.testing.assert_close(out, reference, rtol=SWEEP_TOL, atol=SWEEP_TOL)
                    times.setdefault(name, {})[n] = device_ms(attention)
            except AssertionError as e:
                failures[name] = f"{n} tokens: output differs from the defaults' ({str(e).splitlines()[1].strip()})"
            except Exception as e:               # a launch the card cannot take (out of shared memory, say)
                failures[name] = f"{n} tokens: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            if name in failures:
                times.pop(name, None)
    title = f"{lm.name}, {context} held entries in buffers of {capacity}, held attention ×{layers}"
    return title, times, failures


def sweep_markdown(title: str, times: dict[str, dict[int, float]], failures: dict[str, str] | None = None) -> str:
    tokens = sorted({n for row in times.values() for n in row})
    lines = [f"### {title}", "", "| setting | " + " | ".join(f"{n} new tokens, ms" for n in tokens) + " |",
             "|---|" + "---|" * len(tokens)]
    for name, row in sorted(times.items(), key=lambda kv: kv[1].get(tokens[0], float("inf"))):
        lines.append(f"| {name} | " + " | ".join(f"{row[n]:.3f}" if n in row else "–" for n in tokens) + " |")
    lines += [""] + [f"- left out: {name}: {why}" for name, why in sorted((failures or {}).items())]
    return "\n".join(lines).rstrip("\n") + "\n"


def best_setting(sweeps: list[dict[str, dict[int, float]]]) -> str:
    """The setting with the least time over every context and token count, among those timed at
    all of them (each timing relative to the defaults', so a long context does not outweigh a
    short one)."""
    def score(name):
        return sum(sweep[name][n] / sweep["defaults"][n] for sweep in sweeps for n in sweep[name])
    common = set.intersection(*(set(s) for s in sweeps))
    full = [name for name in common if all(set(s[name]) == set(s["defaults"]) for s in sweeps)]
    return min(full, key=score)


def markdown(title: str, rows: list[tuple[str, float]]) -> str:
    floor = rows[0][1]
    lines = [f"### {title}", "", "| part | ms | × floor |", "|---|---|---|"]
    lines += [f"| {name} | {ms:.3f} | {ms / floor:.2f} |" for name, ms in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model path or a random: shape (models.shapes)")
    parser.add_argument("--contexts", nargs="+", type=int, default=[8192, 32768])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="*", default=["cudagraph", "reduce-overhead", "reduce-overhead+packed"],
                        help="captured-step modes to time whole (CUDA only); +packed: over packed weights")
    parser.add_argument("--no-packed", dest="packed", action="store_false",
                        help="leave out the packed rows and modes (they copy the decoder layers' weights)")
    parser.add_argument("--kernel-sweep", action="store_true",
                        help="time the prefix-attention kernel's launch settings instead (CUDA and Triton)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if prefix_attention.environment_problem():
        parser.error(prefix_attention.environment_problem())
    if args.kernel_sweep and (torch.device(args.device).type != "cuda" or prefix_attention.triton is None):
        parser.error(f"--kernel-sweep times the Triton kernel on a CUDA device: --device {args.device}, "
                     f"CUDA {'present' if torch.cuda.is_available() else 'absent'}, Triton "
                     f"{'absent' if prefix_attention.triton is None else 'present'}")
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    if lm.lean is None:
        parser.error(f"{args.model}: no lean path for this model (its layers are not the Qwen2 kind)")
    if args.kernel_sweep:
        if not kernel_available(torch.zeros(1, 1, lm.lean.head_dim, device=lm.device, dtype=lm.dtype)):
            parser.error(f"--kernel-sweep: the kernel does not serve {lm.name}'s head size {lm.lean.head_dim} "
                         f"in {lm.dtype} (a power of two ≥ 16, a float dtype)")
        sweeps, tables = [], []
        for context in args.contexts:
            title, times, failures = kernel_sweep(lm, context)
            sweeps.append(times)
            tables.append(sweep_markdown(title, times, failures))
            print(tables[-1], flush=True)
            if args.out:                      # what is timed so far, in case the part is cut short
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "kernel_sweep.md").write_text("\n".join(tables))
        choice = best_setting(sweeps)
        print(f"fastest over every context and token count: {choice} (as now: {describe(prefix_attention.TUNING)})")
        if args.out:
            (args.out / "kernel_sweep.md").write_text("\n".join(tables) + f"\nfastest: {choice}\n")
            (args.out / "kernel_choice.txt").write_text("" if choice == "defaults" else choice)
        return
    bandwidth = copy_bandwidth(args.device)
    packed = packed_layers(lm.text) if args.packed else None
    modes = [m for m in args.modes if packed is not None or not m.endswith("+packed")]
    steps: dict = {}
    tables = []
    for context in args.contexts:
        tables.append(markdown(*anatomy(lm, context, bandwidth, steps, modes, packed)))
        print(tables[-1], flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "anatomy.md").write_text("\n".join(tables))


if __name__ == "__main__":
    main()
