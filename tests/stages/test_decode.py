"""The decode stages: QuickCodec inside a graph, and every reference decoder giving QuickCodec's
selection from the same video and stream."""



import pytest
import torch

from stages.decode import PyAVDecoder
from tests.video.videos import pyav_frames, read_counter, reference
from video.codec import VideoError

SELECTIONS = {
    "every_frame": dict(size=None),
    "fps5_resized": dict(fps=5, size=(64, 80)),
    "num_frames7": dict(num_frames=7, size=48),
    "seconds": dict(seconds=[0.0, 0.51, 1.0, 2.9], size=None),
}

def test_decode_graph_streams_groups_through_the_executor(videos):
    from graph.executor import Executor
    from stages.types import Request
    from tests.helpers import make, node

    nodes = {
        "video": node("stages.source.Source"),
        "decode": node("stages.decode.QuickCodec", "cpu", {"request": "video.request"},
                       fps=8, size=32, workers=2, group_frames=4),
        "sink": node("tests.helpers.SlowSink", "target", {"item": "decode.group"}, delay=0.0),
    }
    spec, plan = make(nodes)
    path = str(videos["h264_bframes_open_gop"]["path"])
    with Executor(spec, plan, progress=False) as ex:
        result = ex.run(Request(video=path))
    assert result.outputs["sink.count"] == 6  # 24 frames at 8 fps in groups of 4
    info = result.outputs["decode.video"]
    assert info.selected == 24 and info.n_frames == 72 and info.metrics()["video"]["frames"] == 24


def run_stage(stage: str, path, **params):
    """One request through a decode stage, outside a graph: (groups, VideoInfo)."""
    from graph.context import StageContext
    from stages import decode
    from stages.types import Request

    groups = []
    ctx = StageContext("decode", 0, torch.device("cpu"), None, lambda port, g: groups.append(g), lambda p: None,
                       lambda: False)
    dec = getattr(decode, stage)(**params)
    dec.setup(ctx)
    try:
        info = dec(ctx, Request(video=str(path)))["video"]
    finally:
        dec.close()
    return groups, info


@pytest.mark.parametrize("stage, params", [("PyAVDecoder", {}), ("TorchCodecDecoder", {}),
                                           ("TorchCodecDecoder", {"seek_mode": "exact"}), ("DecordDecoder", {})])
def test_reference_decoders_give_the_same_selection(stage, params, videos):
    """Same frames and timestamps as PyAV's; torchcodec/decord convert and resize their own way,
    so their pixels are compared loosely. A decoder that is not installed fails here, loudly.
    torchcodec with approximate seek (its advised setting) and exact seek (its default) alike."""
    path = str(videos["h264_closed_gop"]["path"])
    groups, info = run_stage(stage, path, fps=4, size=None, group_frames=5, workers=1, **params)
    got = torch.cat([g.frames for g in groups])
    want, want_s = reference(path, fps=4, size=None)
    assert torch.equal(torch.cat([g.seconds for g in groups]), want_s) and info.selected == len(want)
    assert [g.index for g in groups] == list(range(len(groups)))
    diff = (got.float() - want.float()).abs().mean()
    assert diff < (0.01 if stage == "PyAVDecoder" else 6.0), f"{stage}: mean abs pixel difference {diff:.2f}"
    frame_ids = [read_counter(f.permute(1, 2, 0).numpy()) for f in got]
    assert frame_ids == list(range(0, 72, 6))


@pytest.mark.parametrize("stream", [None, 0, 2])
@pytest.mark.parametrize("stage", ["QuickCodec", "PyAVDecoder", "TorchCodecDecoder", "DecordDecoder"])
def test_every_decode_stage_takes_the_stream_asked_for(stage, stream, two_streams):
    path = two_streams["path"]
    chosen = two_streams["main"] if stream is None else stream
    if stage == "DecordDecoder" and chosen != two_streams["main"]:
        with pytest.raises(VideoError, match=r"decord decodes only the default video stream \(2\), not stream 0"):
            run_stage(stage, path, fps=4, size=None, workers=1, stream=stream)
        return
    groups, _ = run_stage(stage, path, fps=4, size=None, workers=1, stream=stream)
    got = torch.cat([g.frames for g in groups])
    want = pyav_frames(path, chosen)[::6]  # 24 fps at 4 fps
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs().mean()
    assert diff < (0.01 if stage in ("QuickCodec", "PyAVDecoder") else 6.0), f"{stage}: mean abs difference {diff:.2f}"


@pytest.mark.parametrize("stream", [-1, "main", 1.0, True])
def test_a_decode_stage_wants_a_stream_index(stream):
    with pytest.raises(ValueError, match="give a stream index"):
        PyAVDecoder(stream=stream)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the NVDEC test decodes on it instead")
def test_nvdec_without_a_gpu_says_so_and_names_the_cpu_decoders():
    from stages.decode import TorchCodecDecoder

    with pytest.raises(RuntimeError, match=r"needs an NVIDIA GPU.*stage/decode@graph.nodes.decode.stage=quickcodec"):
        TorchCodecDecoder(device="cuda").setup(None)
    with pytest.raises(ValueError, match="give cpu, or cuda"):
        TorchCodecDecoder(device="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NVDEC needs an NVIDIA GPU")
@pytest.mark.parametrize("size", [None, (64, 80)])
def test_nvdec_gives_the_cpu_selection_on_the_gpu(size, videos):
    """torchcodec's CUDA device: the frames PyAV gives, on the GPU. NVDEC converts YUV to RGB with
    its own arithmetic (and the resize is torch's antialiased bilinear, not swscale's bicubic), so
    pixels are compared with the loose bound the CPU torchcodec test uses: a wrong colour matrix,
    swapped planes or a wrong frame is off by tens of levels, rounding by one or two."""
    path = str(videos["h264_closed_gop"]["path"])
    groups, info = run_stage("TorchCodecDecoder", path, fps=4, size=size, workers=1, device="cuda")
    got = torch.cat([g.frames for g in groups])
    want, want_s = reference(path, fps=4, size=size)
    assert got.is_cuda and got.dtype == torch.uint8 and got.shape == want.shape
    assert torch.equal(torch.cat([g.seconds for g in groups]), want_s) and "nvdec" in info.decoder
    diff = (got.cpu().float() - want.float()).abs().mean()
    assert diff < 6.0, f"NVDEC: mean abs pixel difference {diff:.2f}"
    if size is None:
        assert [read_counter(f.permute(1, 2, 0).cpu().numpy()) for f in got] == list(range(0, 72, 6))
