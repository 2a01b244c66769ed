"""Workers run jobs for the executor. Thread and process differ in one method, `execute`.

- ThreadWorker: a thread with its own torch thread count (torch.set_num_threads is per thread).
- StreamWorker: a ThreadWorker whose jobs run inside a CUDA stream; it synchronises the stream
  once per job, so timings are real and returned items are complete. An item emitted mid-job (a
  tap) carries a CUDA event recorded on the producer's stream (StreamMark); the consumer's
  stream waits on it (a host consumer synchronises on it) before the job that reads it.
- ProcessWorker: a spawned child process holding its stages (its side: graph/process_child.py);
  the parent-side thread forwards emits (with an acknowledgement, so backpressure reaches the
  child) and waits for the result.
- InlineWorker: runs a job to completion while the caller waits (the sequential runner), on the
  one thread all of a sequential executor's inline workers share.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from typing import Any, Callable

from graph.context import Cancelled, StageContext
from graph.jobs import Job, RemoteError, run_phase
from graph.process_child import child_main, recv, send
from graph.resources import pin_to
from graph.spawn import SpawnWithoutMainContext

log = logging.getLogger(__name__)

_TORCH_INIT = threading.Lock()
REALTIME_POLICIES = tuple(getattr(os, name) for name in ("SCHED_FIFO", "SCHED_RR") if hasattr(os, name))


def leave_realtime_scheduling() -> bool:
    """Put the calling thread back under the normal time-sharing policy if it runs under a
    real-time one (SCHED_FIFO / SCHED_RR); True if it did. Why: worker threads and processes
    inherit the policy, and OpenMP threads spin-wait; a spinning real-time thread never yields
    its core to the thread it waits for, so the run livelocks (seen: SVT-AV1, run as root, leaves
    the thread that encoded with it under SCHED_FIFO 99, and everything it started after spun two
    cores for good). Lowering one's own policy needs no privilege."""
    if not hasattr(os, "sched_getscheduler"):
        return False
    policy = os.sched_getscheduler(0)
    if policy not in REALTIME_POLICIES:
        return False
    log.warning("this process runs under a real-time scheduling policy (%s, inherited from whatever "
                "started it); reelflow's spinning worker threads would livelock under it, so it now "
                "runs under SCHED_OTHER", "SCHED_FIFO" if policy == os.SCHED_FIFO else "SCHED_RR")
    os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    return True


def init_torch_runtime() -> None:
    """Initialise torch's threading from the main thread, before any worker thread touches it:
    worker threads then only adjust their own count (under a lock), never race to create it.

    The warm-up op runs with one thread. Why: a multi-threaded op on the main thread gives it an
    OpenMP team that lives as long as the process, and once libgomp manages more threads than
    there are cores it stops spinning between parallel regions (its "throttled" mode), so every
    worker thread's torch work then pays a futex wake-up per region: measured on 2 cores, a 6-layer
    toy forward on a worker thread took 0.9 s instead of 0.6 s for the rest of the process after
    one 64x64 matmul with 2 threads on the main thread, and 0.6 s after the same matmul with 1."""
    import torch

    leave_realtime_scheduling()  # before any worker thread or process inherits it
    with _TORCH_INIT:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        (torch.ones(64, 64) @ torch.ones(64, 64)).sum().item()
        torch.set_num_threads(threads)



class StreamMark:
    """A ReadyMark: a CUDA event recorded on the producer's stream right after the work that made
    an item (an item emitted mid-call may still be being computed when it is handed over). A
    consumer on another stream makes its stream wait for it (no host wait); a consumer on the
    host waits for it before reading."""

    def __init__(self, stream):
        import torch

        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait_on_stream(self, stream) -> None:
        stream.wait_event(self.event)

    def wait_on_host(self) -> None:
        self.event.synchronize()



def _device(name: str):
    import torch

    return torch.device(name)




class Worker:
    """Base: a thread that takes jobs from a queue and runs `execute` on each."""

    def __init__(self, name: str, torch_threads: int, device: str = "cpu",
                 elastic: Callable[[], int] | None = None, affinity: tuple[int, ...] | None = None):
        self.name, self.torch_threads, self.device, self.affinity = name, torch_threads, device, affinity
        # torch_threads: elastic — asked before each call how many threads to use now
        self.elastic, self._threads_now = elastic, torch_threads
        self.stages: dict[str, Any] = {}
        self.busy = False
        self.waiting = False          # its job's emit waits on a full channel: busy, but on no core
        self.running: str | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"reelflow-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.busy = True
        self.running = job.node       # which node's job (the elastic share counts its processes)
        self._jobs.put(job)

    def _thread_init(self) -> None:
        import torch

        pin_to(self.affinity)       # before torch starts this thread's OpenMP team: it inherits the cores
        with _TORCH_INIT:  # one thread at a time into the OpenMP/MKL thread settings
            torch.set_num_threads(self.torch_threads)

    def _loop(self) -> None:
        self._thread_init()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._timed(job)

    # -------------------------------------------------------------- readiness of items

    def mark_ready(self) -> Any:
        """What a consumer must wait on before reading an item this worker emits now (called on
        the worker's own thread, mid-job): None on the host, where an emitted item is complete."""
        return None

    def await_ready(self, marks: list) -> None:
        """Before a job: wait until the items it reads are complete (host side)."""
        for mark in marks:
            mark.wait_on_host()

    def _timed(self, job: Job) -> None:
        if job.wait_for:      # outside the job's span: waiting for the producer is not this stage's time
            self.await_ready(job.wait_for)
        # a one-shot stage (a whole-prompt prefill) does its work in `finish`: it gets the idle cores too
        if self.elastic is not None and job.phase in ("call", "finish"):
            threads = self.elastic()
            if threads != self._threads_now:
                import torch

                with _TORCH_INIT:
                    torch.set_num_threads(threads)
                self._threads_now = threads
        rec = job.record
        if rec is not None:
            rec.t0 = time.perf_counter()
        try:
            result, error = self.execute(job), None
        except BaseException as e:  # reported to the executor, which cancels the run
            result, error = None, e
        if rec is not None:
            rec.t1 = time.perf_counter()
        job.on_done(job, result, error)

    def execute(self, job: Job) -> Any:
        ctx = StageContext(job.node, job.item, _device(self.device), job.request, job.emit, job.end, job.cancelled,
                           sync=self._device_sync())
        try:
            return run_phase(self.stages.get(job.node), job, ctx)
        finally:
            if job.record is not None:
                job.record.parts = [(p.name, p.t0, p.t1) for p in ctx.parts]
                job.record.counts = dict(ctx.counts)

    def _device_sync(self) -> Callable[[], None] | None:
        """What a timed part waits for before reading the clock: nothing on a CPU worker."""
        return None

    def stop(self, timeout: float) -> bool:
        """Ask the worker to exit; True if it did within `timeout`."""
        return _stop_thread(self._jobs, self._thread, timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class ThreadWorker(Worker):
    pass


class StreamWorker(Worker):
    def __init__(self, name: str, torch_threads: int, device: str, priority: int = 0):
        super().__init__(name, torch_threads, device, None)
        self.priority = priority
        self._stream = None

    def _thread_init(self) -> None:
        import torch

        super()._thread_init()
        torch.cuda.set_device(self.device)
        # lower number = higher priority; torch clamps it to the range the device offers
        self._stream = torch.cuda.Stream(device=self.device, priority=self.priority)

    def execute(self, job: Job) -> Any:
        # Synchronising at the end of every job makes its span the kernels' real time and its
        # outputs complete before another stream reads them. Not covered: a stage that frees an
        # input tensor from another stream mid-job while its kernels are still queued (the
        # allocator could hand the block back to the producer's stream); stages keep inputs alive
        # for the whole call, which they do by holding their arguments.
        import torch

        with torch.cuda.stream(self._stream):
            result = super().execute(job)
        self._stream.synchronize()
        return result

    def _device_sync(self) -> Callable[[], None] | None:
        return self._stream.synchronize

    def mark_ready(self) -> StreamMark:
        return StreamMark(self._stream)

    def await_ready(self, marks: list) -> None:
        for mark in marks:   # queued on the device: this stream's next kernels run after the producer's
            mark.wait_on_stream(self._stream)


class SequentialThread:
    """The one thread on which a sequential executor runs every job, while the caller waits.

    Not the main thread, on purpose: torch work with several threads gives the calling thread an
    OpenMP team that lives as long as the thread, and with more OpenMP threads alive than cores
    libgomp stops spinning between parallel regions (see init_torch_runtime), so a sequential run
    on the main thread would slow every later threaded run of the same process (a sweep runs its
    jobs in one process). This thread's team goes when the executor closes."""

    def __init__(self, torch_threads: int):
        self.torch_threads = torch_threads
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="reelflow-sequential", daemon=True)

    def start(self) -> None:
        if self._thread.ident is None:
            self._thread.start()

    def _loop(self) -> None:
        import torch

        with _TORCH_INIT:
            torch.set_num_threads(self.torch_threads)
        while True:
            task = self._jobs.get()
            if task is None:
                return
            fn, done = task
            try:
                fn()
            finally:
                done.set()

    def run(self, fn: Callable[[], None]) -> None:
        """Run `fn` there and wait for it (in short waits, so Ctrl-C reaches the caller). Called
        from a job on this thread (a setup's completion starting the next setup), `fn` runs at once."""
        if threading.current_thread() is self._thread:
            fn()
            return
        done = threading.Event()
        self._jobs.put((fn, done))
        while not done.wait(0.1):
            if not self._thread.is_alive():
                raise RuntimeError("the sequential runner's thread died")

    def stop(self, timeout: float) -> bool:
        return _stop_thread(self._jobs, self._thread, timeout) if self._thread.is_alive() else True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


def _stop_thread(jobs: queue.SimpleQueue, thread: threading.Thread, timeout: float) -> bool:
    """Tell a job-queue thread to exit (a None job) and wait up to `timeout`; True if it did."""
    jobs.put(None)
    thread.join(timeout)
    return not thread.is_alive()


class InlineWorker(Worker):
    """The sequential runner's worker of one resource: `submit` returns when the job is done."""

    def __init__(self, name: str, torch_threads: int, device: str, thread: SequentialThread):
        super().__init__(name, torch_threads, device)
        self.thread = thread

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.thread.run(lambda: self._timed(job))

    def stop(self, timeout: float) -> bool:
        return self.thread.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.thread.alive


class ProcessWorker(Worker):
    """A parent-side thread driving one spawned child process."""

    def __init__(self, name: str, torch_threads: int, device: str = "cpu", affinity: tuple[int, ...] | None = None):
        super().__init__(name, torch_threads, device, affinity=affinity)
        ctx = SpawnWithoutMainContext()   # spawn, and an unguarded caller script is not re-run in the child
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.run = 0                      # the executor's run number: resident values live for one run
        self.process = ctx.Process(target=child_main, args=(child_conn, torch_threads, device, name, affinity),
                                   name=f"reelflow-{name}", daemon=True)
        self._child_conn = child_conn

    def start(self) -> None:
        self.process.start()
        self._child_conn.close()
        super().start()

    def _thread_init(self) -> None:
        pass  # torch threads are set inside the child

    def execute(self, job: Job) -> Any:
        send(self._conn, ("job", job.phase, job.node, job.item, job.kwargs, job.request, job.stage_cfg, self.run))
        while True:
            try:
                msg = recv(self._conn)
            except (EOFError, OSError):
                self.process.join(1.0)
                raise RemoteError("WorkerDied", f"worker process {self.name} (pid {self.process.pid}) died "
                                  f"with exit code {self.process.exitcode}", "") from None
            kind = msg[0]
            if kind in ("emit", "end"):
                try:
                    job.emit(msg[1], msg[2]) if kind == "emit" else job.end(msg[1])
                    send(self._conn, ("ok",))
                except Cancelled:
                    send(self._conn, ("cancel",))
            elif kind == "done":
                if job.record is not None:
                    job.record.parts, job.record.counts = msg[2], msg[3]
                return msg[1]
            elif kind == "error":
                if msg[1] == "Cancelled":
                    raise Cancelled(msg[2])
                raise RemoteError(msg[1], msg[2], msg[3])

    def stop(self, timeout: float) -> bool:
        if self.process.is_alive() and not self.busy:
            try:
                send(self._conn, ("exit",))
            except OSError:
                pass
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)
        # a thread blocked in recv() wakes with EOFError once the child is gone
        self._jobs.put(None)
        self._thread.join(timeout)
        self._conn.close()
        return not self.process.is_alive() and not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def pid(self) -> int | None:
        return self.process.pid
