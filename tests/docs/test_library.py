"""docs/library.md's scripts run as a user runs them (each a file of its own, from the repository
root, in a fresh interpreter) and give the answer `python -m run` gives on the bundled video."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "library.md"


def scripts() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), flags=re.S | re.M)


def run_script(code: str, path: Path) -> str:
    path.write_text(code)
    done = subprocess.run([sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_both_scripts_run_and_answer_as_the_command_line_does(tmp_path):
    model_alone, whole_graph = scripts()
    run_dir = tmp_path / "run"
    assert '"outputs/from-a-script"' in whole_graph
    whole_graph = whole_graph.replace('"outputs/from-a-script"', repr(str(run_dir)))      # not into the checkout
    answer = run_script(model_alone, tmp_path / "describe_video.py").strip().splitlines()[-1]
    printed = run_script(whole_graph, tmp_path / "run_experiment.py").strip().splitlines()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["experiment"] == "sparrow" and printed[0] == metrics["output_text"]
    assert (run_dir / "trace.json").exists() and (run_dir / "plan.txt").exists()
    # the toy target's greedy description of the bundled video: Sparrow is lossless, so both agree
    assert answer == metrics["output_text"] and answer.startswith("the background is")
