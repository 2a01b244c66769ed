"""The lean step as CUDA graphs: captured once per token-count bucket over the cache's own
buffers, replayed every step, so a step costs its kernels and not the host's launches of them.

    step = CapturedStep(lean, mode="reduce-overhead")     # or "cudagraph"; models.lean.LeanDecoder
    step.warm(device, dtype)                              # compile and capture before any request
    hidden = step.run(cache, embeds, cos, sin, among)     # what LeanDecoder.forward calls

A graph replays fixed shapes at fixed addresses, and a decode step's shapes grow with the cache.
So the step is written over fixed buffers with the length as data (buffered_step, a layer at a
time: buffered_layer):
- each layer's keys and values are its models.cache GrowingLayer's whole buffers [KV, capacity,
  hd], spare room included, and how many entries each holds is a tensor; attention masks the
  spare room by a [capacity] comparison with that length, never a mask of tokens × context;
- the n new tokens (a step, a chain to verify, a tree's nodes with their ancestor mask as data)
  are padded up to a bucket (BUCKETS), the padding rows seeing only themselves; their keys and
  values are written at the held length inside the graph, and the cache then counts the real n
  (GrowingLayer.advance), so the padding lands in spare room and is overwritten later.

A graph is keyed by its bucket and the buffers' addresses and layouts: a rollback (crop) only moves
the length and replays the same graph; a cache that grows past its room or is pruned gets new
buffers and is captured again (once, tens of milliseconds). Graphs hold no reference to the
buffers they were captured over: one is replayed only while the cache in hand has buffers at
exactly its addresses and shapes, and it keeps the latest MAX_GRAPHS.

Modes: "cudagraph" captures the eager operations (no compile, a quick start); "reduce-overhead"
first compiles buffered_layer with inductor (fused norms, rotary and SwiGLU: fewer kernels a
layer; one compile serves every layer) and captures that. Both need CUDA. The eager lean path
(models.lean) stays the exact reference: the split attention sums the same terms in another
order, so in float32 the tokens are its tokens, and in bfloat16 they differ only where two logits
are within rounding of each other.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import torch

from models.compiling import private_copy, record_compile
from models.graph_capture import capture
from models.lean import LayerWeights, rms_norm
from models.packing import PackedLayer
from models.prefix_attention import held_attention

MODES = ("cudagraph", "reduce-overhead")
BUCKETS = (1, 2, 4, 8, 16, 32)   # token counts a graph is captured for (the lean path takes ≤ 32); more run uncaptured
MAX_GRAPHS = 32
PACKED_FIELDS = ("qkv", "qkv_bias", "o", "o_bias", "gate_up", "down")   # PackedLayer's tensors, tiles aside
_PLAIN = len(fields(LayerWeights))     # a constant: dataclasses.fields() inside a compiled function breaks its graph


def bucket_of(n: int) -> int | None:
    """The smallest bucket that holds n tokens, or None above the largest."""
    return next((b for b in BUCKETS if b >= n), None)


def buffered_layer(lean, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                   values: torch.Tensor, lengths: torch.Tensor, index: torch.Tensor, mask: torch.Tensor, *weights):
    """One decoder layer of `lean` over the new tokens x [n, hidden], attending to its whole
    buffers keys, values [KV, capacity, hd] of which the first lengths[index] are held (lengths
    int64 [layers], index int64 [1]); cos, sin [n, head_dim]; mask bool [n, n] among the
    new tokens; weights: the layer's LayerWeights fields in order, then, where the weights are
    packed (models.packing), PACKED_FIELDS of its PackedLayer: q, k and v are then one product, gate
    and up another (the small k and v products are the least efficient a step runs). -> the layer's
    output [n, hidden], its new keys and values [KV, n, hd]. One function for every layer, so that
    inductor compiles one layer, not the unrolled stack (minutes at 28 layers)."""
    new = {}
    plain = _PLAIN
    packed = PackedLayer(*weights[plain:]) if len(weights) > plain else None

    def attend(q, k, v):
        new["k"], new["v"] = k, v
        # index_select, not lengths[index]: a tensor used as a Python index is read on the host
        return held_attention(q, k, v, keys, values, lengths.index_select(0, index), mask, lean.scaling)

    x = lean.layer(x, LayerWeights(*weights[:plain]), cos, sin, attend, packed)
    return x, new["k"], new["v"]


def layer_tensors(w: LayerWeights, packed: PackedLayer | None) -> tuple:
    """What buffered_layer takes as `weights` for one layer."""
    plain = tuple(getattr(w, f.name) for f in fields(w))
    return plain if packed is None else plain + tuple(getattr(packed, name) for name in PACKED_FIELDS)


def buffered_step(lean, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list, values: list,
                  lengths: torch.Tensor, indices: list, mask: torch.Tensor, layer=buffered_layer,
                  packed: list | None = None):
    """The decoder layers of `lean` over the new tokens (buffered_layer each, `layer` compiled or
    not), their new keys and values written into the buffers at the held lengths. embeds [n, hidden];
    keys[l], values[l] [KV, capacity_l, hd]; indices[l]: int64 [1] tensors holding l; packed: the
    layers' PackedLayer (fused products) or None. -> final-norm hidden [n, hidden]."""
    x = embeds
    rows = lengths[:, None] + torch.arange(embeds.shape[0], device=lengths.device)                  # [layers, n]
    for i, (w, p) in enumerate(zip(lean.layers, packed or [None] * len(lean.layers))):
        x, k, v = layer(lean, x, cos, sin, keys[i], values[i], lengths, indices[i], mask, *layer_tensors(w, p))
        keys[i].index_copy_(1, rows[i], k)
        values[i].index_copy_(1, rows[i], v)
    return rms_norm(x, lean.final_norm, lean.eps)


@dataclass
class _Bucket:
    """One bucket's static inputs and, once captured, its graph and output."""

    size: int
    embeds: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    lengths: torch.Tensor
    graphs: OrderedDict = field(default_factory=OrderedDict)      # buffers' key -> (graph, hidden output)


class CapturedStep:
    """buffered_step for one LeanDecoder, replayed as CUDA graphs (see the module doc). With
    capture=False (any device) each call runs the graph's body directly: the same operations on
    the same buffers, what the CPU tests check against the eager path. packed: the layers'
    models.packing.PackedLayer, whose fused products the step then runs (default: the lean
    decoder's own, `lean.packed`, set where load_model packed the weights; False: none)."""

    def __init__(self, lean, mode: str = "reduce-overhead", *, capture: bool | None = None, packed=None):
        if mode not in MODES:
            raise ValueError(f"compile={mode!r}: one of {', '.join(MODES)}")
        self.lean, self.mode = lean, mode
        self.packed = (lean.packed if packed is None else packed) or None
        if self.packed is not None and len(self.packed) != len(lean.layers):
            raise ValueError(f"{len(self.packed)} packed layers for a decoder of {len(lean.layers)}")
        device = lean.layers[0].q.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"compile={mode}: CUDA graphs need a CUDA device, the model is on {device}")
        self._layer = (torch.compile(private_copy(buffered_layer), dynamic=True) if mode == "reduce-overhead"
                       else buffered_layer)       # a code object per model: see models.compiling.private_copy
        self._indices = [torch.tensor([i], device=device) for i in range(len(lean.layers))]
        self._buckets: dict[int, _Bucket] = {}
        self._recent: OrderedDict = OrderedDict()   # (bucket, buffers' key) of every graph, least recently used first
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0                   # graphs captured so far (tests, plan.txt)
        self.capture_bytes = 0              # memory the captures reserved

    # ------------------------------------------------------------------------- running

    @torch.inference_mode()
    def run(self, cache, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            among: torch.Tensor) -> torch.Tensor:
        """The n new tokens (embeds [n, hidden], rotary rows cos/sin [n, hd], among bool [n, n])
        over `cache` (its layers GrowingLayer), their keys and values appended. -> hidden [n, hidden]."""
        n = embeds.shape[0]
        size = bucket_of(n) or n                   # above the largest bucket: the body, uncaptured
        layers = cache.layers
        if not all(hasattr(layer, "buffers") for layer in layers):
            raise TypeError("captured steps need models.cache's growing cache (GrowingLayer layers)")
        # plain ints and tuples here: this runs before every replay, on the host, while the device
        # waits (a view per layer to read its length cost more than the graph's launch)
        lengths = [layer.held() for layer in layers]
        for layer, length in zip(layers, lengths):
            if layer.capacity() - length < size:
                layer.reserve(size)
        bucket = self._bucket(size, embeds)
        self._fill(bucket, embeds, cos, sin, among, lengths)
        buffers = [layer.buffers() for layer in layers]
        if not self.capture or bucket_of(n) is None:
            hidden = self._body(bucket, buffers)
        else:
            key = tuple((k.data_ptr(), v.data_ptr(), k.shape[-2], k.stride(), v.stride()) for k, v in buffers)
            if key not in bucket.graphs:
                self._capture(bucket, key, buffers)
            self._touch(bucket, key)
            graph, hidden = bucket.graphs[key]
            graph.replay()
        for layer in layers:
            layer.advance(n)
        return hidden[:n].clone()          # the output is the graph's: the next replay overwrites it

    def latest_graph(self, size: int) -> torch.cuda.CUDAGraph:
        """The graph the latest call of `size` new tokens replayed (bench.step_anatomy times it alone)."""
        graphs = self._buckets[bucket_of(size)].graphs
        return next(reversed(graphs.values()))[0]

    def _bucket(self, size: int, like: torch.Tensor) -> _Bucket:
        if size not in self._buckets:
            lean, dev = self.lean, like.device
            self._buckets[size] = _Bucket(size, like.new_zeros(size, like.shape[1]),
                                          like.new_ones(size, lean.head_dim), like.new_zeros(size, lean.head_dim),
                                          torch.eye(size, dtype=torch.bool, device=dev),
                                          torch.zeros(len(lean.layers), dtype=torch.long, device=dev))
        return self._buckets[size]

    @staticmethod
    def _fill(bucket: _Bucket, embeds, cos, sin, among, lengths: list[int]) -> None:
        """Copy this call's inputs into the bucket's static tensors; padding rows stay as made
        (zero inputs, each seeing only itself)."""
        n = embeds.shape[0]
        bucket.embeds[:n].copy_(embeds)
        bucket.cos[:n].copy_(cos)
        bucket.sin[:n].copy_(sin)
        bucket.mask[:n, :n].copy_(among)
        if n < bucket.size:
            bucket.embeds[n:].zero_()
            bucket.mask[:n, n:] = False
        bucket.lengths.copy_(torch.tensor(lengths, dtype=torch.long))

    def _body(self, bucket: _Bucket, buffers) -> torch.Tensor:
        """One step over the static inputs, the new keys and values written at the held lengths
        (what a graph captures)."""
        return buffered_step(self.lean, bucket.embeds, bucket.cos, bucket.sin, [k[0] for k, _ in buffers],
                             [v[0] for _, v in buffers], bucket.lengths, self._indices, bucket.mask, self._layer,
                             self.packed)

    def _capture(self, bucket: _Bucket, key, buffers) -> None:
        device = bucket.embeds.device
        reserved = torch.cuda.memory_reserved(device)
        if not any(b.graphs for b in self._buckets.values()):
            # a pool whose graphs were all dropped is released and cannot take a new capture
            self._pool = torch.cuda.graph_pool_handle()
        # the warm-up's writes land past the held length: spare room, overwritten later
        graph, hidden = capture(lambda: self._body(bucket, buffers), device, pool=self._pool)
        self._remember(bucket, key, (graph, hidden))
        self.captures += 1
        self.capture_bytes += max(0, torch.cuda.memory_reserved(device) - reserved)

    def _touch(self, bucket: _Bucket, key) -> None:
        """Mark bucket's graph for `key` the most recently replayed, in its bucket (latest_graph)
        and among all graphs (what _remember drops last)."""
        bucket.graphs.move_to_end(key)
        self._recent[(bucket.size, key)] = None
        self._recent.move_to_end((bucket.size, key))

    def _remember(self, bucket: _Bucket, key, entry) -> None:
        """Keep `entry` (graph, hidden output) for bucket and key, then drop the least recently
        replayed graphs, whatever their bucket, down to MAX_GRAPHS: never the one just kept, which
        the caller replays next (dropping from the bucket with the fewest graphs did just that when
        a new bucket's first graph came in over a full set)."""
        bucket.graphs[key] = entry
        self._touch(bucket, key)
        while len(self._recent) > MAX_GRAPHS:
            (size, oldest), _ = self._recent.popitem(last=False)
            del self._buckets[size].graphs[oldest]

    # ------------------------------------------------------------------------- warm-up

    @torch.inference_mode()
    def warm(self, device, dtype, name: str = "step", sizes: tuple[int, ...] = BUCKETS) -> float:
        """Compile (reduce-overhead) and capture every bucket over a small dummy cache, so that no
        request pays the compile, and the first capture of a request's own cache is tens of ms.
        Returns the seconds; the record names the captures' memory."""
        from models.cache import growing_cache

        lean, t0 = self.lean, time.perf_counter()
        hidden = lean.layers[0].q.shape[1]
        cache = growing_cache(lean.text.config)
        lean.forward_eager(cache, torch.zeros(3, hidden, device=device, dtype=dtype), torch.arange(3))
        for size in sizes:
            embeds = torch.zeros(size, hidden, device=device, dtype=dtype)
            cos, sin = lean._rotary(torch.arange(3, 3 + size), embeds)
            self.run(cache, embeds, cos, sin, torch.ones(size, size, dtype=torch.bool, device=device).tril())
            cache.crop(-size)              # transformers 5: a negative count of entries to drop
        for bucket in self._buckets.values():     # keyed to the dummy's buffers: a request captures its own
            bucket.graphs.clear()
        self._recent.clear()
        seconds = time.perf_counter() - t0
        memory = f", {self.capture_bytes / 2**20:.0f} MiB of graphs" if self.capture else ""
        record_compile(f"{name} lean step, {len(sizes)} token buckets captured{memory}", self.mode, seconds)
        return seconds
