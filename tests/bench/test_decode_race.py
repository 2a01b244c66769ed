"""bench_decode_grid's race: every decoder timed on the same video, each run a timer part of the
node; decoders that return other frames stop the race; the grid's config composes and its report
has the columns and the crossover plot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.decode_race import DecoderRace
from graph.context import StageContext
from stages.decode import PyAVDecoder, QuickCodec
from stages.types import Request

ROOT = Path(__file__).resolve().parents[2]


def context():
    return StageContext("race", 0, torch.device("cpu"), None, lambda port, item: None, lambda port: None,
                        lambda: False)


def test_each_decoder_runs_repeats_times_and_the_first_ones_plan_is_the_output(videos):
    path = str(videos["h264_closed_gop"]["path"])
    race = DecoderRace({"quickcodec": QuickCodec(fps=4, size=32, workers=1), "pyav": PyAVDecoder(fps=4, size=32)},
                       repeats=2, pause_s=0.0)
    ctx = context()
    race.setup(ctx)
    try:
        info = race(ctx, Request(video=path))["video"]
    finally:
        race.close()
    names = [part.name for part in ctx.parts]
    assert sorted(names) == ["pyav", "pyav", "quickcodec", "quickcodec"]
    assert all(part.t1 > part.t0 for part in ctx.parts)
    assert info.decoder == "quickcodec" and info.plan["strategy"] in ("intervals", "seeking", "mixed")


def test_decoders_that_disagree_on_the_frames_stop_the_race(videos):
    path = str(videos["h264_closed_gop"]["path"])
    race = DecoderRace({"a": PyAVDecoder(fps=4, size=32), "b": PyAVDecoder(fps=2, size=32)}, repeats=1, pause_s=0.0)
    with pytest.raises(RuntimeError, match="other times"):
        race(context(), Request(video=path))
    with pytest.raises(ValueError, match="at least one"):
        DecoderRace({})


def test_the_grid_composes_with_every_decoder_and_the_crossover_columns():
    out = subprocess.run([sys.executable, "-m", "run", "+experiment=bench_decode_grid", "--cfg", "job"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    for name in ("quickcodec", "intervals", "seeking", "torchcodec", "pyav", "decord"):
        assert f"          {name}:\n" in out
    assert "seek_frames: 1000000" in out and "seek_frames: 0" in out and "vs_better_mode" in out
