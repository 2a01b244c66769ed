"""reelflow's C++ kernels for the CPU (models/csrc/*.cpp), built once per machine, checkout and Python
environment by torch's extension loader as torch operators; each user module gives its operator's
shape function, so torch.compile calls them from a compiled step as it calls MKL:

    torch.ops.reelflow_tiled.tiled_mm           models.tiled: products of a few rows
    torch.ops.reelflow_cpu.prefix_attention     models.cpu_attention: a few rows over a cached prefix

    if cpu_kernels.available(): ...          # builds them on first call (about 30 s), else says why not

They are built with -march=native for the CPU at hand; the build's name carries the CPU's flags,
the sources' hash and place, and the torch installation it links against, so a cache directory
shared by different machines, or by two clones or Python environments on one (torch's loader keeps
one build a name, and each one's paths in its build file would rebuild the other's), never hands
one another's build. Without a C++ compiler (which torch.compile needs on the CPU too) they are
unavailable and every caller keeps its torch path.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("reelflow.models")

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
# -fopenmp: at::parallel_for is a header template; compiled without OpenMP its `omp parallel` is
# dropped and every kernel runs on one thread whatever torch.get_num_threads() says
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _machine_tag() -> str:
    """What the build is for: this CPU's flags (-march=native), the compiler flags, the sources (their
    text and where they are), and the torch and Python it compiles against (versions and places)."""
    import sysconfig

    import torch

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    # the build file names the sources' and the include files' paths: another clone or environment is another build
    environment = f"{torch.__version__} {Path(torch.__file__).parent} {sysconfig.get_paths()['include']} {SOURCES}"
    text = flags + " ".join(CFLAGS + LDFLAGS) + environment + "".join(p.read_text() for p in SOURCES + HEADERS)
    return hashlib.sha1(text.encode()).hexdigest()[:10]


@functools.cache
def _build() -> str | None:
    """Build and load the kernels once per process (torch's extension cache keeps the build across
    processes). Returns None when they loaded, else why they could not."""
    from torch.utils import cpp_extension

    # the loader runs `ninja` from PATH: the one pip put beside this interpreter counts too, for a
    # virtualenv's python run without activating it
    scripts = str(Path(sys.executable).parent)
    if scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([scripts, os.environ.get("PATH", "")])
    started = time.perf_counter()
    try:
        cpp_extension.load(build_tag(), [str(p) for p in SOURCES], is_python_module=False,
                           extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
    except Exception as e:          # no compiler, no ninja, an unsupported CPU: the torch paths stay
        log.warning("reelflow's CPU kernels did not build (%s); the torch paths stay", e)
        return f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - started
    if seconds > 2:
        log.info("built reelflow's CPU kernels in %.1f s (once per machine, checkout and Python environment)", seconds)
    return None


def build_tag() -> str:
    """The kernels' build name: what a choice measured with them holds for (it changes with the
    CPU, the compiler flags and the sources)."""
    return f"reelflow_cpu_{_machine_tag()}"


def available() -> bool:
    """Whether the kernels are built and loaded here (building them on first call)."""
    return _build() is None


def unavailable_reason() -> str | None:
    """Why the kernels did not build, or None when they did."""
    return _build()
