"""Sparrow's draft tree replayed as a CUDA graph: EAGLE-2's whole expansion (speculative.head_draft
grow_tree, every level's head forward, LM head, top-k and bookkeeping) captured once and replayed
each round, so a round's tree costs its kernels and not the host's launches of them.

    grow = CapturedTree(head, lm)                  # on the target's device
    grow.warm(depth=4, topk=8, vocab=lm.vocabulary)
    tokens, parents, scores = grow(head, lm, cache.keys, cache.values, top, position, depth=4, topk=8,
                                   vocab=lm.vocabulary)      # grow_tree's call; outputs valid until the next call

On a GPU the head's tree ran compiled but not captured: a few hundred small kernels a round
launched from Python, 4-5 ms at the 7B's width on an H200 against a 7.5-ms target step. A graph
replays fixed shapes at fixed addresses, and the head's cache grows by the accepted tokens every
round; so the cache is copied each round into a buffer of fixed capacity (ROOM entries at a time:
the head's cache holds the prompt's text and the answer, tens to hundreds of entries), the held
length marks what is real, and the root's state and position are copied into static inputs. One
graph serves every round until the cache outgrows the buffer (a new buffer, captured again, once).

With capture=False (any device) each call runs the graph's body directly: the same operations on
the same buffers, what the CPU tests check against grow_tree.
"""

from __future__ import annotations

import math
import time

import torch

from models.compiling import record_compile
from speculative.head_draft import grow_tree

ROOM = 256          # the buffer's capacity grows in steps of this many entries
WARMUP = 2          # eager runs on a side stream before a capture (cuBLAS, sort workspaces, the allocator)


class CapturedTree:
    """grow_tree for one head and target, replayed as CUDA graphs (see the module doc)."""

    def __init__(self, head, lm, *, capture: bool | None = None):
        self.head, self.lm = head, lm
        weight = head.fc.weight
        device = weight.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError(f"a captured tree needs a CUDA device, the head is on {device}")
        c = head.config
        self._top = torch.zeros(c.hidden, device=device, dtype=weight.dtype)         # the root's head output
        self._position = torch.zeros(1, dtype=torch.long, device=device)             # its children's position
        self._length = torch.zeros(1, dtype=torch.long, device=device)               # entries held
        self._keys = self._values = None                                              # [KV, capacity, hd]
        self._graphs: dict[tuple, tuple] = {}          # (depth, topk, vocab) -> (graph, outputs)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captures = 0

    def __call__(self, head, lm, prefix_k: torch.Tensor, prefix_v: torch.Tensor, top: torch.Tensor,
                 position: int, *, depth: int, topk: int, vocab: int):
        """grow_tree(head, lm, prefix_k, prefix_v, top, position, ...) through the graph. The
        outputs are the graph's own tensors: read them (draft_tree copies them to the host) before
        the next call."""
        if head is not self.head or lm is not self.lm:
            raise ValueError("a CapturedTree serves the head and target it was made for")
        held = prefix_k.shape[1]
        if self._keys is None or self._keys.shape[1] < held:
            self._grow(held)
        self._keys[:, :held].copy_(prefix_k)
        self._values[:, :held].copy_(prefix_v)
        self._length.fill_(held)                       # fills on the device: no host-to-device copy
        self._position.fill_(position)
        self._top.copy_(top)
        shape = (depth, topk, vocab)
        if not self.capture:
            return self._body(*shape)
        if shape not in self._graphs:
            self._capture(shape)
        graph, outputs = self._graphs[shape]
        graph.replay()
        return outputs

    def _grow(self, held: int) -> None:
        """New buffers with room for `held` entries and more; the graphs over the old ones go."""
        c, weight = self.head.config, self.head.fc.weight
        capacity = math.ceil((held + 1) / ROOM) * ROOM
        self._keys = torch.zeros(c.kv_heads, capacity, c.head_dim, device=weight.device, dtype=weight.dtype)
        self._values = torch.zeros_like(self._keys)
        self._graphs.clear()

    def _body(self, depth: int, topk: int, vocab: int):
        held = torch.arange(self._keys.shape[1], device=self._keys.device) < self._length            # [capacity]
        return grow_tree(self.head, self.lm, self._keys, self._values, self._top, self._position, depth=depth,
                         topk=topk, vocab=vocab, held=held)

    def _capture(self, shape: tuple) -> None:
        device = self._keys.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._body(*shape)
        torch.cuda.current_stream(device).wait_stream(side)
        if not self._graphs:
            # a pool whose graphs were all dropped is released and cannot take a new capture
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            outputs = self._body(*shape)
        self._graphs[shape] = (graph, outputs)
        self.captures += 1

    @torch.inference_mode()
    def warm(self, *, depth: int, topk: int, vocab: int, what: str | None = None) -> float:
        """Capture this tree shape now over a small dummy cache (the first ROOM-entry buffer, which a
        request's text prompt usually fits), so that no request pays for it. Returns the seconds."""
        c, weight = self.head.config, self.head.fc.weight
        t0 = time.perf_counter()
        prefix = torch.zeros(c.kv_heads, 3, c.head_dim, device=weight.device, dtype=weight.dtype)
        self(self.head, self.lm, prefix, prefix, torch.zeros(c.hidden, device=weight.device, dtype=weight.dtype), 3,
             depth=depth, topk=topk, vocab=vocab)
        seconds = time.perf_counter() - t0
        what = what or f"sparrow tree of depth {depth}, top {topk}"
        record_compile(f"{what}, captured", "cudagraph" if self.capture else "off", seconds)
        return seconds
