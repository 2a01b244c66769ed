"""The engine knows nothing of models: no module of graph/ imports the product's other packages.
Stages reach the engine only by name, through the stage registry (`_target_`)."""

from __future__ import annotations

import ast
from pathlib import Path

GRAPH = Path(__file__).resolve().parents[2] / "graph"
OUTSIDE_THE_ENGINE = {"models", "stages", "video", "zoo", "tools", "job", "run"}


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_graph_imports_nothing_of_the_product_outside_it():
    offenders = {f"{path.name}: {module}" for path in GRAPH.glob("*.py") for module in imported_modules(path)
                 if module.split(".")[0] in OUTSIDE_THE_ENGINE}
    assert not offenders, f"graph/ must not import these (go through the stage registry): {sorted(offenders)}"


def test_the_check_sees_function_level_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from stages.types import KV\n    import models.load\n")
    assert {"stages.types", "models.load"} <= imported_modules(probe)
