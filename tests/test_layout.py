"""The house rules a reader relies on: the README stays a page for users, the product's text points
nowhere outside the repository and carries no work-tracking history, and every relative link in
the README and docs/ leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
# The product's text: what a user reads or runs. Tests are not in it (they may name anything).
PRODUCT = ["README.md", "docs", "conf", "graph", "job", "stages", "models", "video", "zoo", "bench", "tools", "evaluation", "run.py",
           "pyproject.toml", ".ci"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".jinja", ""}
# history belongs to git and dated pages, not to the product: "session 12", "issue 4";
# and the repository must stand alone: no path that climbs out of it, no design notes it does not hold
FORBIDDEN = re.compile(r"(?i:\bsession \d+|\bissue \d+\b)|\.\./shared|shared/seeds|\bDESIGN(\.md)?\b")


SKIP_DIRS = {".venv", "__pycache__", "outputs", "multirun", ".pytest_cache", "build", ".git"}


def _text_files(paths: list[str]) -> list[Path]:
    """The text files under `paths`, skipping virtualenvs, caches and run outputs."""
    files = []
    for name in paths:
        top = ROOT / name
        candidates = [top] if top.is_file() else (top.rglob("*") if top.is_dir() else [])
        for p in candidates:
            rel = p.relative_to(ROOT).parts
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not SKIP_DIRS.intersection(rel) \
                    and not any(part.endswith(".egg-info") for part in rel):
                files.append(p)
    return files


def test_readme_is_a_page_for_users():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move history and long results to docs/"


def test_product_text_names_no_sessions_issues_or_outside_paths():
    hits = []
    for path in _text_files(PRODUCT):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not hits, "the product's text names a session, an issue or a path outside the repo:\n" + "\n".join(hits)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_relative_links_in_readme_and_docs_resolve():
    broken = []
    for page in _text_files(["README.md", "docs"]):
        if page.suffix != ".md":
            continue
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+://|mailto:|#", target):
                continue
            if not (page.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
