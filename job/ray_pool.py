"""cluster=ray: a run's requests over a pool of Ray actors, each building the graph and loading its
models once, then serving one request at a time.

Why an actor pool over Ray's core API rather than Ray Data's `map_batches`: the unit here is one
request whose failure must be told apart by cause (a worker that died is replaced and its request
retried, a bad input is recorded and never retried), whose result must reach the run dir the
moment it exists, and whose run can be resumed and cancelled cleanly. Ray Data retries and batches
at the level of blocks and streams results into a dataset; the pool here is a few dozen lines over
`ray.wait` with exactly those semantics, and Ray still places, restarts and reaches the workers.

    driver (python -m run)                         RequestWorker actors (one per cluster.workers)
      results.jsonl  <-- one line per request  <--   Executor(graph) built once, models loaded once
      metrics.json, summary.md at the end            run(request) -> the request's metrics
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from graph.spec import ConfigError
from job.results import ResultLog, outcome, request_ids

log = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """The pool cannot go on (no worker starts); the message says why."""


class RequestWorker:
    """One Ray actor: the graph compiled for its share of the machine, its stages set up (weights
    loaded) once, then requests one at a time. A request that fails (bad input) closes the
    executor; the next request gets a new one, and the models, cached in this process, stay."""

    def __init__(self, cfg: dict, warmup_request: Any = None, cores: list[int] | None = None):
        from job.prepare import graph_ports

        if cores:             # a local Ray: this worker's own cores (its decoders inherit them), before any thread starts
            os.sched_setaffinity(0, set(cores))
        self.cfg = OmegaConf.create(cfg)
        self.first_token, self.answer = graph_ports(self.cfg)
        self.executor, self.setup_error = None, None
        t0 = time.perf_counter()
        try:
            self._build()
        except Exception as e:            # noqa: BLE001 (the config's or the node's fault: told to the driver by ready())
            self.setup_error = f"{e}" if "StageFailed" in type(e).__name__ else f"{type(e).__name__}: {e}"
        for _ in range(int((self.cfg.get("executor") or {}).get("warmup", 0)) if self.executor else 0):
            if warmup_request is not None and self.run(warmup_request)["status"] != "ok":
                break                     # a bad first video: it fails again, in its own right, as a request
        self.setup_s = time.perf_counter() - t0

    def _build(self) -> None:
        from graph.executor import Executor
        from job.prepare import prepare

        self.spec, self.plan = prepare(self.cfg)
        ex = self.cfg.get("executor") or {}
        executor = Executor(self.spec, self.plan, cancel_timeout_s=float(ex.get("cancel_timeout_s", 10.0)),
                            progress=False, record=tuple(p for p in (self.answer,) if p))
        executor.setup()
        self.executor = executor

    def ready(self) -> dict:
        if self.setup_error:
            return {"error": self.setup_error, "pid": os.getpid()}
        return {"pid": os.getpid(), "node": os.uname().nodename, "setup_s": round(self.setup_s, 6),
                "cores": self.plan.cores}

    def run(self, request: Any, want_trace: bool = False) -> dict:
        from graph.executor import StageFailed
        from job.report import run_metrics

        if self.executor is None:
            self._build()
        try:
            result = self.executor.run(request)
        except StageFailed as e:          # the input's fault: recorded, not retried
            self.executor = None          # a failed run closes its executor (models stay loaded)
            return {"status": "failed", "error": str(e), "traceback": e.traceback_text}
        except Exception as e:            # noqa: BLE001 (any other error of this request: the same)
            self.executor = None
            return {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        out = {"status": "ok", "metrics": run_metrics(result, self.spec, self.plan, self.first_token, self.answer)}
        if want_trace:
            out["trace"] = (result.calls, result.t_start)
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
            self.executor = None


def _worker_cfg(cfg: DictConfig, cpus: float) -> dict:
    """The config a worker builds from: resolved here (the driver has Hydra's context), with the
    resources' `cores: auto` meaning the worker's CPUs rather than the whole machine's."""
    container = OmegaConf.to_container(cfg, resolve=True)
    resources = container.get("resources") or {}
    if resources.get("cores", "auto") in (None, "auto"):
        resources["cores"] = max(1, int(cpus))
    container["resources"] = resources
    container["cluster"] = {"kind": "local"}        # inside a worker the graph runs in-process
    return container


def _start_ray(cluster: dict) -> bool:
    """Connect to the cluster (address) or start a local one; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    address = cluster.get("address")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True,
                              "runtime_env": dict(cluster.get("runtime_env") or {}) or None}
    if address in (None, "", "local"):
        from graph.resources import available_cores

        kwargs |= {"num_cpus": available_cores(), "object_store_memory": int(cluster.get("object_store_mib", 128)) << 20}
        log.info("starting a local Ray with %d CPUs", kwargs["num_cpus"])
    else:
        kwargs["address"] = str(address)
    ray.init(**kwargs)
    return address in (None, "", "local")


class _Pool:
    """The actors, their slots, and replacing one that died."""

    def __init__(self, cfg: DictConfig, cluster: dict, warmup_request: Any):
        import ray

        self.cpus = float(cluster.get("cpus_per_worker", 1))
        self.gpus = float(cluster.get("gpus_per_worker", 0))
        self.remote = ray.remote(RequestWorker).options(num_cpus=self.cpus, num_gpus=self.gpus, max_restarts=0,
                                                       max_task_retries=0)
        self.args = (_worker_cfg(cfg, self.cpus), warmup_request)
        self.actors: list[Any] = [None] * int(cluster.get("workers", 1))
        self.info: list[dict | None] = [None] * len(self.actors)
        self.replaced = 0
        self.pin = bool(cluster.get("pin_cores")) and cluster.get("address") in (None, "", "local")

    def cores_of(self, slot: int) -> list[int] | None:
        """On a local Ray whose workers fit the machine's cores with whole CPUs each: worker `slot`'s
        cores, so that two workers never share one (and a replacement takes its predecessor's)."""
        from graph.resources import allowed_cores

        allowed = sorted(allowed_cores())
        per = int(self.cpus)
        if not self.pin or per != self.cpus or per < 1 or per * len(self.actors) > len(allowed):
            return None
        return allowed[slot * per:(slot + 1) * per]

    def start(self, slot: int) -> Any:
        self.actors[slot] = self.remote.remote(*self.args, self.cores_of(slot))
        return self.actors[slot].ready.remote()

    def kill(self, slot: int) -> None:
        import ray

        if self.actors[slot] is not None:
            ray.kill(self.actors[slot], no_restart=True)
            self.actors[slot] = None

    def bury(self, slot: int) -> None:
        """After a worker died: end its actor, and on this node remove the shared-memory files it
        could not (a decode in progress when it was killed)."""
        info = self.info[slot] or {}
        self.kill(slot)
        self.info[slot] = None
        if info.get("pid") and info.get("node") == os.uname().nodename:
            from video.codec import process_alive, remove_segments_of

            deadline = time.time() + 5
            while process_alive(info["pid"]) and time.time() < deadline:
                time.sleep(0.05)
            for path in remove_segments_of(info["pid"]):
                log.info("removed %s, left by worker %d", path, slot)

    def close_all(self, timeout_s: float = 10.0) -> None:
        """Ask every live worker to close its executor (its decoder processes and their semaphores
        go away properly), then end them all."""
        import ray

        # a worker still setting up (a replacement) is only killed: a close would wait for its setup
        refs = [a.close.remote() for a, info in zip(self.actors, self.info) if a is not None and info]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        self.kill_all()

    def kill_all(self) -> None:
        for slot in range(len(self.actors)):
            try:
                self.kill(slot)
            except Exception as e:      # noqa: BLE001 (a dead actor or a lost connection: nothing left to kill)
                log.debug("killing worker %d: %s", slot, e)


def _dead_worker(error: BaseException) -> bool:
    """A worker process that died (killed, out of memory, its node lost), not a request's error."""
    import ray.exceptions as rex

    return isinstance(error, (rex.RayActorError, rex.WorkerCrashedError, rex.OutOfMemoryError, rex.NodeDiedError))


def run_on_ray(cfg: DictConfig, requests: list[Any], run_dir: Path, spec, plan) -> dict[str, Any]:
    """Every request over the pool; results.jsonl as they finish; metrics.json, summary.md and the
    trace (of the first request to finish) at the end, as a local run writes them."""
    from job.report import write_metrics, write_trace_files

    try:
        import ray  # noqa: F401
    except ImportError:
        raise ConfigError("cluster=ray needs Ray. Fix: pip install -e '.[cluster]' (or cluster=local)") from None
    cluster = OmegaConf.to_container(cfg.cluster, resolve=True)
    run_dir = Path(run_dir)                 # made ready by run_job (job.results.prepare_run_dir)
    ids = request_ids(requests)
    with ResultLog(run_dir) as results:
        results.check_requests(ids)
        todo = [i for i in range(len(requests)) if i not in results.done()]
        if len(todo) < len(requests):
            log.info("resume: %d of %d requests have results; running %d", len(requests) - len(todo), len(requests),
                     len(todo))
        stats = _serve(cfg, cluster, requests, ids, todo, results) if todo else {}
        rows = dict(results.rows)
    per_run, failed = outcome(rows, len(requests))
    if stats.get("trace") and not (run_dir / "trace.json").exists():
        calls, t_start, metrics = stats.pop("trace")
        write_trace_files(cfg, run_dir, spec, plan, calls, t_start, metrics)
    stats.pop("trace", None)
    setup = [w["setup_s"] for w in stats.get("workers", []) if w]
    return write_metrics(cfg, run_dir, plan, per_run, setup_s=setup[0] if setup else 0.0,
                         warmup=int((cfg.get("executor") or {}).get("warmup", 0)),
                         cluster={"kind": "ray", **stats}, failed=failed)


def _serve(cfg: DictConfig, cluster: dict, requests: list, ids: list[str], todo: list[int], results: ResultLog) -> dict:
    import ray

    started = _start_ray(cluster)
    pool = None
    try:
        pool = _Pool(cfg, cluster, requests[todo[0]])
        return _dispatch(pool, cluster, requests, ids, todo, results, cfg)
    finally:
        if pool is not None:
            pool.close_all()
        if started:
            ray.shutdown()


def _dispatch(pool: _Pool, cluster: dict, requests: list, ids: list[str], todo: list[int], results: ResultLog,
              cfg: DictConfig) -> dict:
    import ray

    retries = int(cluster.get("retries", 2))
    max_replacements = len(pool.actors) * (retries + 1) + len(todo)
    queue = deque((i, 1) for i in todo)                 # (request index, attempt)
    starting = {pool.start(slot): slot for slot in range(len(pool.actors))}
    in_flight: dict[Any, tuple[int, int, int, float]] = {}     # ref -> (slot, index, attempt, t_submit)
    idle: list[int] = []
    trace = None
    progress = (cfg.get("executor") or {}).get("progress")
    bar = tqdm(total=len(todo), desc=f"requests on {len(pool.actors)} Ray workers", unit="req", smoothing=0.1,
               disable=None if progress is None else not progress)
    t_first = None
    n_failed = 0
    try:
        while queue or in_flight:
            # requests go out once every first worker is up (or has failed): a clean start for the timing
            while idle and queue and (t_first is not None or not starting):
                slot, (index, attempt) = idle.pop(), queue.popleft()
                want_trace = trace is None
                ref = pool.actors[slot].run.remote(requests[index], want_trace)
                in_flight[ref] = (slot, index, attempt, time.perf_counter())
                t_first = t_first or time.perf_counter()
            waiting = list(in_flight) + list(starting)
            if not waiting:
                break
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in done:
                if ref in starting:                      # a worker finished its setup
                    slot = starting.pop(ref)
                    try:
                        info = ray.get(ref)
                    except Exception as e:               # noqa: BLE001 (it died while setting up: killed, out of memory)
                        if not _dead_worker(e):
                            raise
                        pool.bury(slot)
                        pool.replaced += 1
                        if pool.replaced > max_replacements:
                            raise ClusterError(f"workers keep dying at setup; the last: {e}") from None
                        log.warning("worker %d died at setup (%s); starting another", slot, str(e).splitlines()[0])
                        starting[pool.start(slot)] = slot
                        continue
                    if "error" in info:                  # its setup raised: the config's or the model's fault, every worker's alike
                        raise ClusterError(f"a Ray worker could not set up the graph: {info['error']}")
                    pool.info[slot] = info
                    idle.append(slot)
                    continue
                slot, index, attempt, t_submit = in_flight.pop(ref)
                latency = time.perf_counter() - t_submit
                try:
                    out = ray.get(ref)
                except Exception as e:                   # noqa: BLE001 (sorted below: a dead worker, or the request's own error)
                    if not _dead_worker(e):
                        out = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
                        idle.append(slot)                # alive: it takes the next request
                    else:
                        pool.bury(slot)
                        pool.replaced += 1
                        if pool.replaced > max_replacements:
                            raise ClusterError(f"workers keep dying; the last: {e}") from None
                        reason = str(e).splitlines()[0][:300]
                        if attempt <= retries or queue:  # a replacement only where there is work for it
                            starting[pool.start(slot)] = slot
                        if attempt <= retries:
                            log.warning("worker %d died running %s (%s); retrying it on a new worker", slot,
                                        ids[index], reason)
                            queue.appendleft((index, attempt + 1))
                            continue
                        out = {"status": "failed", "error": f"its worker died {attempt} times; the last: {reason}"}
                        log.error("%s failed: %s", ids[index], out["error"])
                    row = {"index": index, "request": ids[index], "status": "failed", "attempts": attempt,
                           "worker": slot, "error": out["error"]}
                    results.append(row)
                    n_failed += 1
                    bar.update(1)
                    bar.set_postfix(failed=n_failed)
                    continue
                idle.append(slot)
                if out["status"] == "ok" and "trace" in out:
                    calls, t_start = out.pop("trace")
                    trace = trace or (calls, t_start, out["metrics"])
                row = {"index": index, "request": ids[index], "status": out["status"], "attempts": attempt,
                       "worker": slot, "latency_s": round(latency, 6)}
                if out["status"] == "ok":
                    row["metrics"] = out["metrics"]
                else:
                    row["error"] = out["error"]
                    n_failed += 1
                    bar.set_postfix(failed=n_failed)
                    log.error("%s failed: %s", ids[index], out["error"].splitlines()[0])
                results.append(row, out.get("traceback"))
                bar.update(1)
        t_end = time.perf_counter()
    finally:
        bar.close()
    latencies = [results.rows[i].get("latency_s") for i in todo if results.rows.get(i, {}).get("latency_s")]
    elapsed = t_end - t_first if t_first else 0.0
    return {"workers": pool.info, "address": cluster.get("address"), "cpus_per_worker": pool.cpus,
            "gpus_per_worker": pool.gpus, "requests": len(todo), "failed": n_failed, "replaced_workers": pool.replaced,
            "elapsed_s": round(elapsed, 6), "throughput_rps": round(len(todo) / elapsed, 6) if elapsed > 0 else None,
            "latency_s_mean": round(sum(latencies) / len(latencies), 6) if latencies else None, "trace": trace}
