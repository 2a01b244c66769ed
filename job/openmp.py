"""Which OpenMP runtime torch's CPU kernels use, and starting `python -m run` under Intel's.

Why it matters: the engine runs each model in a worker thread of its own, and torch's Linux wheels
use GNU's runtime (libgomp), which on two cores made every model step in a worker thread about
1.5x slower than the same step on the main thread (docs/results/2026-11-27-draft-chain.md). Intel's
runtime (the PyPI package `intel-openmp`, libiomp5.so) implements libgomp's entry points too, so
with it preloaded torch's parallel regions run on it instead. A preload must be in place when the
process starts, so the command line re-executes itself once with LD_PRELOAD set
(`executor.openmp`: auto uses Intel's runtime where it is installed, `intel` requires it, `gnu`
keeps torch's own). A library user starts Python the same way: `LD_PRELOAD=$(python -m job.openmp)`.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

CHOICES = ("auto", "intel", "gnu")
_KEY = "executor.openmp="
_REEXECUTED = "REELFLOW_OPENMP_REEXECUTED"    # set in the re-executed process: never loop
_PRELOAD_BEFORE = "REELFLOW_OPENMP_PRELOAD_BEFORE"   # LD_PRELOAD as it was, given back to child processes


class OpenMPChoiceError(ValueError):
    """A bad `executor.openmp` value, or `intel` where Intel's runtime is not installed."""


def intel_library() -> Path | None:
    """libiomp5.so from the `intel-openmp` package of this Python environment, if it is installed."""
    try:
        files = metadata.files("intel-openmp") or []
    except metadata.PackageNotFoundError:
        return None
    found = (Path(f.locate()) for f in files if f.name == "libiomp5.so")
    return next((p.resolve() for p in found if p.exists()), None)


def runtime_in_use() -> str:
    """'intel' when libiomp5 is mapped into this process, else 'gnu' on Linux (torch's own
    runtime), 'unknown' where /proc is not there to tell."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return "intel" if "libiomp5" in maps else "gnu"


def preload_advice(choice: str = "auto") -> str | None:
    """What to tell a process that runs torch's GNU runtime though Intel's is installed and the
    config leaves the choice to reelflow (`executor.openmp=auto`): a script started without the
    preload that `python -m run` sets itself. None otherwise."""
    if choice != "auto" or runtime_in_use() != "gnu" or intel_library() is None:
        return None
    return ("this process runs torch's own OpenMP runtime (GNU's), though Intel's is installed: `python -m run` "
            "restarts itself under Intel's, which ran the engine's model steps faster on our CPUs; a script gets it "
            "by starting as LD_PRELOAD=$(python -m job.openmp) python SCRIPT.py (executor.openmp=gnu keeps GNU's "
            "and says nothing)")


def requested(argv: list[str]) -> str:
    """The `executor.openmp=` override of a command line (the last one wins), else 'auto'."""
    values = [arg[len(_KEY):] for arg in argv if arg.startswith(_KEY)]
    choice = values[-1] if values else "auto"
    if choice not in CHOICES:
        raise OpenMPChoiceError(f"executor.openmp={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


def preload_environment(choice: str, env: dict[str, str], library: Path | None) -> dict[str, str] | None:
    """The environment to re-execute the process with so that `library` is preloaded, or None when
    nothing needs doing: `gnu`, not Linux, already preloaded, already re-executed once, or (for
    `auto`) Intel's runtime not installed. Pure: the caller passes what it found."""
    if choice == "gnu" or not sys.platform.startswith("linux"):
        return None
    if library is None:
        if choice == "intel":
            raise OpenMPChoiceError("executor.openmp=intel needs Intel's OpenMP runtime in this environment: "
                                    "pip install intel-openmp (or executor.openmp=gnu for torch's own)")
        return None
    preloaded = env.get("LD_PRELOAD", "")
    if env.get(_REEXECUTED) or "libiomp5" in preloaded:
        return None
    out = dict(env)
    out["LD_PRELOAD"] = f"{library}:{preloaded}" if preloaded else str(library)
    out[_REEXECUTED], out[_PRELOAD_BEFORE] = "1", preloaded
    return out


def environment_for_children(env: dict[str, str]) -> dict[str, str]:
    """The environment the re-executed process gives its children: LD_PRELOAD as it was before.
    Why: Intel's runtime registers every process that loads it with a file in /dev/shm, removed at
    exit, and the engine's pools end their worker processes (decoders, Ray actors) by killing them,
    which left one file behind each; those workers run no parallel torch work that needs it. A
    preload the user set by hand is left as it is. Pure: returns a new mapping."""
    if not env.get(_REEXECUTED):
        return dict(env)
    out = {k: v for k, v in env.items() if k not in (_REEXECUTED, _PRELOAD_BEFORE, "LD_PRELOAD")}
    if env.get(_PRELOAD_BEFORE):
        out["LD_PRELOAD"] = env[_PRELOAD_BEFORE]
    return out


def reexecute_if_needed(argv: list[str]) -> None:
    """Start this command again under Intel's runtime when `executor.openmp` asks for it (nothing
    returns from a re-execution). Called before torch is imported."""
    choice = requested(argv)
    if runtime_in_use() == "intel":        # preloaded already: by the re-execution below, or by hand
        children = environment_for_children(dict(os.environ))
        os.environ.clear()
        os.environ.update(children)
        return
    env = preload_environment(choice, dict(os.environ), intel_library())
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, sys.orig_argv, env)


if __name__ == "__main__":     # python -m job.openmp: the path to preload, for starting a script yourself
    library = intel_library()
    if library is None:
        sys.exit("Intel's OpenMP runtime is not installed here: pip install intel-openmp")
    print(library)
