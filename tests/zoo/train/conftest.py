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
