"""The run dir's results.jsonl: one JSON line per finished request, written as each finishes, so a
run of several requests (here or on Ray workers) that dies or is interrupted keeps what it did and
`cluster.resume=true` goes on from there.

    {"index": 3, "request": "s203-30s", "status": "ok", "attempts": 1, "worker": 0, "latency_s": ..., "metrics": {...}}
    {"index": 4, "request": "s204-30s", "status": "failed", "attempts": 1, "error": "..."}

One process (the driver) writes it. Each line goes out in a single append and is fsynced before the
next request is counted as done, so after a crash the file holds whole lines and at most one torn
last line, which `ResultLog` drops (and cuts off) when it opens the file again. The latest line of
an index wins: a request that failed and was run again on resume has its new row.

Beside it, results.config.json holds a fingerprint of the configuration that wrote the rows (the
resolved config, less where and how it runs: `cluster`, `executor.progress`) and the command's
overrides: a resume with another configuration is refused, whatever Hydra has since written into
the run dir's .hydra/.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

NAME = "results.jsonl"
CONFIG = "results.config.json"                # what configuration the rows are of
ERRORS = "error.txt"                          # the failed requests' tracebacks, one after another
CARRIED = ("trace.json", "timeline.png", CONFIG)   # carried over when a resume adopts another dir's results


class RequestsFailed(RuntimeError):
    """Requests without a result where the caller cannot go on: none of a run's requests has one,
    or one of a batch that needs every answer lacks one. The message names them."""


def request_ids(requests: list[Any]) -> list[str]:
    """The requests' ids as results.jsonl records them: their own, or their places where two share one."""
    ids = [str(getattr(r, "id", i)) for i, r in enumerate(requests)]
    if len(set(ids)) != len(ids):
        ids = [f"{i}:{x}" for i, x in enumerate(ids)]
    return ids


def config_fingerprint(cfg) -> str:
    """What makes a run's results what they are: the resolved config without `cluster` (where the
    requests run, whether they resume) and `executor.progress`, hashed."""
    import hashlib

    from omegaconf import OmegaConf

    container = OmegaConf.to_container(cfg, resolve=True) if not isinstance(cfg, dict) else dict(cfg)
    container.pop("cluster", None)
    container.pop("hydra", None)
    if isinstance(container.get("executor"), dict):
        container["executor"] = {k: v for k, v in container["executor"].items() if k != "progress"}
    return hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _overrides() -> list[str] | None:
    """This Hydra job's command-line overrides (None outside Hydra: a script)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return None


def prepare_run_dir(cfg, run_dir: Path) -> None:
    """Before anything is written: with `cluster.resume`, continue this run dir's results, or adopt
    the latest same-command run's; without, a run dir that already holds results is refused
    (nothing is overwritten). Results of another configuration are refused either way."""
    from graph.spec import ConfigError

    cluster = cfg.get("cluster") or {}
    run_dir = Path(run_dir)
    fingerprint, overrides = config_fingerprint(cfg), _overrides()
    here = (run_dir / NAME).exists()
    if here and not cluster.get("resume"):
        raise ConfigError(f"{run_dir / NAME} exists: this run dir has results. Fix: cluster.resume=true to "
                          "go on from them, or another run dir")
    if cluster.get("resume") and not here and overrides is not None:
        previous = find_resumable(run_dir, overrides, fingerprint)
        if previous is None:
            log.warning("cluster.resume=true: no earlier run of this command with results; starting afresh")
        else:
            adopt(previous, run_dir)
            log.info("resuming from %s", previous)
    recorded = _recorded(run_dir)
    if recorded is not None and recorded.get("fingerprint") != fingerprint:
        then = " ".join(recorded.get("overrides") or []) or "(no overrides recorded)"
        now = " ".join(same_command(overrides or [])) or "(none)"
        raise ConfigError(f"{run_dir / NAME} holds results of another configuration (its overrides: {then}; "
                          f"this run's: {now}). Fix: the same command, or another run dir")
    if recorded is None:
        (run_dir / CONFIG).write_text(json.dumps(
            {"fingerprint": fingerprint, "overrides": same_command(overrides) if overrides is not None else None}))


def _recorded(run_dir: Path) -> dict | None:
    path = Path(run_dir) / CONFIG
    return json.loads(path.read_text()) if path.exists() else None


def outcome(rows: dict[int, dict], n: int) -> tuple[list[dict], list[dict]]:
    """The answered requests' metrics and the failed ones' {request, error, attempts}, in request
    order, from the latest row of each of `n` requests; RequestsFailed when none was answered."""
    ordered = [rows[i] for i in range(n) if rows.get(i)]
    answered = [r["metrics"] for r in ordered if r["status"] == "ok"]
    failed = [{"request": r["request"], "error": r["error"], "attempts": r.get("attempts", 1)}
              for r in ordered if r["status"] != "ok"]
    if not answered:
        raise RequestsFailed(f"every request failed; the first: {failed[0]['request']}: {failed[0]['error']}"
                             if failed else "no request ran")
    return answered, failed


class ResultLog:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / NAME
        self.rows: dict[int, dict] = {}
        if self.path.exists():
            self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load(self) -> None:
        data = self.path.read_bytes()
        good = 0                                  # bytes up to the end of the last whole, valid line
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            self.rows[int(row["index"])] = row
            good += len(line)
        if good < len(data):
            log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted write", self.path,
                        len(data) - good)
            with open(self.path, "r+b") as f:
                f.truncate(good)

    def append(self, row: dict[str, Any], traceback_text: str | None = None) -> None:
        """One request's row; a failed one's traceback (where there is one) goes to error.txt beside."""
        if traceback_text:
            with open(self.path.with_name(ERRORS), "a") as f:
                f.write(f"== {row['request']}: {row.get('error')}\n\n{traceback_text}\n")
        line = (json.dumps(row, default=str) + "\n").encode()
        os.write(self._fd, line)                  # O_APPEND: one write, at the end
        os.fsync(self._fd)
        self.rows[int(row["index"])] = row

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def counts(self) -> tuple[int, int]:
        """(requests answered, requests whose latest row is a failure)."""
        answered = len(self.done())
        return answered, len(self.rows) - answered

    def done(self) -> set[int]:
        """Indices with a result (failed ones are run again on resume)."""
        return {i for i, row in self.rows.items() if row.get("status") == "ok"}

    def check_requests(self, ids: list[str]) -> None:
        """The recorded rows must be of these requests at these places: resuming with other data
        would mix two runs."""
        for index, row in self.rows.items():
            if index >= len(ids) or row.get("request") != ids[index]:
                have = ids[index] if index < len(ids) else "nothing"
                from graph.spec import ConfigError

                raise ConfigError(f"{self.path}: row {index} is request {row.get('request')!r}, this run's is {have!r}: "
                                  "the data differ from the run being resumed. Fix: the same data, or a new run dir")


def task_overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides a Hydra run dir was made with (.hydra/overrides.yaml)."""
    import yaml

    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    return list(yaml.safe_load(path.read_text()) or [])


def same_command(overrides: list[str]) -> list[str]:
    """The overrides that make a run what it is: not whether it resumes, not where it writes."""
    return sorted(o for o in overrides if not o.lstrip("+~").startswith(("cluster.resume=", "hydra.run.dir=")))


def find_resumable(run_dir: Path, overrides: list[str], fingerprint: str | None = None) -> Path | None:
    """The latest other run dir beside this one (Hydra's outputs/DATE/TIME_name layout) made by the
    same command, with results to resume from: by the configuration its results record (a later
    command may have rewritten its .hydra/), else by its .hydra/overrides.yaml."""
    run_dir = Path(run_dir).resolve()
    roots = {run_dir.parent, run_dir.parent.parent}
    want = same_command(overrides)
    found = []
    for root in roots:
        for path in list(root.glob(f"*/{NAME}")) + list(root.glob(f"*/*/{NAME}")):
            candidate = path.parent.resolve()
            if candidate == run_dir:
                continue
            recorded = _recorded(candidate)
            if recorded is not None and fingerprint is not None:
                same = recorded.get("fingerprint") == fingerprint
            else:
                theirs = task_overrides(candidate)
                same = theirs is not None and same_command(theirs) == want
            if same:
                found.append((path.stat().st_mtime, candidate))
    return max(found)[1] if found else None


def adopt(previous: Path, run_dir: Path) -> None:
    """Start this run dir from a previous run's results (and its trace), leaving that dir as it was."""
    shutil.copyfile(Path(previous) / NAME, Path(run_dir) / NAME)
    for name in CARRIED:
        if (Path(previous) / name).exists() and not (Path(run_dir) / name).exists():
            shutil.copyfile(Path(previous) / name, Path(run_dir) / name)
