"""The layers of docs/design.md ("Layers and who may import whom") hold: its table is read here, so
the page and the check cannot drift, and every import of the product, at any depth (imports inside
functions included), is checked against it: no package imports what its row does not allow, nothing
imports tools/, an import across packages names public things only, and there is no import cycle
between packages or between files. The probes plant each kind of crossing in a temporary tree, so
the check is seen to fail."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "design.md"
NOT_PRODUCT = {"tests", "docs", "conf", "outputs", "multirun", "build", "dist"}
TOOLS = "tools"


# ------------------------------------------------------------------------------------- the table

def layer_table(text: str) -> dict[str, set[str] | None]:
    """package -> the packages it may import (None: everything), from the section's table."""
    section = text.split("## Layers and who may import whom", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]   # past header and rule
    assert rows, "docs/design.md: the layers section has no table"
    table: dict[str, set[str] | None] = {}
    for row in rows:
        package, allowed = (cell.strip().strip("`").removesuffix("/") for cell in row.strip("|").split("|")[:2])
        allowed = re.sub(r"\([^)]*\)", "", allowed).split(";")[0].strip()   # "graph (public names only)"
        module = package.removesuffix(".py")
        table[module] = None if allowed == "everything" else (
            set() if allowed == "nothing" else {a.strip().removesuffix(".py") for a in allowed.split(",")})
    return table


# ----------------------------------------------------------------------------------- the imports

def product_files(root: Path) -> dict[str, Path]:
    """Every module of the product under `root`: dotted name -> file (top-level .py files and the
    packages beside them, tests and non-code folders left out)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in NOT_PRODUCT or any(p.startswith(".") or p == "__pycache__" or p.endswith(".egg-info")
                                              for p in rel.parts):
            continue
        parts = rel.with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[int, str, str]]:
    """(line, module, name) for every import of a product module in `path`, at any depth; `name` is
    the imported name of a `from` import ("" for `import x`); a `from pkg import sub` of a
    submodule counts as importing that submodule."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: a relative import; the product imports absolutely"
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub, "") if sub in modules else (node.lineno, node.module, alias.name))
    return [(n, m, name) for n, m, name in out if top(m) in {top(k) for k in modules}]


def top(module: str) -> str:
    return module.split(".")[0]


def crossings(root: Path, table: dict[str, set[str] | None]) -> list[str]:
    """Every import under `root` that the layer rules forbid, as 'file:line: what'."""
    modules = product_files(root)
    bad = [f"{top(m)}: a package with no row in the table" for m in sorted({top(k) for k in modules} - set(table))]
    for module, path in modules.items():
        here = top(module)
        for line, target, name in imports_of(path, modules):
            there, where = top(target), f"{path.relative_to(root)}:{line}"
            if there == here:
                continue
            if there == TOOLS:
                bad.append(f"{where}: imports {target}, and nothing imports tools")
            elif table.get(here) is not None and there not in table[here]:
                bad.append(f"{where}: {here} imports {target}, which its row of the table does not allow")
            if name.startswith("_") or any(p.startswith("_") and p != "__init__" for p in target.split(".")):
                bad.append(f"{where}: {here} imports the private {target}{'.' + name if name else ''}")
    return sorted(set(bad), key=bad.index)     # one line for `from m import A, B`


def module_graph(root: Path) -> nx.DiGraph:
    """file -> the product files it imports (dotted names), at any depth."""
    modules = product_files(root)
    graph = nx.DiGraph()
    graph.add_nodes_from(modules)
    for module, path in modules.items():
        for _, target, _ in imports_of(path, modules):
            while target not in modules and "." in target:   # `from pkg.mod import Name`: the file pkg/mod.py
                target = target.rsplit(".", 1)[0]
            if target in modules and target != module:
                graph.add_edge(module, target)
    return graph


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    return sorted(sorted(c) for c in nx.simple_cycles(graph))


def package_graph(files: nx.DiGraph) -> nx.DiGraph:
    packages = nx.DiGraph()
    packages.add_edges_from((top(a), top(b)) for a, b in files.edges if top(a) != top(b))
    return packages


# ----------------------------------------------------------------------------------- the product

TABLE = layer_table(DESIGN.read_text())


def test_the_table_has_the_layers_the_design_names():
    assert TABLE["graph"] == set() and TABLE["models"] == set() and TABLE["video"] == {"graph"}
    assert TABLE["run"] is None and TABLE["tools"] is None
    assert "tools" not in set().union(*(allowed for allowed in TABLE.values() if allowed is not None))
    assert nx.is_directed_acyclic_graph(nx.DiGraph([(p, q) for p, allowed in TABLE.items() for q in allowed or ()]))


def test_every_import_of_the_product_keeps_to_the_table():
    bad = crossings(ROOT, TABLE)
    assert not bad, "imports that cross the layers of docs/design.md:\n  " + "\n  ".join(bad)


def test_no_import_cycle_between_packages_or_between_files():
    files = module_graph(ROOT)
    assert files.number_of_edges() > 100      # the walk sees the product's imports
    assert not cycles(package_graph(files)), f"package cycles: {cycles(package_graph(files))}"
    assert not cycles(files), f"file cycles: {cycles(files)}"


# ------------------------------------------------------------------------------------ the probes

def plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


LAYERED = {"graph/__init__.py": "", "graph/spawn.py": "def spawn(): ...\ndef _private(): ...\n",
           "models/__init__.py": "", "models/load.py": "import torch\n",
           "stages/__init__.py": "", "stages/types.py": "from graph.spawn import spawn\nimport models.load\n",
           "tools/__init__.py": "", "tools/keys.py": "from stages.types import KV\n", "run.py": "import stages.types\n"}


def test_a_clean_tree_passes(tmp_path):
    assert crossings(plant(tmp_path, LAYERED), TABLE) == []


@pytest.mark.parametrize("rel, text, expect", [
    ("models/bench.py", "def f():\n    from stages.types import KV\n", "models/bench.py:2: models imports stages.types"),
    ("graph/x.py", "import models.load\n", "graph/x.py:1: graph imports models.load"),
    ("stages/x.py", "def f():\n    import tools.keys\n", "stages/x.py:2: imports tools.keys, and nothing imports tools"),
    ("video/x.py", "from graph.spawn import _private\n", "video/x.py:1: video imports the private graph.spawn._private"),
    ("fresh/x.py", "", "fresh: a package with no row in the table"),
    ("run.py", "def main():\n    import tools.keys\n", "run.py:2: imports tools.keys, and nothing imports tools"),
])
def test_a_planted_crossing_is_caught(tmp_path, rel, text, expect):
    root = plant(tmp_path, LAYERED | {rel: text})
    assert any(b.startswith(expect) for b in crossings(root, TABLE)), crossings(root, TABLE)


def test_a_planted_cycle_is_caught_even_inside_functions(tmp_path):
    root = plant(tmp_path, {"job/__init__.py": "", "job/run.py": "from job.pool import serve\n",
                            "job/pool.py": "def serve():\n    from job.run import prepare\n",
                            "zoo/__init__.py": "", "zoo/a.py": "import stages.b\n",
                            "stages/__init__.py": "", "stages/b.py": "def f():\n    from zoo import a\n"})
    files = module_graph(root)
    assert cycles(files) == [["job.pool", "job.run"], ["stages.b", "zoo.a"]]
    assert cycles(package_graph(files)) == [["stages", "zoo"]]
