"""Packed decoder weights for decode steps: each layer's q, k and v projections as one
[hidden, q + k + v] matrix, gate and up as one [hidden, 2 × intermediate], o and down as
[in, out]. The modules' own weights and biases are rebound as views of the packed tensors, so
nothing is held twice and the model's own forward reads the same numbers; its state_dict (what
save_pretrained writes) still gives each weight as a contiguous [out, in] tensor of its own.

    layers = pack(text_model)          # list[PackedLayer]; text_model.layers now read views of them
    ms = products_ms(text_model, packed_layers(text_model)[:4], fused=True)   # {"as_loaded": ms, "packed": ms}

Why: a step of a few new tokens is a run of matrix-vector products streaming the weights from
memory, so how fast the BLAS streams a weight is the step's speed. On an AMD EPYC core (MKL,
one thread) x·Wᵀ over a weight stored [out, in] read 7 GB/s from memory and x·W over one stored
[in, out] 21 GB/s; and one product over q, k and v together costs less than three (each call
starts its stream anew). The toy target's 42 layer products (19 MB): 2.3 ms as loaded, 1.35 ms
packed. Whether it pays depends on the BLAS and the CPU, so `pack: auto` measures it
(models.load, remembered like `compile: auto`).

On a GPU the layout matters less than the count: a captured step's small k and v products are
its least efficient kernels, and packed, q, k and v are one product (models.captured_step).

Two ways to use the packed tensors (models.lean): the eager lean path keeps one product per
projection, now over the views, so its results stay bit-identical to the model's own forward;
the compiled and captured steps multiply by the packed tensors themselves (three products become
one), which sums the same terms in another blocking: a rounding apart, as those steps already are.
With `pack: tiled` the packed tensors also get a copy in column tiles (`with_tiles`), and the
compiled step's products go through reelflow's kernel for few rows (models.tiled), which MKL runs
far below the core's peak.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models import tiled
from models.graph_capture import capture

CHOICES_FILE = "pack-choices.json"      # under reelflow's cache dir: what `pack: auto` chose per model and CPU


@dataclass(frozen=True)
class Tiles:
    """One decoder layer's packed weights again, in column tiles (models.tiled; biases padded to
    the tiles' width): what the compiled steps multiply by with `pack: tiled`."""

    qkv: torch.Tensor               # [ceil((q + 2 × kv) / 32), hidden, 32]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor                 # [ceil(hidden / 32), q, 32]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor           # [ceil(2 × intermediate / 32), hidden, 32]
    down: torch.Tensor              # [ceil(hidden / 32), intermediate, 32]


@dataclass(frozen=True)
class PackedLayer:
    """One decoder layer's weights, laid out [in, out] (and in tiles, with `pack: tiled`)."""

    qkv: torch.Tensor               # [hidden, q + 2 × kv]
    qkv_bias: torch.Tensor | None   # [q + 2 × kv]
    o: torch.Tensor                 # [q, hidden]
    o_bias: torch.Tensor | None     # [hidden]
    gate_up: torch.Tensor           # [hidden, 2 × intermediate]
    down: torch.Tensor              # [intermediate, hidden]
    tiles: Tiles | None = None

    @property
    def split(self) -> tuple[int, int, int]:
        """Widths of q, k and v in qkv's output."""
        q = self.o.shape[0]
        kv = (self.qkv.shape[1] - q) // 2
        return q, kv, kv

    @property
    def intermediate(self) -> int:
        return self.down.shape[0]


MEASURED_LAYERS = 4     # `auto` times this many layers' products (copies of them), not a whole large model's


def shape_key(text_model) -> str:
    """What the products' speed depends on: the decoder layers' count and shapes."""
    r = qwen2_projections(text_model.layers[0])
    return (f"{len(text_model.layers)} layers: q, k, v {[r[n].weight.shape[0] for n in 'qkv']} of "
            f"{r['q'].weight.shape[1]}, mlp {r['gate'].weight.shape[0]}")


def qwen2_projections(layer) -> dict[str, torch.nn.Linear]:
    """A Qwen2-kind decoder layer's seven projections by role (q, k, v, o, gate, up, down)."""
    a, m = layer.self_attn, layer.mlp
    return {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj,
            "gate": m.gate_proj, "up": m.up_proj, "down": m.down_proj}


def packed_copy(projections: dict[str, torch.nn.Linear]) -> PackedLayer:
    """One layer's projections (qwen2_projections' roles) copied into the packed layout (nothing
    rebound)."""
    q, k, v, o, gate, up, down = (projections[r] for r in ("q", "k", "v", "o", "gate", "up", "down"))
    if gate.bias is not None or up.bias is not None or down.bias is not None:
        raise ValueError("an MLP projection with a bias: not a Qwen2-kind layer")
    with torch.no_grad():
        qkv = torch.cat([q.weight, k.weight, v.weight]).t().contiguous()
        biases = [q.bias, k.bias, v.bias]
        qkv_bias = torch.cat(biases).contiguous() if all(b is not None for b in biases) else None
        if qkv_bias is None and any(b is not None for b in biases):
            raise ValueError("q, k and v projections with and without biases: not a Qwen2-kind layer")
        o_bias = o.bias.detach().clone() if o.bias is not None else None
        tensors = (qkv, qkv_bias, o.weight.t().contiguous(), o_bias,
                   torch.cat([gate.weight, up.weight]).t().contiguous(), down.weight.t().contiguous())
    # parameters, as the weights they replace: torch.compile keeps a parameter's shape static, a
    # plain tensor's dynamic (and may then tie a weight's size to a cache length that equals it)
    return PackedLayer(*(None if t is None else torch.nn.Parameter(t, requires_grad=False) for t in tensors))


def with_tiles(p: PackedLayer) -> PackedLayer:
    """p with its weights also in column tiles (models.tiled), for the tiled kernel."""
    def frozen(t):
        return None if t is None else torch.nn.Parameter(t, requires_grad=False)

    with torch.no_grad():
        tiles = Tiles(frozen(tiled.tile(p.qkv)), frozen(tiled.tile_bias(p.qkv_bias)), frozen(tiled.tile(p.o)),
                      frozen(tiled.tile_bias(p.o_bias)), frozen(tiled.tile(p.gate_up)), frozen(tiled.tile(p.down)))
    return dataclasses.replace(p, tiles=tiles)


def layers_bytes(text_model) -> int:
    """Bytes of the decoder layers' weights: what their tiles add (with_tiles holds a copy)."""
    return sum(p.numel() * p.element_size() for p in text_model.layers.parameters())


def tiles_width(text_model) -> int:
    """Bytes a weight of the decoder layers takes in tiles (models.tiled.tile): 2 where every
    projection weight is a bfloat16 value exactly (a bfloat16 checkpoint loaded in float32), else 4."""
    exact = all(tiled.holds_bfloat16(p) for layer in text_model.layers for name, p in layer.named_parameters()
                if name.endswith("proj.weight"))
    return 2 if exact else 4


def tiles_apply(weight: torch.Tensor) -> bool:
    """Whether the tiled kernel serves weights like this one: float32 on the CPU, kernel built."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and tiled.available()


def packed_layers(text_model) -> list[PackedLayer]:
    """packed_copy of every decoder layer."""
    return [packed_copy(qwen2_projections(layer)) for layer in text_model.layers]


def views(p: PackedLayer) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Each projection's weight [in, out] and bias (or None) as views of `p`, by role."""
    q, k, _ = p.split
    inter = p.intermediate
    bias = (lambda a, b: None) if p.qkv_bias is None else (lambda a, b: p.qkv_bias[a:b])
    return {"q": (p.qkv[:, :q], bias(0, q)), "k": (p.qkv[:, q:q + k], bias(q, q + k)),
            "v": (p.qkv[:, q + k:], bias(q + k, None)), "o": (p.o, p.o_bias),
            "gate": (p.gate_up[:, :inter], None), "up": (p.gate_up[:, inter:], None), "down": (p.down, None)}


def rebind(projections: dict[str, torch.nn.Linear], p: PackedLayer) -> None:
    """Make the projections' weights and biases views of `p` (the tensors they held are then
    free), keeping each parameter's requires_grad."""
    for role, (weight, bias_view) in views(p).items():
        module = projections[role]
        module.weight = torch.nn.Parameter(weight.t(), requires_grad=module.weight.requires_grad)   # [out, in] view
        if bias_view is not None:
            module.bias = torch.nn.Parameter(bias_view, requires_grad=module.bias.requires_grad)
        module.register_state_dict_post_hook(_saved_as_loaded)


def pack(text_model) -> list[PackedLayer]:
    """Pack every decoder layer and rebind the model's weights to views of the packed tensors,
    a layer at a time: each layer's old tensors are free before the next is copied (where nothing
    else holds them), so packing needs one layer's room beside the model, not the model's."""
    layers = []
    for layer in text_model.layers:
        projections = qwen2_projections(layer)
        layers.append(packed_copy(projections))
        rebind(projections, layers[-1])
    return layers


def _saved_as_loaded(module, state_dict, prefix, local_metadata) -> None:
    """A rebound module's state_dict entries as tensors of their own, contiguous: safetensors
    refuses a strided view, and transformers' save_pretrained reads views sharing one storage as
    tied weights."""
    for name in ("weight", "bias"):
        if prefix + name in state_dict:
            state_dict[prefix + name] = state_dict[prefix + name].clone(memory_format=torch.contiguous_format)


def qkv_products(h: torch.Tensor, p: PackedLayer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, hidden] -> q [n, q], k [n, kv], v [n, kv] by one product (with the biases)."""
    if p.tiles is not None:
        qkv = tiled.product(h, p.tiles.qkv, p.tiles.qkv_bias, p.qkv.shape[1])
    else:
        qkv = h @ p.qkv if p.qkv_bias is None else torch.addmm(p.qkv_bias, h, p.qkv)
    return qkv.split(p.split, -1)


def o_product(attn: torch.Tensor, p: PackedLayer) -> torch.Tensor:
    """attn [n, q] -> [n, hidden]."""
    if p.tiles is not None:
        return tiled.product(attn, p.tiles.o, p.tiles.o_bias, p.o.shape[1])
    return attn @ p.o if p.o_bias is None else torch.addmm(p.o_bias, attn, p.o)


def mlp_products(h: torch.Tensor, p: PackedLayer) -> torch.Tensor:
    """SwiGLU over h [n, hidden] with gate and up in one product -> [n, hidden]."""
    if p.tiles is not None:
        gate, up = tiled.product(h, p.tiles.gate_up, None, p.gate_up.shape[1]).split(p.intermediate, -1)
        return tiled.product(F.silu(gate) * up, p.tiles.down, None, p.down.shape[1])
    gate, up = (h @ p.gate_up).split(p.intermediate, -1)
    return (F.silu(gate) * up) @ p.down


def _fused_products(h: torch.Tensor, p: PackedLayer) -> torch.Tensor:
    q, _, _ = qkv_products(h, p)
    return mlp_products(o_product(q, p), p)


def _products_each(h: torch.Tensor, w: dict) -> torch.Tensor:
    """A product a projection over views (views()): what a rebound module computes."""
    def linear(x, role):
        return F.linear(x, w[role][0].t(), w[role][1])

    linear(h, "k"), linear(h, "v")
    o = linear(linear(h, "q"), "o")
    return linear(F.silu(linear(o, "gate")) * linear(o, "up"), "down")


def _loaded_products(h: torch.Tensor, layer) -> torch.Tensor:
    a, m = layer.self_attn, layer.mlp
    q = a.q_proj(h)
    a.k_proj(h), a.v_proj(h)
    o = a.o_proj(q)
    return m.down_proj(F.silu(m.gate_proj(o)) * m.up_proj(o))


@torch.inference_mode()
def products_ms(text_model, packed: list[PackedLayer], *, fused: bool, rows: tuple[int, ...] = (1, 8),
                rounds: int = 20, tiles: bool = True) -> dict[str, float]:
    """Milliseconds of the weight products of the first len(packed) layers (`packed` their copies)
    on their device (on CUDA, CUDA graphs' replays: _timer) over `rows`-row inputs (a step and an
    8-token verification), as loaded (a product each) and packed (fused: the compiled and
    captured steps' three products, else a product each over the packed views), and with fused
    products tiled too where the tiled kernel runs (float32 on the CPU) and `tiles` allows;
    interleaved round by round; medians. The attention between them is left out:
    it is the same every way."""
    first = text_model.layers[0].self_attn.q_proj.weight
    hidden = first.shape[1]
    inputs = [torch.randn(n, hidden, device=first.device, dtype=first.dtype) for n in rows]
    loaded = list(text_model.layers)[:len(packed)]
    laid = [views(p) for p in packed]

    ways = {"as_loaded": lambda h: [_loaded_products(h, layer) for layer in loaded],
            "packed": lambda h: ([_fused_products(h, p) for p in packed] if fused
                                 else [_products_each(h, w) for w in laid])}
    if fused and tiles and tiles_apply(first):
        tiled_layers = [with_tiles(p) for p in packed]
        ways["tiled"] = lambda h: [_fused_products(h, p) for p in tiled_layers]
    timers = {way: _timer(lambda run=run: [run(h) for h in inputs], first.device) for way, run in ways.items()}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for r in range(rounds + 2):                       # the first two rounds untimed
        for way, timed in timers.items():
            seconds = timed()
            if r >= 2:
                times[way].append(seconds)
    return {way: 1000 * statistics.median(t) for way, t in times.items()}


def _timer(run, device: torch.device):
    """A function that runs `run` once and returns its seconds. On the CPU, the host clock. On
    CUDA, `run` is captured as a CUDA graph (warmed first: cuBLAS's handles and workspaces) and
    each call times one replay between device events: the kernels alone, what a captured step
    pays. Launches are left out, so where the steps are compiled but not captured (which launch
    each product) this understates what fusing saves; it never overstates it. Captured through
    models.graph_capture: another model may be loading in another thread meanwhile (resources=gpu
    sets both models up at once)."""
    if device.type != "cuda":
        def timed() -> float:
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        return timed
    graph, _ = capture(run, device)

    def replayed() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000
    return replayed
