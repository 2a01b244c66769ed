"""The first-divergence diagnostic: each way a description can leave the truth is told apart,
and a caption_eval job directory is read back into a table (truths from the toy cache)."""

import json

import pytest

from tools.diverge import first_divergence, job_divergences, main, table
from zoo import captions, world

A, B, C, D, E = [("move", "red", "star", d) for d in ("left", "right", "up", "down")] + [("grow", "red", "star")]
NOWHERE = ("disappear", "blue", "ring")


@pytest.mark.parametrize("generated, index, kind", [
    ([A, B, C, D, E], 5, "complete"),
    ([A, B], 2, "stopped early"),
    ([A, B, C, D, E, A], 5, "ran on"),
    ([A, B, A], 2, "earlier event"),
    ([A, B, D], 2, "next events"),
    ([A, NOWHERE], 1, "not in video"),
    ([], 0, "stopped early"),
])
def test_first_divergence_names_what_the_description_did(generated, index, kind):
    d = first_divergence(generated, [A, B, C, D, E])
    assert (d.index, d.kind) == (index, kind)


def test_a_true_event_more_than_three_ahead_is_a_later_event():
    reference = [A, B, C, D, NOWHERE, E]
    assert first_divergence([A, E], reference).kind == "later event"
    assert first_divergence([A, NOWHERE], reference).kind == "next events"
    d = first_divergence([A, E], reference)
    assert d.due == B and d.stated == E


def _job(tmp_path, name, seconds, texts):
    job = tmp_path / name
    job.mkdir()
    runs = []
    for seed, text in enumerate(texts):
        truth = world.make_world(seed, seconds).truth
        video = tmp_path / f"toy-s{seed}-{seconds}s.mp4"            # only its truth is read
        video.with_suffix(".json").write_text(json.dumps(truth.to_dict()))
        runs.append({"video": {"path": str(video)}, "output_text": text(truth)})
    (job / "metrics.json").write_text(json.dumps({"runs": runs}))
    return job


def test_a_sweep_directory_becomes_one_row_per_length(tmp_path, capsys):
    perfect = _job(tmp_path, "0", 30, [captions.caption, captions.caption])
    first_only = _job(tmp_path, "1", 60, [lambda t: captions.caption(world.Truth(t.seconds, t.events[:1]))])
    seconds, found, counts = job_divergences(perfect)
    assert seconds == 30 and [d.kind for d in found] == ["complete", "complete"]
    assert [d.index for d in found] == counts
    assert job_divergences(first_only)[1][0] == first_divergence(
        captions.parse(captions.caption(world.Truth(60, world.make_world(0, 60).truth.events[:1]))),
        [e.key() for e in world.make_world(0, 60).truth.events])
    assert main([str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| 30 | 2 |") and out[3].startswith("| 60 | 1 | 1.0 |")
    assert "stopped early" in table([job_divergences(first_only)]).splitlines()[0]


def test_a_directory_without_runs_or_truths_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.json"):
        job_divergences(tmp_path)
    job = _job(tmp_path, "0", 30, [captions.caption])
    next(tmp_path.glob("toy-s0-*.json")).unlink()
    with pytest.raises(FileNotFoundError, match="truth is gone"):
        job_divergences(job)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nothing")])
    with pytest.raises(SystemExit):             # a truth gone is a usage error, not a traceback
        main([str(tmp_path)])

