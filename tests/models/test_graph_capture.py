"""CUDA graph capture with two threads: one capture at a time, each on a stream no other thread
launches on. On the CPU the bookkeeping runs over stand-ins for torch.cuda's streams and graphs;
where CUDA is present, two threads capture at once for real and each graph replays its own work."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from models import graph_capture


class FakeStream:
    def __init__(self, name):
        self.name = name

    def wait_stream(self, other):
        pass

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and graph calls replaced: each thread's current stream is what it set
    in `local.stream` (else the default one); captures record (stream, start, end)."""
    local, captures, made = threading.local(), [], []
    default = FakeStream("default")

    def new_stream(device=None):
        made.append(FakeStream(f"own{len(made)}"))
        return made[-1]

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        start = time.perf_counter()
        yield
        captures.append((stream, start, time.perf_counter()))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(local, "stream", default))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(graph_capture, "_OWN_STREAMS", {})
    return local, captures, made


def test_two_threads_capture_one_at_a_time_each_on_its_own_stream(fake_cuda):
    local, captures, made = fake_cuda
    calls, outs = [], []
    both_started = threading.Barrier(2)

    def worker(name):
        local.stream = FakeStream(name)          # an executor's stream worker sets its own stream
        both_started.wait()

        def body():
            calls.append(name)
            time.sleep(0.02)                     # long enough for the other thread to try meanwhile
            return name

        _, out = graph_capture.capture(body, "cuda:0")
        outs.append(out)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("target", "draft")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outs) == ["draft", "target"]                   # both threads finished their capture
    assert sorted(s.name for s, _, _ in captures) == ["draft", "target"] and not made
    (_, _, first_end), (_, second_start, _) = sorted(captures, key=lambda c: c[1])
    assert first_end <= second_start                              # never two captures at once
    # each thread's warm-up runs (2) and capture (1) together: the lock spans the warm-up too
    assert calls in (["target"] * 3 + ["draft"] * 3, ["draft"] * 3 + ["target"] * 3)


def test_a_thread_on_the_default_stream_captures_on_a_stream_kept_for_the_device(fake_cuda):
    _, captures, made = fake_cuda
    graph_capture.capture(lambda: None, "cuda:0")
    graph_capture.capture(lambda: None, "cuda:0")
    assert len(made) == 1 and [s for s, _, _ in captures] == [made[0], made[0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs: needs CUDA")
def test_two_threads_capturing_at_once_on_cuda_each_replay_their_own_work():
    """Two worker threads, each on its own stream (as resources=gpu runs a target and a draft),
    capture long chains at the same moment, twenty times over; every graph then replays its own
    thread's arithmetic and nothing of the other's."""
    n, rounds = 1 << 20, 20
    results = {}
    start = threading.Barrier(2)

    def worker(scale: float):
        torch.cuda.set_device(0)
        stream = torch.cuda.Stream()
        x = torch.full((n,), 1.0, device="cuda")
        with torch.cuda.stream(stream):
            graphs = []
            for _ in range(rounds):
                start.wait()
                graphs.append(graph_capture.capture(lambda: (x * scale + 1) * scale, "cuda"))
            stream.synchronize()
            got = []
            for graph, out in graphs:
                graph.replay()
                got.append(out.clone())
            stream.synchronize()
        results[scale] = got

    threads = [threading.Thread(target=worker, args=(s,)) for s in (2.0, 3.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(results) == {2.0, 3.0}             # a thread that raised left no results
    for scale, outs in results.items():
        want = (1.0 * scale + 1) * scale
        assert len(outs) == rounds and all(torch.equal(o, torch.full_like(o, want)) for o in outs), scale
