"""Where a run's requests come from (stages/source.py): rows from a maker the config names, here
the toy world's held-out videos (zoo.videos.held_out_requests), as data=toy_eval names it."""

import av
import pytest

from graph.spec import ConfigError
from stages.source import load_requests
from stages.types import Request

TOY = "zoo.videos.held_out_requests"


def test_toy_videos_of_any_aspect_can_be_made_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setenv("REELFLOW_CACHE", str(tmp_path))
    toy = {"_target_": TOY, "videos": 1, "seconds": 6, "first_seed": 7, "fps": 4, "size": [48, 80]}
    (request,) = load_requests({"toy": toy | {"chunk_s": 2, "workers": 1}})
    assert isinstance(request, Request) and request.id == "s7-6s" and request.prompt == "describe the video ."
    assert request.video.endswith("toy-s7-6s-4fps-80x48px-chunks2s.mp4")
    with av.open(request.video) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 24 and {(f.height, f.width) for f in frames} == {(48, 80)}
    assert request.reference["events"]                       # the truth travels with the request
    plain, = load_requests({"toy": toy, "prompt": "what happened ?"})
    assert plain.video.endswith("toy-s7-6s-4fps-80x48px.mp4") and plain.reference == request.reference
    assert plain.prompt == "what happened ?"


@pytest.mark.parametrize("toy, expect", [({"videos": 1}, "name its request maker"),
                                         ({"_target_": "zoo.videos.no_such_maker"}, "zoo.videos.no_such_maker")])
def test_a_toy_block_without_a_maker_is_a_config_error(toy, expect):
    with pytest.raises(ConfigError, match=expect):
        load_requests({"toy": toy})
