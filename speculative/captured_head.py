"""The Sparrow head's work in a round replayed as CUDA graphs: its catch-up step over the tokens
the target just accepted (CapturedHeadStep) and EAGLE-2's whole expansion (CapturedTree:
speculative.expansion grow_tree, every level's head forward, LM head, top-k and bookkeeping),
each captured once and replayed, so a round costs their kernels and not the host's launches.

    grow = CapturedTree(head, lm)                  # on the target's device
    grow.warm(depth=4, topk=8, vocab=lm.vocabulary)
    tokens, parents, scores = grow(head, lm, cache.keys, cache.values, top, position, depth=4, topk=8,
                                   vocab=lm.vocabulary)      # grow_tree's call; outputs valid until the next call
    step = CapturedHeadStep(head, lm)
    out = step(cache, ids, features, position)   # the head over fuse(embed(ids), features), appended to cache

On a GPU the head's tree ran compiled but not captured: a few hundred small kernels a round
launched from Python, 4-5 ms at the 7B's width on an H200 against a 7.5-ms target step, and its
one-row catch-up step took 1.2-1.6 ms, eager. A graph replays fixed shapes at fixed addresses,
and the head's cache grows by the accepted tokens every round; so the cache is copied each round
into a buffer of fixed capacity (ROOM entries at a time: the head's cache holds the prompt's text
and the answer, tens to hundreds of entries), the held length marks what is real, and the root's
state and position are copied into static inputs. One graph serves every round until the cache
outgrows the buffer (a new buffer, captured again, once).
The catch-up step has a graph per number of rows (one to the tree's depth plus one); its new keys
and values come out of the graph and are appended to the head's cache after the replay.

The captured step attends as the tree's levels do (models.compiled_step.split_attention over the
buffer's held part, merged with the new rows by log-sum-exp), where the eager head runs one
softmax: the head's states differ by float32 rounding, which can only move a draft, never the
target's output.

With capture=False (any device) each call runs the graph's body directly: the same operations on
the same buffers, what the CPU tests check against grow_tree and the eager head.
"""

from __future__ import annotations

import math
import time

import torch

from models.compiling import record_compile
from models.graph_capture import capture
from speculative.expansion import grow_tree

ROOM = 256          # the buffer's capacity grows in steps of this many entries


class _HeadGraphs:
    """What both captured parts share: a fixed buffer the head's cache is copied into before each
    replay (its held length as data), and captures into one memory pool. One drafter at a time:
    the buffers and the graphs' outputs are shared by every call (a stage drives one drafter)."""

    def __init__(self, head, lm, capture: bool | None):
        self.head, self.lm = head, lm
        weight = head.fc.weight
        device = weight.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"a captured head needs a CUDA device, the head is on {device}")
        self._position = torch.zeros(1, dtype=torch.long, device=device)             # the first row's position
        self._length = torch.zeros(1, dtype=torch.long, device=device)               # entries held
        self._keys = self._values = None                                              # [KV, capacity, hd]
        self._graphs: dict[tuple, tuple] = {}          # shape -> (graph, outputs)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0
        self.capture_bytes = 0          # memory the captures reserved (plan.txt, through warm's record)

    def _load(self, prefix_k: torch.Tensor, prefix_v: torch.Tensor, position: int) -> None:
        """Copy the head's cache [KV, L, hd] into the buffer (a larger one when it has outgrown it;
        the graphs over the old one go) and set the held length and the position, on the device."""
        held = prefix_k.shape[1]
        if self._keys is None or self._keys.shape[1] < held:
            c, weight = self.head.config, self.head.fc.weight
            capacity = math.ceil((held + 1) / ROOM) * ROOM
            self._keys = torch.zeros(c.kv_heads, capacity, c.head_dim, device=weight.device, dtype=weight.dtype)
            self._values = torch.zeros_like(self._keys)
            self._graphs.clear()
        self._keys[:, :held].copy_(prefix_k)
        self._values[:, :held].copy_(prefix_v)
        self._length.fill_(held)                       # fills on the device: no host-to-device copy
        self._position.fill_(position)

    def _held(self) -> torch.Tensor:
        return torch.arange(self._keys.shape[1], device=self._keys.device) < self._length            # [capacity]

    def _replay(self, shape: tuple, body):
        """body() through the graph captured for `shape` (captured now if new); its outputs."""
        if not self.capture:
            return body()
        if shape not in self._graphs:
            device = self._keys.device
            reserved = torch.cuda.memory_reserved(device)
            if not self._graphs:
                # a pool whose graphs were all dropped is released and cannot take a new capture
                self._pool = torch.cuda.graph_pool_handle()
            graph, outputs = capture(body, device, pool=self._pool)
            self._graphs[shape] = (graph, outputs)
            self.captures += 1
            self.capture_bytes += max(0, torch.cuda.memory_reserved(device) - reserved)
        graph, outputs = self._graphs[shape]
        graph.replay()
        return outputs

    def _memory(self) -> str:
        """What the captures reserved so far, for the compile record (nothing without capture)."""
        return f", {self.capture_bytes / 2**20:.0f} MiB of graphs" if self.capture else ""

    def _check(self, head, lm) -> None:
        if head is not self.head or lm is not self.lm:
            raise ValueError("a captured head serves the head and target it was made for")


class CapturedTree(_HeadGraphs):
    """grow_tree for one head and target, replayed as CUDA graphs (see the module doc)."""

    def __init__(self, head, lm, *, capture: bool | None = None):
        super().__init__(head, lm, capture)
        self._top = torch.zeros(head.config.hidden, device=head.fc.weight.device, dtype=head.fc.weight.dtype)

    def __call__(self, head, lm, prefix_k: torch.Tensor, prefix_v: torch.Tensor, top: torch.Tensor,
                 position: int, *, depth: int, topk: int, vocab: int, draft=None):
        """grow_tree(head, lm, prefix_k, prefix_v, top, position, ...) through the graph. The
        outputs are the graph's own tensors: read them (draft_tree copies them to the host) before
        the next call. A draft vocabulary's graph is keyed by its tensors' addresses, which it reads."""
        self._check(head, lm)
        self._load(prefix_k, prefix_v, position)
        self._top.copy_(top)
        rows = None if draft is None else (draft.ids.data_ptr(), draft.weight.data_ptr(), draft.size)
        return self._replay(("tree", depth, topk, vocab, rows), lambda: grow_tree(
            self.head, self.lm, self._keys, self._values, self._top, self._position, depth=depth, topk=topk,
            vocab=vocab, held=self._held(), draft=draft))

    @torch.inference_mode()
    def warm(self, *, depth: int, topk: int, vocab: int, what: str | None = None, draft=None) -> float:
        """Capture this tree shape now over a small dummy cache (the first ROOM-entry buffer, which a
        request's text prompt usually fits), so that no request pays for it. Returns the seconds."""
        c, weight = self.head.config, self.head.fc.weight
        t0 = time.perf_counter()
        prefix = torch.zeros(c.kv_heads, 3, c.head_dim, device=weight.device, dtype=weight.dtype)
        self(self.head, self.lm, prefix, prefix, torch.zeros(c.hidden, device=weight.device, dtype=weight.dtype), 3,
             depth=depth, topk=topk, vocab=vocab, draft=draft)
        seconds = time.perf_counter() - t0
        what = what or f"sparrow tree of depth {depth}, top {topk}"
        record_compile(f"{what}, captured{self._memory()}", "cudagraph" if self.capture else "off", seconds)
        return seconds


class CapturedHeadStep(_HeadGraphs):
    """The head over a few new rows (a round's catch-up), replayed as a CUDA graph per row count."""

    @torch.inference_mode()
    def warm(self, *, rows: int) -> float:
        """Capture the steps of 1..rows rows now over a small dummy cache (the first ROOM-entry
        buffer), so that no round pays for a capture. Returns the seconds."""
        from models.sparrow import HeadCache

        c, weight = self.head.config, self.head.fc.weight
        t0 = time.perf_counter()
        for m in range(1, rows + 1):
            cache = HeadCache(*(torch.zeros(c.kv_heads, 3, c.head_dim, device=weight.device, dtype=weight.dtype)
                                for _ in range(2)))
            self(cache, torch.zeros(m, dtype=torch.long),
                 torch.zeros(m, c.hidden, device=weight.device, dtype=weight.dtype), 3)
        seconds = time.perf_counter() - t0
        record_compile(f"sparrow head step, 1-{rows} rows, captured{self._memory()}", "cudagraph" if self.capture
                       else "off", seconds)
        return seconds

    def __init__(self, head, lm, *, capture: bool | None = None):
        super().__init__(head, lm, capture)
        self._inputs: dict[int, tuple] = {}            # rows -> (ids [m], features [m, hidden], causal mask [m, m])

    @torch.inference_mode()
    def __call__(self, cache, ids: torch.Tensor, features: torch.Tensor, position: int) -> torch.Tensor:
        """The head over fuse(embed(ids), features) (ids [m], features [m, hidden]) at positions
        position.. after `cache` (models.sparrow.HeadCache); their keys and values appended to it.
        -> the head's outputs [m, hidden]."""
        m = ids.shape[0]
        self._load(cache.keys, cache.values, position)
        if m not in self._inputs:
            weight = self.head.fc.weight
            self._inputs[m] = (torch.zeros(m, dtype=torch.long, device=weight.device),
                               torch.zeros(m, self.head.config.hidden, device=weight.device, dtype=weight.dtype),
                               torch.ones(m, m, dtype=torch.bool, device=weight.device).tril())
        static_ids, static_features, mask = self._inputs[m]
        static_ids.copy_(ids)
        static_features.copy_(features)

        def body():
            head, c = self.head, self.head.config
            z = head.fuse(self.lm.embed(static_ids), static_features)
            none = self._keys.new_zeros(c.kv_heads, 0, c.head_dim)
            positions = self._position + torch.arange(m, device=self._position.device)
            return head.rows(z, positions, self._keys, self._values, none, none, mask, self._held())

        out, k, v = self._replay(("step", m), body)
        cache.keys, cache.values = torch.cat([cache.keys, k], 1), torch.cat([cache.values, v], 1)
        return out.clone()
