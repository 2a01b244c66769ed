"""Starting child processes from any caller: multiprocessing's spawn, without re-running the
caller's __main__ in the child, so no `if __name__ == "__main__":` guard is needed in a user's
script, notebook or stdin session; and `die_with_parent`, which such a child calls so that it
does not outlive a parent that was killed.

    pool = concurrent.futures.ProcessPoolExecutor(4, mp_context=SpawnWithoutMainContext())
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
import threading
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Iterator

__all__ = ["SpawnWithoutMainContext", "die_with_parent"]

#
# A spawned process first re-runs its parent's __main__ (by path, or by module name under -m; see
# multiprocessing.spawn's get_preparation_data and prepare), so that functions defined there can
# be unpickled. reelflow's processes (decoders, process workers, encoders) only ever run functions
# of reelflow's own modules, and re-running a caller's unguarded script in them would run that
# script again inside every one of them (where starting processes is refused, so each one dies:
# `read_video` at a script's top level did exactly that). So each process is launched while
# __main__ looks like an interactive session's (no __file__, no __spec__): the one case in which
# multiprocessing leaves __main__ alone. forkserver would not help: its children are sent the
# same preparation data and re-run __main__ too. The names are gone from __main__ only while a
# process is being launched (a few milliseconds); the lock keeps two pools launching at once
# from restoring each other's.
# The child imports this module to unpickle its process object, so it stays free of torch.

_launching = threading.Lock()
_MAIN_NAMES = ("__file__", "__spec__")


@contextlib.contextmanager
def _main_module_unnamed() -> Iterator[None]:
    main = sys.modules.get("__main__")
    main_vars = vars(main) if main is not None else {}
    with _launching:
        saved = {name: main_vars.pop(name) for name in _MAIN_NAMES if name in main_vars}
        main_vars["__spec__"] = None
        try:
            yield
        finally:
            for name in _MAIN_NAMES:
                main_vars.pop(name, None)
            main_vars.update(saved)


class SpawnWithoutMainProcess(SpawnProcess):
    def start(self) -> None:
        with _main_module_unnamed():
            super().start()


class SpawnWithoutMainContext(SpawnContext):
    """spawn (never fork: the caller may hold threads), without re-running the caller's __main__."""

    Process = SpawnWithoutMainProcess


def die_with_parent() -> None:
    """Called first thing in a spawned child: if the parent dies without cleaning up (killed), the
    child goes too instead of living on as an orphan. Linux only (prctl); elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
