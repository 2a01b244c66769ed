"""models.cpu_kernels' build name: one build per CPU, sources and torch installation, so that two
clones or Python environments on one machine (torch's loader keeps one build a name, its build file holding
one environment's include paths) never rebuild each other's kernels on every run."""

from __future__ import annotations

from pathlib import Path

import torch

from models import cpu_kernels


def test_the_build_name_is_stable_and_changes_with_the_torch_it_compiles_against(monkeypatch):
    tag = cpu_kernels.build_tag()
    assert tag == cpu_kernels.build_tag() and tag.startswith("reelflow_cpu_")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_kernels.build_tag() != tag                # another environment's torch
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_kernels.build_tag() != tag                # another torch in the same place
    monkeypatch.undo()
    monkeypatch.setattr(cpu_kernels, "SOURCES", [Path("/another/clone") / p.name for p in cpu_kernels.SOURCES])
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "the same sources")
    moved = cpu_kernels.build_tag()
    monkeypatch.setattr(cpu_kernels, "SOURCES", [Path("/a/third/clone") / p.name for p in cpu_kernels.SOURCES])
    assert cpu_kernels.build_tag() != moved              # the same text in another clone
    monkeypatch.undo()
    assert cpu_kernels.build_tag() == tag
