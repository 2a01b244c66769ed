"""Loading a checkpoint behind the VideoLM protocol: a local directory or a hub id, any dtype,
device and attention implementation. Weights load through safetensors only (`use_safetensors`),
and `trust_remote_code` stays off.

    lm = load_model("zoo/weights/qwen-target")
    lm = load_model("Qwen/Qwen2.5-VL-7B-Instruct", dtype="bfloat16", device="cuda", attn_implementation="sdpa")
    lm = load_model("random:qwen2.5-vl-32b", dtype="bfloat16", device="cuda")     # real shape, random weights (models.shapes)
    with adapted(net, tokenizer, preprocess) as lm: ...      # a model in memory (one being trained), lent
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from models import cpu_attention, cpu_kernels, shapes
from models.shapes import is_random

log = logging.getLogger("reelflow.models")
ROOT = Path(__file__).resolve().parent.parent
ADAPTERS = {"qwen2_5_vl": "models.qwen2_5_vl:QwenVL", "llava_onevision": "models.llava_onevision:LlavaOneVision"}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class ModelError(ValueError):
    """A checkpoint that cannot be used: missing, unsupported, or mismatched with its pair."""


def resolve(path: str) -> str:
    """A local directory as given, or relative to the project root; else `path` itself (a hub id)."""
    p = Path(path).expanduser()
    for candidate in (p, ROOT / p):
        if candidate.is_dir():
            return str(candidate.resolve())
    return path


def setting_problems(*, dtype: str = "float32", lean: bool = True, compile: str = "off", pack="auto") -> list[str]:
    """What is wrong with a model entry's settings, found without loading anything (a run's config
    check calls it for each model entry; load_model refuses the same). Each problem names the key,
    the value and the values it takes."""
    from models.steps import SETTINGS

    problems = []
    if dtype not in DTYPES:
        problems.append(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    if compile not in SETTINGS:
        problems.append(f"compile={compile!r}: use one of {', '.join(SETTINGS)}")
    if not (isinstance(pack, bool) or pack in ("auto", "tiled")):
        problems.append(f"pack={pack!r}: use auto, true, false or tiled")
    if compile != "off" and compile in SETTINGS and not lean:
        problems.append("compile needs the lean path (lean: true): it compiles the lean step")
    if pack == "tiled" and compile == "off":
        problems.append("pack=tiled serves the compiled steps' products: set compile (default or auto) too")
    return problems


def load_model(path: str, *, dtype: str = "float32", device: str = "cpu", attn_implementation: str = "sdpa",
               lean: bool = True, compile: str = "off", pack="auto", name: str | None = None):
    """The checkpoint at `path` behind the VideoLM protocol. lean: decode steps and verifications
    take models.lean's path over the model's weights (False: the model's own forward). compile:
    "off", a torch.compile mode for the lean path's steps (models.compiled_step.MODES, compiled
    and warmed here, before any request), a CUDA-graph mode on a GPU ("cudagraph",
    "reduce-overhead": models.captured_step, captured here), or "auto": whichever measures fastest
    on this device (measured once, then remembered: models.compile_auto). pack: the decoder
    layers' weights re-laid for few-row products (models.packing): True, False, "tiled" (packed,
    and the compiled steps' products by the tiled kernel over a copy in column tiles:
    models.tiled), or "auto" (whichever measures fastest here, for the steps `compile` makes; on a
    GPU only where they are compiled or captured; measured once, then remembered)."""
    from models.compile_auto import choose_mode
    from models.steps import CAPTURED, build_step

    problems = setting_problems(dtype=dtype, lean=lean, compile=compile, pack=pack)
    if problems:
        raise ModelError("; ".join(problems))
    if compile in CAPTURED and not str(device).startswith("cuda"):
        raise ModelError(f"compile={compile} captures CUDA graphs and needs a CUDA device (device={device}); "
                         "on the CPU use compile=default or auto")
    lm = _load(path, dtype=dtype, device=device, attn_implementation=attn_implementation, name=name)
    if not lean:
        lm.lean = None
    elif lm.lean is not None:
        _pack(lm, pack, fused=compile != "off")
    if lm.lean is not None and compile != "off":
        lm.lean.prefix_kernel = cpu_attention.serves(lm.lean.head_dim, lm.dtype, lm.device)
        kernel = f" | attention kernel {cpu_kernels.build_tag()}" if lm.lean.prefix_kernel else ""
        key = _machine_key(path, lm) + kernel
        mode = compile if compile != "auto" else choose_mode(lm, key)
        if mode != "off":
            lm.lean.step = build_step(lm.lean, mode)
            lm.lean.step.warm(lm.device, lm.dtype, name=lm.name)
        lm.compile = mode
    return lm


def _pack(lm, pack, *, fused: bool) -> None:
    """Pack `lm`'s decoder weights (models.packing) when `pack` says so: True; "tiled" (packed, and
    tiled for the compiled steps' products); "auto" on the CPU whichever of as loaded, packed and
    tiled the layers' products measure fastest in, in the form the steps will run (fused: the
    compiled step's, else one product a projection; tiles serve fused products only), measured
    once for the layers' shapes on this CPU and remembered (the weights' values do not matter, only
    their shapes and whether they are bfloat16 values, which tiles hold in half the bytes). On a
    GPU auto measures too where `compile` is not off (fused products: q, k and v in one, gate and
    up in one, timed as CUDA graphs), and with compile off leaves the weights as loaded: the eager
    lean path multiplies a projection at a time, so packing would change only the layout. (With
    compile=auto the weights are packed before the mode is chosen, so an eager choice then runs
    over the packed views: the same products, one a projection.)"""
    from models.compile_auto import remembered
    from models.compiling import record_compile
    from models.lean import LeanDecoder
    from models.packing import (
        CHOICES_FILE,
        MEASURED_LAYERS,
        layers_bytes,
        packed_copy,
        products_ms,
        qwen2_projections,
        shape_key,
        tiles_apply,
        tiles_width,
        with_tiles,
    )
    from models.packing import pack as pack_layers
    from models.tiled import unavailable_reason

    offer = pack in ("auto", "tiled") and tiles_apply(lm.text.layers[0].self_attn.q_proj.weight)
    width = tiles_width(lm.text) if offer else 4           # bytes a weight takes in tiles
    extra, room = layers_bytes(lm.text) * width // 4, _available_memory()
    tiles_fit = room is None or extra <= room // 2          # the tiles copy the layers: leave half of what is free
    if pack == "tiled":
        weight = lm.text.layers[0].self_attn.q_proj.weight
        if not tiles_apply(weight):
            why = unavailable_reason() or f"the weights are {weight.dtype} on {weight.device}"
            raise ModelError(f"pack=tiled needs float32 weights on the CPU and the tiled kernel: {why}")
        if not tiles_fit:
            raise ModelError(f"pack=tiled copies the decoder layers ({extra / 2**30:.1f} GiB) and this machine has "
                             f"{room / 2**30:.1f} GiB available: use pack=true (packed in place) or false")
    on_cpu = lm.device.type == "cpu"
    if pack is False or (pack == "auto" and not on_cpu and not fused):
        return
    started = time.perf_counter()
    if pack == "auto":
        form = "fused" if fused else "a product each"
        where = (f"{_cpu_name() or 'cpu'}, {torch.get_num_threads()} threads" if on_cpu
                 else torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else str(lm.device))
        key = f"{shape_key(lm.text)} | {form} | {lm.dtype} | {where}"
        offer_tiles = fused and tiles_fit and tiles_apply(lm.text.layers[0].self_attn.q_proj.weight)
        if offer_tiles:
            # a choice made before the kernel could be one, or with another build of it, does not hold
            key += f" | tiled kernel {cpu_kernels.build_tag()}, {'bfloat16' if width == 2 else 'float32'} tiles"
        elif fused and not tiles_fit:
            log.info("pack auto: the decoder layers' tiles (%.1f GiB) would not fit beside what is free (%.1f GiB); "
                     "choosing between as loaded and packed", extra / 2**30, room / 2**30)

        def measure():                # on copies of the first few layers, dropped after
            sample = [packed_copy(qwen2_projections(layer)) for layer in list(lm.text.layers)[:MEASURED_LAYERS]]
            return products_ms(lm.text, sample, fused=fused, tiles=offer_tiles)

        layout = remembered(CHOICES_FILE, f"{key} | torch {torch.__version__}", "layout", measure, "pack auto",
                            f"the decoder layers' products for 1 and 8 rows, {form}")
        if layout == "as_loaded":
            return
    else:
        layout = "tiled" if pack == "tiled" else "packed"
    lm.lean = None                   # its LayerWeights hold the loaded tensors: let each go once packed
    layers = pack_layers(lm.text)
    if layout == "tiled":
        layers = [with_tiles(p) for p in layers]
    lm.lean = LeanDecoder.of(lm.text)           # its LayerWeights name the rebound views
    lm.lean.packed = layers
    record_compile(f"{lm.name} weights", "auto" if pack == "auto" else "on", time.perf_counter() - started,
                   done="packed and tiled" if layout == "tiled" else "packed")


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            line = next((row for row in f if row.startswith("MemAvailable:")), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line else None


def _machine_key(path: str, lm) -> str:
    """What a measured choice holds for: the checkpoint, dtype, device, threads and torch."""
    import platform

    if lm.device.type == "cuda":
        where = torch.cuda.get_device_name(lm.device)
    else:
        where = f"{_cpu_name() or platform.machine()}, {torch.get_num_threads()} threads"
    return f"{resolve(path)} | {lm.dtype} | {where} | torch {torch.__version__}"


def _cpu_name() -> str | None:
    """The CPU's model name where Linux says it (/proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _load(path: str, *, dtype: str, device: str, attn_implementation: str, name: str | None):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelError(f"dtype={dtype!r}: use one of {', '.join(DTYPES)}")
    _check_attention(attn_implementation)
    if is_random(path):
        return _random_model(path, dtype=dtype, device=device, attn_implementation=attn_implementation, name=name)
    where = resolve(path)
    local = Path(where).is_dir()
    if not local:
        _refuse_a_missing_local_path(path)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=False)
    except (OSError, ValueError) as e:
        looks_like_path = local or path.startswith(("/", ".", "~")) or path.count("/") != 1
        hint = ("no such directory, or no config.json in it" if looks_like_path
                else "not a directory here, and a hub id needs the hub or its local cache: download it where "
                     "there is access and give its directory")
        detail = "" if looks_like_path else " " + str(e).splitlines()[0]
        raise ModelError(f"model path {path!r}: no usable checkpoint ({hint}).{detail}") from None
    arch = config.model_type
    if arch not in ADAPTERS:
        raise ModelError(f"model {path!r} is a {arch!r} model; reelflow adapts {', '.join(ADAPTERS)}")
    model = AutoModelForImageTextToText.from_pretrained(
        where, dtype=DTYPES[dtype], attn_implementation=attn_implementation, use_safetensors=True,
        trust_remote_code=False).to(device)
    tokenizer = AutoTokenizer.from_pretrained(where)
    preprocess = _preprocess(where) if local else {}
    return _adapt(arch, model, tokenizer, preprocess, name or Path(path).name, dtype, device, attn_implementation)


def _refuse_a_missing_local_path(path: str) -> None:
    """A path whose parent is a directory here (`zoo/qwen-target` where zoo/ exists) is a local
    path with a typo, not a hub id of the same shape: say so at once, with the checkpoints of that
    name or a close one under the parent, rather than after the hub's retries."""
    import difflib

    given = Path(path).expanduser()
    if given.is_absolute():            # not a hub id's shape: transformers refuses it without the hub
        return
    parent = next((root / given.parent for root in (Path(), ROOT)
                   if str(given.parent) not in ("", ".") and (root / given.parent).is_dir()), None)
    if parent is None:
        return
    checkpoints = {c.parent.relative_to(parent) for depth in range(1, 4)             # up to three levels down
                   for c in parent.glob("/".join(["*"] * depth) + "/config.json")}
    by_name = {}
    for c in sorted(checkpoints):
        by_name.setdefault(c.name, []).append(c)
    close = difflib.get_close_matches(given.name, list(by_name), n=3, cutoff=0.6)      # best first
    near = [str(given.parent / c) for name in close for c in by_name[name]]
    hint = f"; checkpoints under {given.parent}/ with a close name: {', '.join(near)}" if near else ""
    raise ModelError(f"model path {path!r}: no usable checkpoint (no such directory; {given.parent}/ is a directory "
                     f"here, so this is read as a local path, not a hub id){hint}")


def _check_attention(attn_implementation: str) -> None:
    if attn_implementation == "reelflow":    # ours: sdpa for prefill, grouped matmuls for a few new tokens
        from models.attention import register

        register()
    if attn_implementation == "flash_attention_2":
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise ModelError("attn_implementation=flash_attention_2 needs the flash-attn package "
                             "(pip install '.[gpu]'); on a GPU, sdpa already runs flash kernels") from None


def _preprocess(where: str) -> dict:
    path = Path(where) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def adapt(model, tokenizer, preprocess: dict | None = None, name: str | None = None):
    """The VideoLM over a transformers model already in memory (its weights, device and dtype as
    they are). The adapter puts the model in eval mode and may choose the vision tower's attention
    implementation (QwenVL): to lend a model that is being trained, use `adapted`."""
    arch = model.config.model_type
    if arch not in ADAPTERS:
        raise ModelError(f"a {arch!r} model; reelflow adapts {', '.join(ADAPTERS)}")
    module, cls = ADAPTERS[arch].split(":")
    adapter = getattr(__import__(module, fromlist=[cls]), cls)
    return adapter(model, tokenizer, dict(preprocess or {}), name or arch)


@contextlib.contextmanager
def adapted(model, tokenizer, preprocess: dict | None = None, name: str | None = None):
    """`adapt(...)` for the length of a `with` block, after which the model is in the mode (train or
    eval) and has the attention implementations it had before: a model in training can be checked
    through reelflow's own decoding and go on training exactly as it would have."""
    configs = [model.config, *(getattr(model.config, k, None) for k in ("text_config", "vision_config"))]
    configs = [c for c in configs if c is not None]
    implementations = [c._attn_implementation for c in configs]
    training = model.training
    try:
        yield adapt(model, tokenizer, preprocess, name)
    finally:
        for c, implementation in zip(configs, implementations):
            c._attn_implementation = implementation
        model.train(training)


def _adapt(arch, model, tokenizer, preprocess, name, dtype, device, attn_implementation):
    lm = adapt(model, tokenizer, preprocess, name)
    log.info("loaded %s (%s, %.2f M parameters, %s, %s, %s)", lm.name, arch,
             sum(p.numel() for p in model.parameters()) / 1e6, dtype, device, attn_implementation)
    return lm


def _random_model(path: str, *, dtype: str, device: str, attn_implementation: str, name: str | None):
    """A real checkpoint's shape with random weights (models.shapes), built on `device` directly:
    a 32B-shaped model never passes through host memory."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    try:
        shape, overrides = shapes.parse(path)
        family = shapes.SHAPES[shape][0]
        base = resolve(shapes.TOKENIZER_OF[family])
        config = shapes.build_config(AutoConfig.from_pretrained(base), shape, overrides)
    except (KeyError, ValueError) as e:
        raise ModelError(f"model path {path!r}: {e.args[0] if e.args else e}") from None
    where = torch.device(device)
    # the same random weights every time, without touching the caller's random state
    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []), where:
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=DTYPES[dtype],
                                                        attn_implementation=attn_implementation)
    preprocess = {**_preprocess(base), **shapes.preprocess_of(shape)}
    return _adapt(family, model, AutoTokenizer.from_pretrained(base), preprocess, name or path, dtype, device,
                  attn_implementation)


def tokenizer_of(path: str, name: str | None = None):
    """What `shared_vocabulary` reads of a checkpoint (its tokenizer, lm_head size and name)
    without loading its weights: a draft checks its target this way on a device of its own."""
    from types import SimpleNamespace

    from transformers import AutoConfig, AutoTokenizer

    if is_random(path):
        try:
            shape, overrides = shapes.parse(path)
        except (KeyError, ValueError) as e:
            raise ModelError(f"model path {path!r}: {e.args[0] if e.args else e}") from None
        where = resolve(shapes.TOKENIZER_OF[shapes.SHAPES[shape][0]])
        vocab_size = overrides.get("vocab_size", shapes.SHAPES[shape][1]["vocab_size"])
        return SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(where), vocab_size=vocab_size, name=name or path)
    where = resolve(path)
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError):
        raise ModelError(f"model path {path!r}: no usable checkpoint (config and tokenizer)") from None
    text = getattr(config, "text_config", config)
    return SimpleNamespace(tokenizer=tokenizer, vocab_size=text.vocab_size, name=name or Path(where).name)


def shared_vocabulary(target, draft) -> int:
    """The vocabulary size both models can be compared over: their tokenizers must agree on every
    token id below it; lm_head rows past the tokenizer (padding) are sliced off."""
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        only_t = sorted(set(t_vocab) - set(d_vocab))[:5]
        only_d = sorted(set(d_vocab) - set(t_vocab))[:5]
        moved = sorted(w for w in set(t_vocab) & set(d_vocab) if t_vocab[w] != d_vocab[w])[:5]
        raise ModelError(f"draft {draft.name!r} and target {target.name!r} have different tokenizers "
                         f"(only in target: {only_t}, only in draft: {only_d}, different ids: {moved}); "
                         "speculative decoding needs one tokenizer")
    n = len(t_vocab)
    if min(target.vocab_size, draft.vocab_size) < n:
        raise ModelError(f"a model's lm_head ({min(target.vocab_size, draft.vocab_size)} rows) is smaller than its tokenizer ({n})")
    if target.vocab_size != draft.vocab_size:
        log.info("lm_head sizes differ (target %d, draft %d): comparing over the shared tokenizer vocabulary of %d",
                 target.vocab_size, draft.vocab_size, n)
    return n
