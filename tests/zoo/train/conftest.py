"""A folder of the user's own videos, shared by the tests of the recipes that train on one."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """Four toy videos as plain files (their truth unused), 12 s at 8 fps."""
    from zoo.videos import ensure_video

    d = tmp_path_factory.mktemp("my-videos")
    for seed in range(4000, 4004):
        path, _ = ensure_video(seed, 12, 8, workers=1)
        shutil.copy(path, d / f"clip{seed}.mp4")
    return d


@pytest.fixture
def ctrl_c(monkeypatch):
    """ctrl_c(Recipe, n): Recipe.loss raises KeyboardInterrupt (what Ctrl-C raises) at its n-th call;
    ctrl_c.undo() puts the real loss back."""

    class Interrupt:
        def __call__(self, recipe_class, n: int) -> None:
            calls = {"n": 0}
            loss = recipe_class.loss

            def stopping(self, batch):
                calls["n"] += 1
                if calls["n"] == n:
                    raise KeyboardInterrupt
                return loss(self, batch)

            monkeypatch.setattr(recipe_class, "loss", stopping)

        def undo(self) -> None:
            monkeypatch.undo()

    return Interrupt()


def cache_stamps(result: dict) -> dict[str, int]:
    """The modification times of a training run's built examples (to see none is made again)."""
    from pathlib import Path

    return {p.name: p.stat().st_mtime_ns for p in Path(result["trained_on"]["example_cache"]).glob("clip-*.pt")}
