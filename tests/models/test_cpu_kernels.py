"""models.cpu_kernels' build name: one build per CPU, sources and torch installation, so that two
clones or Python environments on one machine (torch's loader keeps one build a name, its build
file holding one place's paths) never rebuild each other's kernels on every run."""

from __future__ import annotations

import shutil

import torch

from models import cpu_kernels


def test_the_build_name_is_stable_and_changes_with_the_torch_and_the_clone_it_compiles(monkeypatch, tmp_path):
    tag = cpu_kernels.build_tag()
    assert tag == cpu_kernels.build_tag() and tag.startswith("reelflow_cpu_")
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu_kernels.build_tag() != tag                # another environment's torch
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert cpu_kernels.build_tag() != tag                # another torch in the same place
    monkeypatch.undo()
    clones = []
    for name in ("one", "two"):                          # the same sources, copied into two clones
        (tmp_path / name).mkdir()
        for source in cpu_kernels.SOURCES:
            shutil.copy(source, tmp_path / name / source.name)
        monkeypatch.setattr(cpu_kernels, "SOURCES", [tmp_path / name / p.name for p in cpu_kernels.SOURCES])
        clones.append(cpu_kernels.build_tag())
        monkeypatch.undo()
    assert len({tag, *clones}) == 3                      # a build of its own for each place
    assert cpu_kernels.build_tag() == tag
