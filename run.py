"""reelflow's command line: `python -m run +experiment=NAME [key=value ...]`.

Hydra composes conf/config.yaml with the chosen experiment and overrides; the job validates the
graph (before anything loads), compiles it onto the resources, runs it, and writes plan.txt,
trace.json, timeline.png and metrics.json into the run dir. `-m` sweeps; the report callback
then writes report.md / report.csv / report.png into the sweep dir.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import logging
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("reelflow")
# `kill -USR1 PID` prints every thread's Python stack to stderr: where a slow or stuck run is.
# faulthandler writes it from the signal handler itself, so it works even if a thread holds the GIL.
faulthandler.register(signal.SIGUSR1, all_threads=True)
# run dirs are named after the experiment, or the graph when no experiment is chosen
OmegaConf.register_new_resolver("first", lambda *xs: next((x for x in xs if x not in (None, "None")), None), replace=True)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from graph.executor import StageFailed
    from graph.spec import ConfigError
    from job.ray_pool import ClusterError
    from job.results import NAME as RESULTS
    from job.results import RequestsFailed
    from job.run import run_job
    from stages.source import load_requests

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    _check_openmp(cfg)
    if cfg.get("train"):      # +experiment=train_toy | train_sparrow | train_draft: training, not a graph
        import json

        from zoo.train.recipes import recipe_of, trainer

        try:      # the keys are checked before anything is built
            name, keys = recipe_of(OmegaConf.to_container(cfg.train, resolve=True))
            data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") else None
            extra = {"data": data} if name in ("sparrow", "draft") else {}     # they train on the user's videos
            result = trainer(name)(progress=cfg.executor.get("progress"), **keys, **extra)
        except ConfigError as e:
            print(f"reelflow: {e}", file=sys.stderr)
            sys.exit(2)
        (run_dir / "metrics.json").write_text(json.dumps({"experiment": cfg.get("experiment"), **result}, indent=2))
        return result["train_s"]
    if cfg.get("eval"):       # +experiment=lmms_eval: lmms-eval's evaluator with reelflow as its model
        return _evaluate(cfg, run_dir)
    try:
        requests = load_requests(cfg.get("data"))
        metrics = run_job(cfg, requests, run_dir)
    except ConfigError as e:
        print(f"reelflow: {e}", file=sys.stderr)
        sys.exit(2)
    except StageFailed as e:
        log.debug("%s", e.traceback_text)
        _record_error(run_dir, e)
        print(f"reelflow: run failed: {e}\n  (traceback in {run_dir / 'error.txt'})", file=sys.stderr)
        sys.exit(1)
    except RequestsFailed as e:
        where = f"\n  (tracebacks in {run_dir / 'error.txt'})" if (run_dir / "error.txt").exists() else ""
        print(f"reelflow: run failed: {e}{where}", file=sys.stderr)
        sys.exit(1)
    except ClusterError as e:
        print(f"reelflow: run failed: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        kept = _results_kept(run_dir)
        print("reelflow: interrupted; run cancelled and cleaned up" + (
            f"; {kept} kept in {run_dir / RESULTS}: the same command with cluster.resume=true goes on from there"
            if kept else ""), file=sys.stderr)
        sys.exit(130)
    runs, failed = metrics.get("runs") or [], metrics.get("failed") or []
    if len(runs) + len(failed) > 1:   # several requests: their means are logged above; one answer is no result
        done = f"{len(runs)} of {len(runs) + len(failed)} requests answered" if failed else f"{len(runs)} requests"
        streamed = "results.jsonl (as each finished) and " if (run_dir / RESULTS).exists() else ""
        log.info("%s, %.3f s each on average; answers in %smetrics.json (runs), scores, timings and failures in "
                 "summary.md; outputs in %s", done, metrics["wall_s_mean"], streamed, run_dir)
        return metrics["wall_s"]
    if metrics.get("output_text") is not None:
        print(metrics["output_text"])
    log.info("wall %.3f s (ideal overlapped %.3f s); outputs in %s",
             metrics["wall_s"], metrics["ideal_wall_s"], run_dir)
    return metrics["wall_s"]


def _results_kept(run_dir: Path) -> str:
    """What an interrupted run leaves in results.jsonl, in words ('' for nothing)."""
    from job.results import NAME, ResultLog

    if not (run_dir / NAME).exists():
        return ""
    with ResultLog(run_dir) as results:
        answered, failed = results.counts()
    if not answered + failed:
        return ""
    failures = f" and {failed} failure{'s' * (failed != 1)}" if failed else ""
    return f"{answered} answer{'s' * (answered != 1)}{failures}"


def _record_error(run_dir: Path, error) -> None:
    """A failure's traceback, appended to error.txt (a run of several may hold other requests' already)."""
    with open(run_dir / "error.txt", "a") as f:
        f.write(f"== {error}\n\n{error.traceback_text}\n")


def _check_openmp(cfg: DictConfig) -> None:
    """`executor.openmp` takes effect from the command line only (the preload happens before the
    config is composed); say so when a config file asked for a runtime this process does not run."""
    from job.openmp import runtime_in_use

    wanted = (cfg.get("executor") or {}).get("openmp", "auto")
    running = runtime_in_use()
    if wanted in ("intel", "gnu") and running not in (wanted, "unknown"):
        log.warning("executor.openmp=%s, but this process runs %s's OpenMP runtime: the setting is read from "
                    "the command line when the process starts, not from a config file", wanted, running)


def _evaluate(cfg: DictConfig, run_dir: Path) -> float:
    from graph.executor import StageFailed
    from job.results import RequestsFailed

    try:
        from evaluation.job import run_lmms_eval
    except ImportError as e:
        print(f"reelflow: +experiment=lmms_eval needs lmms-eval ({e}): pip install -e '.[eval]'", file=sys.stderr)
        sys.exit(2)
    from evaluation.config import ModelArgsError

    try:
        metrics = run_lmms_eval(cfg, run_dir)
    except ModelArgsError as e:
        print(f"reelflow: {e}", file=sys.stderr)
        sys.exit(2)
    except StageFailed as e:
        _record_error(run_dir, e)
        print(f"reelflow: run failed: {e}\n  (traceback in {run_dir / 'error.txt'})", file=sys.stderr)
        sys.exit(1)
    except RequestsFailed as e:           # cluster=ray: a request without an answer (each job's run dir says why)
        print(f"reelflow: run failed: {e}", file=sys.stderr)
        sys.exit(1)
    log.info("%d answers in %.1f s; outputs in %s", metrics["n_answers"], metrics["wall_s"], run_dir)
    return metrics["wall_s"]


def check_train_keys(argv: list[str]) -> None:
    """Hydra refuses an override of a key its config lacks before `main` runs (status 1, a message
    about structs); a misspelt `train.KEY=...` gets the trainer's own message instead, with the
    closest valid keys, and status 2 like every other config error."""
    keys = [arg.split("=", 1)[0].removeprefix("train.") for arg in argv if arg.startswith("train.") and "=" in arg]
    if not keys:
        return
    from graph.spec import ConfigError
    from zoo.train.config import check_keys
    from zoo.train.recipes import config_classes

    recipe = next((name for name in ("sparrow", "draft") if f"+experiment=train_{name}" in argv), "toy")
    keys = [k for k in keys if k != "recipe"]
    try:
        check_keys(keys, *config_classes(recipe))
    except ConfigError as e:
        print(f"reelflow: {e}", file=sys.stderr)
        sys.exit(2)


def check_config_choices(argv: list[str]) -> None:
    """`GROUP=NAME` (and `+GROUP=`, `GROUP@PACKAGE=`, a sweep's `GROUP=A,B`) naming no file of
    conf/GROUP/: one line naming the closest choices and every one, status 2 like every other
    config error, before Hydra (which would say it at length, with status 1). Values in Hydra's
    sweep functions (`choice(...)`, `glob(...)`) and Hydra's own groups are left to Hydra."""
    import difflib
    import re

    if any("searchpath" in arg for arg in argv):       # configs from elsewhere: only Hydra knows them all
        return
    root = Path(__file__).resolve().parent / "conf"
    problems = []
    for arg in argv:
        m = re.fullmatch(r"\+{0,2}([A-Za-z_][\w/]*)(?:@[\w.]+)?=([\w.,-]+)", arg)
        if not m or m[1].startswith("hydra") or not (root / m[1]).is_dir():
            continue
        group, values = m[1], m[2].split(",")
        known = sorted(p.stem for p in (root / group).glob("*.yaml"))
        for value in values:
            if value not in known and value != "null":
                close = difflib.get_close_matches(value, known, n=3)
                hint = f"did you mean {' or '.join(close)}? " if close else ""
                problems.append(f"{group}={value}: no such choice in conf/{group}/; {hint}"
                                f"the choices: {', '.join(known)}")
    if problems:
        print("reelflow: " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)


def check_override_keys(argv: list[str]) -> None:
    """`KEY=VALUE` whose KEY the composed config lacks (a misspelt `graph.prune.kep=0.2`): one line
    naming the closest keys, status 2 like every other config error, before Hydra (which says it in
    five lines, status 1, and suggests `+KEY`, which would add the misspelt key). The config is
    composed from the other arguments, a sweep's first value each; anything this check cannot
    compose (a sweep function, a config from elsewhere) is left to Hydra."""
    import difflib

    from hydra import compose, initialize_config_dir
    from omegaconf import ListConfig

    root = Path(__file__).resolve().parent / "conf"
    plain, others = [], []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if "(" in value or "searchpath" in key:
            return
        first = value.split(",")[0] if "," in value and not value.startswith(("[", "{", "'", '"')) else value
        chooses = key[0] in "+~" or "/" in key or "@" in key or (root / key).is_dir()     # a group, or adds a key
        if chooses or key.split(".")[0] in ("hydra", "train"):      # train.*: check_train_keys' (Hydra's own)
            others.append(f"{key}={first}")
        else:
            plain.append(key)
    if not plain:
        return
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            cfg = compose("config", overrides=others)
    except Exception:          # what Hydra itself refuses, it says in its own words
        return
    problems = []
    for key in plain:
        node, where = cfg, []
        for part in key.split("."):
            index = int(part) if isinstance(node, ListConfig) and part.isdigit() else part
            present = (index in node.keys() if isinstance(node, DictConfig) else
                       isinstance(index, int) and index < len(node) if isinstance(node, ListConfig) else None)
            if present is None:                     # a plain value: it has no keys to set
                problems.append(f"{key}: {'.'.join(where)} holds a value, not keys")
            elif not present:
                keys = [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
                close = difflib.get_close_matches(part, keys, n=2)
                hint = (f"did you mean {' or '.join('.'.join([*where, c]) for c in close)}?" if close
                        else f"a key of your own: +{key}=...")
                problems.append(f"{key}: no key '{part}' in {'.'.join(where) or 'the config'}; {hint}")
            elif OmegaConf.is_interpolation(node, index) or OmegaConf.is_missing(node, index) or node[index] is None:
                break                               # what it stands for is known only when resolved: Hydra's
            else:
                node = node[index]
                where.append(part)
                continue
            break
    if problems:
        print("reelflow: " + "\n  ".join(problems), file=sys.stderr)
        sys.exit(2)


def expand_home(argv: list[str]) -> list[str]:
    """`key=~/videos` (and each `~/...` of a sweep's `key=~/a,~/b`) with the home directory put in.
    A shell leaves a `~` after `key=` as it is, since `data.folder=` is no shell assignment, and
    Hydra's override grammar has no `~` in a value: it would refuse the command with a lexer error."""
    import os
    import re

    home = os.path.expanduser("~")
    return [re.sub(r"(?<=[=,])~(?=/|,|$)", lambda _: home, arg) if "=" in arg and not arg.startswith("~") else arg
            for arg in argv]


def start_openmp_runtime(argv: list[str]) -> None:
    """Re-execute under Intel's OpenMP runtime when `executor.openmp` asks for it (job/openmp.py);
    before Hydra and torch load, since a preload only works from a process's start."""
    from job.openmp import OpenMPChoiceError, reexecute_if_needed

    try:
        reexecute_if_needed(argv)
    except OpenMPChoiceError as e:
        print(f"reelflow: {e}", file=sys.stderr)
        sys.exit(2)


class ExitWithoutTeardown:
    """The command line's last exit handler: once the other exit handlers have run (pools' and
    temporary files' clean-up, registered as their modules load, after this one: atexit runs them
    in reverse order), the process exits with its status through the C library's exit() instead of
    tearing the interpreter down first, a garbage collection of everything torch, transformers and
    inductor loaded (about 1.3 s of a 9-s `python -m run` on 2 cores, with the run already over).
    exit(), not os._exit(): the C libraries' own exit handlers still run (Intel's OpenMP removes its
    /dev/shm registration in one). Registered by `python -m run` only, after its own imports: of
    those, logging alone has an exit handler, which this one calls itself."""

    def __init__(self):
        self.status = 0

    def __call__(self) -> None:
        logging.shutdown()                     # flushes and closes run.log's handler; it may run twice
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):      # a closed pipe: Python's own teardown would drop it too
                pass
        try:
            libc_exit = ctypes.PyDLL(None).exit    # PyDLL: the GIL stays held, no Python thread runs on
        except (OSError, TypeError, AttributeError):     # no C library to call (Windows): Python's own way
            return
        libc_exit(self.status)

    def record(self, error: BaseException) -> None:
        """The status Python gives a process that leaves by `error`: SystemExit's code, 1 for an
        uncaught exception. An uncaught Ctrl-C keeps Python's own way out (it ends by SIGINT)."""
        if isinstance(error, KeyboardInterrupt):
            atexit.unregister(self)
        elif isinstance(error, SystemExit):
            code = error.code
            self.status = 0 if code is None else code if isinstance(code, int) else 1
        else:
            self.status = 1


if __name__ == "__main__":
    leave = ExitWithoutTeardown()
    atexit.register(leave)
    try:
        sys.argv[1:] = expand_home(sys.argv[1:])
        start_openmp_runtime(sys.argv[1:])
        check_config_choices(sys.argv[1:])
        check_train_keys(sys.argv[1:])
        check_override_keys(sys.argv[1:])
        main()
    except BaseException as error:
        leave.record(error)
        raise
