"""CUDA graph capture that is safe with two models' threads in one process.

    graph, outputs = capture(body, device, pool=pool)     # body() warmed, then captured once
    graph.replay()                                        # outputs now hold this replay's results

torch's graph capture shares one default capture stream among all threads, and torch documents
that only one capture may be underway in a process at a time. With two models on one GPU (a draft's
thread and the target's, resources=gpu) each captures its request's graphs as its caches grow, at
the same moments: on a shared stream one capture can record the other thread's kernels too, a
graph that then writes another model's buffers (the likely cause of an out-of-bounds index_copy
met on an H200 in ParallelVLM's verification, with both models capturing). So here:

- one capture at a time in the process (a lock, held through the warm-up as well, so that no
  capture's warm-up runs while another's capture records);
- each capture on the calling thread's current stream when that is a stream of its own (the
  executor's stream workers: no other thread launches there, so nothing foreign is recorded), or
  on a stream this module keeps per device when the caller runs on the default stream, on which
  CUDA cannot capture;
- thread-local capture mode: the other thread may allocate and read from the host meanwhile.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

WARMUP = 2          # eager runs before a capture (cuBLAS handles and workspaces, Triton's compiles)

_LOCK = threading.Lock()
_OWN_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a capture from this thread records on: its current stream unless that is the
    device's default stream (not capturable), else this module's own for the device."""
    current = torch.cuda.current_stream(device)
    if current != torch.cuda.default_stream(device):
        return current
    if device not in _OWN_STREAMS:
        _OWN_STREAMS[device] = torch.cuda.Stream(device)
    return _OWN_STREAMS[device]


def capture(body: Callable[[], Any], device, *, pool=None, warmup: int = WARMUP) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run body() `warmup` times, then capture one call of it as a CUDA graph on `device`.
    -> (graph, what the captured call returned: tensors in the graph's memory, which each replay
    overwrites). pool: a graph pool handle to share memory with the caller's other graphs."""
    device = torch.device(device)
    with _LOCK:
        stream = capture_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                body()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            outputs = body()
        torch.cuda.current_stream(device).wait_stream(stream)
    return graph, outputs
