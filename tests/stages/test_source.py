"""Where a run's requests come from (stages/source.py): the toy world's held-out videos."""

import av

from stages.source import toy_requests


def test_toy_videos_of_any_aspect_can_be_made_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    (request,) = toy_requests(videos=1, seconds=6, first_seed=7, fps=4, size=[48, 80], chunk_s=2, workers=1)
    assert request.video.endswith("toy-s7-6s-4fps-80x48px-chunks2s.mp4")
    with av.open(request.video) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 24 and {(f.height, f.width) for f in frames} == {(48, 80)}
    assert request.reference["events"]                       # the truth travels with the request
    plain, = toy_requests(videos=1, seconds=6, first_seed=7, fps=4, size=[48, 80])
    assert plain.video.endswith("toy-s7-6s-4fps-80x48px.mp4") and plain.reference == request.reference
