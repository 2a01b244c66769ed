"""A torchvision that cannot load is hidden from transformers, so that reelflow still loads models.

On a machine with the CPU build of torch, the torchvision wheels on PyPI are CUDA builds: their
compiled operators need libtorch_cuda and fail to load, and importing torchvision then raises
("operator torchvision::nms does not exist"). transformers imports torchvision whenever the
package is installed (its image utilities prefer it), so one such wheel, pulled in by another
package's requirements (lmms-eval's, say), would stop every model from loading. reelflow does not
use torchvision; when it is installed but does not import, it is marked absent for this process
(`sys.modules["torchvision"] = None`: transformers then uses its PIL image processors, as on a
machine without it). The test extra's lmms-eval brings such a wheel to every CPU install, and
nothing of reelflow is the worse for it, so the note of how to install a working one is logged at
debug level, not as a warning on every run.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

log = logging.getLogger("reelflow.models")


def hide_unloadable_torchvision() -> bool:
    """Mark torchvision absent when it is installed but does not import. Returns whether it did."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception as e:          # a CUDA build beside a CPU torch raises RuntimeError, not ImportError
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        sys.modules["torchvision"] = None
        _forget_transformers_answer()
        log.debug("torchvision is installed but does not load (%s); it is hidden from transformers for this "
                    "process. For a working one beside the CPU torch: pip install torchvision --index-url "
                    "https://download.pytorch.org/whl/cpu", str(e).splitlines()[0] if str(e) else type(e).__name__)
        return True
    return False


def _forget_transformers_answer() -> None:
    """transformers caches whether torchvision is available (functools caches on its checks): a
    script that imported transformers before reelflow may already hold the answer "yes", and would
    then import torchvision anyway when a model loads. Its cached checks are cleared here."""
    checks = sys.modules.get("transformers.utils.import_utils")
    for name in dir(checks) if checks is not None else ():
        check = getattr(checks, name)
        if "torchvision" in name and callable(getattr(check, "cache_clear", None)):
            check.cache_clear()
