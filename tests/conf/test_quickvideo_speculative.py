"""QuickVideo combined with speculation, as a user runs it: QuickCodec + QuickPrefill (group
prefill, each group's KV pruned) for the target, then Sparrow's head or ParallelVLM's draft.
QuickPrefill is lossy against the unpruned target, so lossless here means: the same tokens as the
pruned target's own greedy decoding (graph quickvideo), on held-out toy videos, for both families.
The prune is strong and decays with depth (keep ρ = 0.3, decay 0.8), so the target's layers hold caches of
different lengths: the tree's cache edits and the draft's positions must cope with both."""

from __future__ import annotations

import json

import pytest

from tests.test_run import run

PRUNE = ["graph.prune.keep=0.3", "graph.prune.decay=0.8", "graph.group_frames=8"]
DATA = ["data=toy_eval", "data.toy.videos=3", "data.toy.first_seed=230", "graph.max_new_tokens=48"]


def answers(tmp_path, experiment: str, model: str) -> tuple[list, list]:
    out = run(f"+experiment={experiment}", f"model={model}", *DATA, *PRUNE, f"hydra.run.dir={tmp_path / experiment}")
    assert out.returncode == 0, out.stderr
    runs = json.loads((tmp_path / experiment / "metrics.json").read_text())["runs"]
    return [r["output_ids"] for r in runs], [r["tokens_meta"] for r in runs]


@pytest.mark.parametrize("model", ["toy_qwen", "toy_llava"])
def test_quickvideo_with_sparrow_or_parallelvlm_gives_the_pruned_targets_own_answer(model, tmp_path):
    expected, meta = answers(tmp_path, "quickvideo", model)
    kept = meta[0]["prefill"]["video_tokens_kept"]
    assert len(set(kept)) > 1 and max(kept) < 0.35 * meta[0]["prefill"]["video_tokens"]   # pruned, unevenly
    for experiment in ("quickvideo_sparrow", "quickvideo_parallelvlm"):
        got, meta = answers(tmp_path, experiment, model)
        assert got == expected, experiment
        assert all(m["target_prefill"]["video_tokens_kept"] == kept for m in meta[:1])
        assert all(m["rounds"] > 0 and m["mean_accepted_length"] > 1 for m in meta), experiment
