"""Child processes started from any caller: an unguarded script (no `if __name__ == "__main__":`)
that runs a graph with a process worker is not re-run inside the worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# At the script's top level, like a notebook cell: a child re-running it would start another
# executor inside the worker process, where starting processes is refused.
UNGUARDED_GRAPH = """\
from graph.executor import Executor
from stages.types import Request
from tests.helpers import make, node

spec, plan = make({"probe": node("tests.helpers.ThreadProbe", "decode")})
with Executor(spec, plan, progress=False) as ex:
    result = ex.run(Request())
print("worker pid differs:", result.outputs["probe.info"]["pid"] != __import__("os").getpid())
"""


def test_a_process_worker_started_from_an_unguarded_script(tmp_path):
    script = tmp_path / "my_graph.py"
    script.write_text(UNGUARDED_GRAPH)
    env = {**os.environ, "PYTHONPATH": str(REPO)}      # this checkout's packages, whatever is installed
    run = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "worker pid differs: True" in run.stdout


def test_main_is_restored_after_a_launch():
    from graph.spawn import _main_module_unnamed

    main = vars(sys.modules["__main__"])
    before = {k: main.get(k, "<absent>") for k in ("__file__", "__spec__")}
    with _main_module_unnamed():
        assert "__file__" not in main and main["__spec__"] is None
    assert {k: main.get(k, "<absent>") for k in ("__file__", "__spec__")} == before
