"""What the adapters cost at real size: prefill time and per-token decode time against context
length, for random-weight models of the real checkpoints' shapes (models.shapes), on a GPU.

    python -m bench.bench_realsize --models random:qwen2.5-vl-7b random:qwen2.5-vl-32b \\
        --contexts 2048 4096 8192 16384 32768 --pair random:qwen2.5-vl-7b random:qwen2.5-vl-32b

For each model and context of N video tokens (plus the prompt's few text tokens), through the
VideoLM protocol exactly as the stages call it:
- encode_s: the vision tower on the frames that give N tokens (random pixels, the real frame size);
- prefill_s: one-shot prefill of the whole prompt at its MRoPE / 1-D positions (median of repeats);
- step_ms: one greedy decode step at that context: a one-token forward, argmax, and the host
  reading the token (what generation pays per token), mean over `steps` steps;
- verify_ms[k]: one forward scoring k new tokens over the same cache (a speculative round's
  verification), then the rollback; median of `repeats`.

With `--pair DRAFT TARGET`, the draft is also timed at the contexts it keeps after pruning a
share α of the video (`--alphas`), and a second table gives ParallelVLM's Table-3 analogue:
Tp (the target verifying `--gamma` tokens over the full context), Tq(α) (the draft's step over
the pruned one), c* = Tp / Tq(α), and the paper's Eq. 7 projection τ̂ · c* at a few acceptance
rates τ̂ (random weights have no acceptance of their own; the toy pair's is measured by bench_sd).

With `--peer`, each model's step is also timed through the peer a user would pick: transformers'
own Qwen2 decoder of the same shape and weights over a static cache, compiled (bench/peer.py;
CUDA graphs through "reduce-overhead" on a GPU).

Writes outputs/bench_realsize/<time>/: results.json (every figure), table.md, realsize.png.
Timings are synchronised device time on the wall clock; nothing here is a unit test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.bandwidth import copy_bandwidth
from models.load import load_model

PROMPT = "describe the video ."
ROOT = Path(__file__).resolve().parent.parent


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def frames_for(lm, n_video: int) -> tuple[int, tuple[int, int]]:
    """The frame count (at the model's frame size) whose video gives about `n_video` tokens."""
    hw = tuple(lm.frame_size or (448, 448))
    per_step, _ = lm.video_token_count(lm.frames_per_step, hw)
    steps = max(1, round(n_video / per_step))
    return steps * lm.frames_per_step, hw


def kept_rows(layout, alpha: float) -> torch.Tensor:
    """Prompt rows a draft keeps when it prunes a share `alpha` of the video: all text, and video
    tokens spread evenly over the video (which ones does not change the time; how many does)."""
    keep = max(1, math.ceil((1 - alpha) * layout.n_video))
    video = torch.linspace(0, layout.n_video - 1, keep).round().long().unique() + layout.video_start
    text = torch.cat([torch.arange(layout.video_start), torch.arange(layout.video.stop, layout.length)])
    return torch.cat([text, video]).sort().values


def measure(lm, n_video: int, *, steps: int, repeats: int, ks: tuple[int, ...], alpha: float = 0.0,
            paths: tuple[str, ...] = ("lean",), sparrow: dict | None = None, peer=None, profile: bool = False) -> dict:
    """Every timing of one model at one context (see the module doc); with `alpha` > 0 the cache
    holds the prompt with that share of its video pruned, at the kept tokens' own positions.
    profile: also where a one-token step's device time goes, per path (profile_step).
    peer: a bench.peer.PeerDecoder of this model, timed at the same context last."""
    device = lm.device
    n_frames, hw = frames_for(lm, n_video)
    layout = lm.layout(PROMPT, n_frames, hw, lm.fps or 2.0)
    g = torch.Generator().manual_seed(n_video)
    frames = torch.randint(0, 256, (n_frames, 3, *hw), dtype=torch.uint8, generator=g)
    encode_s, video = _timed(lambda: lm.encode(frames), device)
    embeds, positions = lm.embed(layout.ids, video, layout.video_start), layout.positions
    if alpha > 0:
        rows = kept_rows(layout, alpha)
        embeds, positions = embeds[rows.to(embeds.device)], positions[:, rows]
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    prefills = []
    for _ in range(repeats):
        cache = lm.new_cache()
        seconds, logits = _timed(lambda: lm.prefill(cache, embeds, positions), device)
        prefills.append(seconds)
        if len(prefills) < repeats:
            del cache
    token, position = int(logits.argmax()), layout.length
    step_ms, verify_ms, profiles = {}, {}, {}
    for path in paths:
        with decode_path(lm, path):
            step_ms[path], token, position = _steps(lm, cache, layout, token, position, steps)
            verify_ms[path] = _verifications(lm, cache, layout, token, position, ks, repeats)
            if profile:
                profiles[path] = profile_step(lm, cache, layout, token, position)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if torch.device(device).type == "cuda" else None
    floor_ms = 1000 * step_bytes(lm, cache) / copy_bandwidth(device)
    main = paths[-1]
    head = None
    if sparrow:
        with decode_path(lm, main):
            head = sparrow_costs(lm, cache, layout, token, position, repeats, **sparrow)
    peer_ms = None
    if peer is not None:
        del cache                                   # the peer's static cache takes its place in memory
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
        peer_ms = peer.step_ms(layout.length, steps)
    return {"sparrow": head, "n_video": layout.n_video, "alpha": alpha, "cached": embeds.shape[0], "context": layout.length,
            "n_frames": n_frames, "frame_hw": list(hw),
            "encode_s": encode_s, "prefill_s": statistics.median(prefills), "path": main,
            "step_ms": step_ms[main], "verify_ms": verify_ms[main], "floor_ms": floor_ms,
            "step_ms_by_path": step_ms, "verify_ms_by_path": verify_ms, "peak_gib": peak,
            "peer_step_ms": peer_ms, "peer_mode": peer.mode if peer is not None else None,
            **({"profile": profiles} if profile else {})}


def _steps(lm, cache, layout, token: int, position: int, steps: int) -> tuple[float, int, int]:
    """Mean ms of a greedy decode step (forward, argmax, the host reading the token) after 4
    untimed ones; returns it with the last token and the next position."""
    times = []
    for i in range(steps + 4):
        _sync(lm.device)
        start = time.perf_counter()
        logits = lm.score(cache, torch.tensor([token]), position, layout)
        token = int(logits[-1].argmax())             # the host reads the token, as generation does
        if i >= 4:
            times.append(time.perf_counter() - start)
        position += 1
    return 1000 * statistics.mean(times), token, position


def profile_step(lm, cache, layout, token: int, position: int, steps: int = 4, rows: int = 12) -> str:
    """torch.profiler's table of `steps` one-token steps (rolled back after), the operations and
    kernels that take the most device time (CPU time on the CPU) first: where a step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.device(lm.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    length = lm.cached_length(cache)
    with profile(activities=activities) as prof:
        for i in range(steps):
            int(lm.score(cache, torch.tensor([token]), position + i, layout)[-1].argmax())
    lm.drop_last(cache, lm.cached_length(cache) - length)
    key = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _verifications(lm, cache, layout, token: int, position: int, ks, repeats: int) -> dict:
    """Median ms of scoring k tokens over the cache, then rolling them back, for each k."""
    verify = {}
    for k in ks:
        length = lm.cached_length(cache)
        times = []
        for _ in range(repeats + 1):
            ids = torch.full((k,), token)
            seconds, _ = _timed(lambda: lm.score(cache, ids, position, layout), lm.device)
            lm.crop(cache, length)
            times.append(seconds)
        verify[k] = 1000 * statistics.median(times[1:])
    return verify


@torch.inference_mode()
def sparrow_costs(lm, cache, layout, token: int, position: int, repeats: int, *, total: int = 30, depth: int = 4,
                  topk: int = 8, text: int = 64, vocab: int | None = None) -> dict:
    """Sparrow's round at this context: a head shaped for `lm` (random weights) over a text-only
    cache of `text` tokens (VATA: it does not grow with the video) takes one step (a catch-up row)
    and drafts a `total`-`depth`-`topk` dynamic tree; the target verifies a tree of `total` nodes
    over its whole cache. vocab: also the tree with a draft vocabulary of that many tokens
    (speculative.draft_vocab; the LM head's first `vocab` rows: for time, which rows does not
    matter, and a `random:` shape's tokenizer is a toy's, far smaller than its LM head).
    Medians of `repeats` + 1 (the first untimed)."""
    from models.sparrow import HeadCache, SparrowConfig, SparrowHead
    from speculative.draft_vocab import DraftVocabulary
    from speculative.head_draft import draft_tree, head_stepper, tree_grower, warm_tree
    from speculative.tree import bushy_tree, tree_depths, tree_mask

    torch.manual_seed(0)
    head = SparrowHead(SparrowConfig.of_target(lm)).to(lm.device, lm.dtype).eval()
    head_cache = HeadCache.empty(head)
    z = torch.randn(text, lm.hidden_size, device=lm.device, dtype=lm.dtype)
    top = head(head_cache, z, torch.arange(text))[-1]

    stepper = head_stepper(head, lm)              # a CUDA graph beside a captured target, else the eager head
    row, feature = torch.tensor([token]), torch.randn(1, lm.hidden_size, device=lm.device, dtype=lm.dtype)

    def step():
        if stepper is not None:
            stepper(head_cache, row, feature, text)
        else:
            head(head_cache, head.fuse(lm.embed(row), feature), torch.tensor([text]))
        head_cache.crop(text)

    draft = DraftVocabulary.of(lm, range(vocab), among=lm.vocab_size) if vocab else None
    warm_tree(head, lm, total=total, depth=depth, topk=topk)       # the head's tree compiled as the path's steps are
    if draft is not None:
        warm_tree(head, lm, total=total, depth=depth, topk=topk, draft=draft)
    grow = tree_grower(head, lm)                                   # (captured as a CUDA graph when they are)

    def tree(draft=None):
        draft_tree(head, lm, head_cache, top, text, total=total, depth=depth, topk=topk, vocab=lm.vocabulary,
                   grow=grow, draft=draft)

    ids, parents = torch.full((total,), token), bushy_tree(total, topk)
    mask, depths = tree_mask(parents), tree_depths(parents)

    def verify():
        lm.score_tree(cache, ids, mask, depths, position, layout, hidden=True)
        lm.drop_last(cache, total)

    timed = {}
    parts = [("head_step_ms", step), ("head_tree_ms", tree), ("tree_verify_ms", verify)]
    if draft is not None:
        parts.append(("head_tree_vocab_ms", lambda: tree(draft)))
    for name, fn in parts:
        times = [_timed(fn, lm.device)[0] for _ in range(repeats + 1)]
        timed[name] = 1000 * statistics.median(times[1:])
    return {"shape": f"{total}-{depth}-{topk}", "text_tokens": text, "draft_vocab": draft.size if draft else None,
            **timed}


PATHS = ("forward", "lean", "compiled", "cudagraph", "reduce-overhead", "cudagraph+packed", "reduce-overhead+packed")


@contextlib.contextmanager
def decode_path(lm, path: str):
    """Score through `path` inside the block: "forward" (the model's own), "lean" (models.lean,
    eager), "compiled" (its step through inductor), "cudagraph" or "reduce-overhead" (captured as
    CUDA graphs, eager or inductor's kernels: models.captured_step), each of those two with
    "+packed": over packed copies of the layers' weights (models.packing: q, k and v in one
    product, gate and up in one; the copies take the layers' memory again, made once a model).
    A compiled or captured step is built and warmed on first use and kept on the model for the
    next context."""
    if path not in PATHS:
        raise ValueError(f"decode path {path!r}: one of {', '.join(PATHS)}")
    saved, saved_step, saved_mode = lm.lean, lm.lean.step if lm.lean is not None else None, lm.compile
    if path != "forward" and lm.lean is None:
        raise ValueError(f"{lm.name}: no lean path for this model")
    if path == "forward":
        lm.lean = None
    elif path != "lean":
        from models.captured_step import CapturedStep
        from models.packing import packed_layers
        from models.steps import build_step

        mode = "default" if path == "compiled" else path.removesuffix("+packed")
        steps = lm.__dict__.setdefault("_bench_steps", {})
        if path not in steps:
            if path.endswith("+packed"):
                if "_bench_packed" not in lm.__dict__:
                    lm._bench_packed = packed_layers(lm.text)
                steps[path] = CapturedStep(lm.lean, mode, packed=lm._bench_packed)
            else:
                steps[path] = build_step(lm.lean, mode)
            steps[path].warm(lm.device, lm.dtype, name=f"{lm.name} ({path})")
        lm.lean.step, lm.compile = steps[path], mode
    try:
        yield
    finally:
        lm.lean = saved
        if saved is not None:
            saved.step = saved_step
        lm.compile = saved_mode


def step_bytes(lm, cache) -> int:
    """Bytes a decode step must read: the decoder layers' weights, the final norm, the LM head
    (the input embedding is a row lookup) and the cached entries."""
    return lm.step_weight_bytes() + int(lm.cache_bytes(cache))


def label(n: int, alpha: float) -> str:
    return str(n) if not alpha else f"{n} α={alpha:g}"


def run_benchmark(models, contexts, *, device="cuda", dtype="bfloat16", attn="sdpa", steps=32, repeats=2,
                  ks=(2, 4, 8, 16), pair=None, alphas=(0.0, 0.5, 0.9), gamma=8, paths=None, sparrow: dict | None = None,
                  taus=(2.5, 3.0, 4.5), peer: str | None = None, out: Path | None = None, profile: bool = False) -> dict:
    """peer: None, or the compile mode of transformers' static-cache decoder timed beside each
    model's paths (bench.peer: "auto", "off", "default", "reduce-overhead")."""
    contexts = sorted(set(contexts))
    plan = {m: [(n, 0.0) for n in contexts] for m in models}
    if pair:
        draft, target = pair
        plan.setdefault(target, [(n, 0.0) for n in contexts])
        plan[draft] = sorted(set(plan.get(draft, [])) | {(n, float(a)) for n in contexts for a in alphas})
    on_gpu = torch.device(device).type == "cuda"
    paths = tuple(paths or (("forward", "lean") if on_gpu else ("lean",)))
    from models.prefix_attention import TUNING

    results = {"paths": list(paths), "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
               "dtype": dtype, "attn_implementation": attn, "torch": torch.__version__,
               "prefix_kernel": dataclasses.asdict(TUNING), "models": {}}
    bar = tqdm(total=sum(len(c) for c in plan.values()), desc="bench_realsize", unit="context")
    for path, model_plan in plan.items():
        load_s, lm = _timed(lambda: load_model(path, dtype=dtype, device=device, attn_implementation=attn), device)
        entry = {"parameters": sum(p.numel() for p in lm.model.parameters()), "load_s": load_s,
                 "layers": lm.n_layers, "contexts": {}}
        results["models"][path] = entry
        measure(lm, contexts[0], steps=2, repeats=1, ks=ks[:1], paths=paths)   # kernels, allocator, cuBLAS handles
        peer_decoder = None
        if peer is not None and lm.lean is not None:
            from bench.peer import PeerDecoder

            peer_decoder = PeerDecoder(lm, compile=peer)
        for n, alpha in model_plan:
            bar.set_postfix_str(f"{path.removeprefix('random:')} {label(n, alpha)}")
            try:
                entry["contexts"][label(n, alpha)] = measure(lm, n, steps=steps, repeats=repeats, ks=ks, alpha=alpha,
                                                             paths=paths, sparrow=sparrow if not alpha else None,
                                                             peer=peer_decoder if not alpha else None,
                                                             profile=profile and not alpha)
            except torch.OutOfMemoryError as e:
                entry["contexts"][label(n, alpha)] = {"error": "out of memory: " + str(e).splitlines()[0]}
            if on_gpu:
                torch.cuda.empty_cache()
            if out is not None:             # what is measured so far, in case the run is cut short
                write(results, out)
            bar.update()
        del lm, peer_decoder
        if on_gpu:
            torch.cuda.empty_cache()
    bar.close()
    if pair:
        results["speculative"] = speculative_table(results, pair, contexts, alphas, gamma)
    if sparrow:
        results["sparrow"] = sparrow_table(results, taus)
    if out is not None:
        write(results, out)
    return results


def speculative_table(results: dict, pair, contexts, alphas, gamma: int) -> list[dict]:
    """ParallelVLM Table 3's analogue: Tp, Tq(α), c* and Eq. 7's τ̂ · c* (see the module doc)."""
    draft, target = (results["models"][p]["contexts"] for p in pair)
    rows = []
    for n in contexts:
        t = target.get(label(n, 0.0), {})
        if "verify_ms" not in t:
            continue
        tp = t["verify_ms"].get(gamma) or t["verify_ms"][max(t["verify_ms"])]
        for a in alphas:
            d = draft.get(label(n, float(a)), {})
            if "step_ms" not in d:
                continue
            c = tp / d["step_ms"]
            rows.append({"n_video": t["n_video"], "alpha": a, "draft_cached": d["cached"], "tp_ms": tp,
                         "target_step_ms": t["step_ms"], "tq_ms": d["step_ms"], "c": c,
                         "eq7": {tau: tau * c for tau in (0.5, 0.7, 0.9)}})
    return rows


def sparrow_table(results: dict, taus) -> list[dict]:
    """Sparrow's projected decode speedup per model and context: τ tokens a round (the toy's
    measured M, given) over the round's time (the target's tree verification, the head's tree and
    one catch-up step; with a draft vocabulary, its tree) against one target step a token."""
    rows = []
    for path, entry in results["models"].items():
        for r in entry["contexts"].values():
            s = r.get("sparrow")
            if not s:
                continue
            round_ms = s["tree_verify_ms"] + s.get("head_tree_vocab_ms", s["head_tree_ms"]) + s["head_step_ms"]
            rows.append({"model": path.removeprefix("random:"), "n_video": r["n_video"], "step_ms": r["step_ms"],
                         **s, "round_ms": round_ms, "projected": {tau: tau * r["step_ms"] / round_ms for tau in taus}})
    return rows


def markdown(results: dict) -> str:
    lines = [f"device {results['device']}, {results['dtype']}, attention {results['attn_implementation']}, "
             f"torch {results['torch']}", "",
             f"decode ms/token by path ({', '.join(results['paths'])}); verify and Tp on the last; floor: the bytes "
             "a step reads (weights, cache) over the device's copy bandwidth; peer: transformers' Qwen2 decoder "
             "of the same shape and weights, static cache, torch.compile (bench/peer.py)", "",
             "| model | params (B) | video tokens | cached | encode s | prefill s | decode ms/token | floor ms | "
             "peer ms/token | verify k ms | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path, entry in results["models"].items():
        for n, r in entry["contexts"].items():
            name = path.removeprefix("random:")
            if "error" in r:
                lines.append(f"| {name} | {entry['parameters'] / 1e9:.2f} | {n} | – | – | – | – | – | – | {r['error']} | – |")
                continue
            verify = ", ".join(f"{k}: {v:.1f}" for k, v in r["verify_ms"].items())
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "–"
            steps = " / ".join(f"{v:.2f}" for v in r["step_ms_by_path"].values())
            peer = f"{r['peer_step_ms']:.2f} ({r['peer_mode']})" if r.get("peer_step_ms") is not None else "–"
            lines.append(f"| {name} | {entry['parameters'] / 1e9:.2f} | {n} | {r['cached']} | {r['encode_s']:.3f} | "
                         f"{r['prefill_s']:.3f} | {steps} | {r['floor_ms']:.2f} | {peer} | {verify} | {peak} |")
    if results.get("speculative"):
        lines += ["", "| video tokens | α | draft caches | Tp ms | target step ms | Tq(α) ms | c* = Tp/Tq | "
                  "τ̂·c* at τ̂ 0.5 / 0.7 / 0.9 |", "|---|---|---|---|---|---|---|---|"]
        for r in results["speculative"]:
            eq7 = " / ".join(f"{v:.1f}" for v in r["eq7"].values())
            lines.append(f"| {r['n_video']} | {r['alpha']:g} | {r['draft_cached']} | {r['tp_ms']:.1f} | "
                         f"{r['target_step_ms']:.1f} | {r['tq_ms']:.1f} | {r['c']:.2f} | {eq7} |")
    if results.get("sparrow"):
        taus = list(results["sparrow"][0]["projected"])
        lines += ["", "| model | video tokens | tree | target step ms | tree verify ms | head step ms | head tree ms "
                  "(all tokens / draft vocabulary) | "
                  f"projected speedup at τ = {' / '.join(f'{t:g}' for t in taus)} |", "|---|---|---|---|---|---|---|---|"]
        for r in results["sparrow"]:
            proj = " / ".join(f"{v:.2f}" for v in r["projected"].values())
            tree = f"{r['head_tree_ms']:.2f}" + (f" / {r['head_tree_vocab_ms']:.2f} ({r['draft_vocab']} tokens)"
                                                 if r.get("draft_vocab") else "")
            lines.append(f"| {r['model']} | {r['n_video']} | {r['shape']} | {r['step_ms']:.2f} | {r['tree_verify_ms']:.2f} | "
                         f"{r['head_step_ms']:.2f} | {tree} | {proj} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_prefill, ax_step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, entry in results["models"].items():
        rows = [r for r in entry["contexts"].values() if "error" not in r and not r["alpha"]]
        if not rows:
            continue
        x = [r["n_video"] for r in rows]
        label = name.removeprefix("random:")[:32]
        ax_prefill.plot(x, [r["encode_s"] + r["prefill_s"] for r in rows], "o-", label=f"{label} encode + prefill")
        ax_prefill.plot(x, [r["prefill_s"] for r in rows], "o--", label=f"{label} prefill")
        line, = ax_step.plot(x, [r["step_ms"] for r in rows], "o-", label=f"{label} one token")
        k = max(rows[0]["verify_ms"])
        ax_step.plot(x, [r["verify_ms"][k] for r in rows], "s--", color=line.get_color(), label=f"{label} {k} tokens")
    for ax, title, ylabel in ((ax_prefill, "prefill", "seconds"), (ax_step, "a decode step", "ms per forward")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("video tokens in context")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} ({results['device']}, {results['dtype']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax_prefill.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "table.md").write_text(markdown(results))
    profiles = [f"## {path.removeprefix('random:')}, {n} video tokens, {name}\n\n```\n{table}```\n"
                for path, entry in results["models"].items() for n, r in entry["contexts"].items()
                for name, table in r.get("profile", {}).items()]
    if profiles:
        (out / "profile.md").write_text("\n".join(profiles))
    plot(results, out / "realsize.png")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["random:qwen2.5-vl-7b", "random:qwen2.5-vl-32b"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8192, 16384, 32768],
                        help="video tokens per context")
    parser.add_argument("--pair", nargs=2, metavar=("DRAFT", "TARGET"), help="also ParallelVLM's Tp / Tq(α) table")
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.0, 0.5, 0.9])
    parser.add_argument("--gamma", type=int, default=8, help="tokens the target verifies per round (Tp)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--attn", default="sdpa")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--paths", nargs="+", choices=PATHS,
                        help="decode paths to time (default: forward and lean on a GPU, lean on the CPU); "
                             "verifications, Tp and Sparrow's round use the last")
    parser.add_argument("--sparrow", action="store_true",
                        help="also Sparrow's round: a head shaped for each model, its tree, the target's tree verification")
    parser.add_argument("--tree", nargs=3, type=int, default=[30, 4, 8], metavar=("TOTAL", "DEPTH", "TOPK"))
    parser.add_argument("--head-vocab", type=int, default=None, metavar="N",
                        help="also the head's tree with a draft vocabulary of N tokens (the projection uses it)")
    parser.add_argument("--tau", nargs="+", type=float, default=[2.5, 3.0, 4.5],
                        help="tokens per round to project Sparrow's speedup at (the toy's measured M)")
    parser.add_argument("--peer", nargs="?", const="auto", choices=("auto", "off", "default", "reduce-overhead"),
                        help="also time transformers' static-cache decoder of each model's shape (compile mode; "
                             "auto: reduce-overhead on CUDA, default on the CPU)")
    parser.add_argument("--profile", action="store_true",
                        help="also torch.profiler's table of a one-token step per path (profile.md)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if torch.device(args.device).type != "cuda":
        print("note: no CUDA device; CPU timings of real-size shapes take long and mean little")
    out = args.out or ROOT / "outputs" / "bench_realsize" / time.strftime("%Y-%m-%d_%H-%M-%S")
    ks = tuple(sorted({2, 4, args.gamma, 16}))
    results = run_benchmark(args.models, args.contexts, device=args.device, dtype=args.dtype, attn=args.attn,
                            steps=args.steps, repeats=args.repeats, ks=ks, pair=args.pair, alphas=args.alphas,
                            gamma=args.gamma, paths=args.paths,
                            sparrow=({**dict(zip(("total", "depth", "topk"), args.tree)), "vocab": args.head_vocab}
                                     if args.sparrow else None),
                            taus=tuple(args.tau), peer=args.peer, out=out, profile=args.profile)
    print(markdown(results))
    print(f"written to {out}")


if __name__ == "__main__":
    main()
