"""The real-size benchmark's bookkeeping, on CPU with a few-layer variant (the figures need a GPU)."""

import json

import torch

from bench.bench_realsize import kept_rows, run_benchmark
from tests.models.test_shapes import TINY

SMALLER = ("random:qwen2.5-vl-7b,num_hidden_layers=1,hidden_size=128,intermediate_size=256,num_attention_heads=2,"
           "num_key_value_heads=1,vision.depth=1,vision.hidden_size=64,vision.intermediate_size=128,vision.num_heads=2")


def test_kept_rows_keep_all_text_and_the_unpruned_share_of_the_video_in_order():
    from models.adapter import Layout

    layout = Layout(torch.zeros(30, dtype=torch.long), video_start=4, n_video=20, positions=torch.zeros(1, 30, dtype=torch.long),
                    rope_delta=0)
    rows = kept_rows(layout, 0.75)
    video = rows[(rows >= 4) & (rows < 24)]
    assert len(video) == 5 and video[0] == 4 and video[-1] == 23        # ceil(0.25 * 20), spread to both ends
    assert set(range(4)) | set(range(24, 30)) <= set(rows.tolist())
    assert torch.equal(rows, rows.sort().values)


def test_a_run_times_every_context_and_builds_the_speculative_table(tmp_path):
    results = run_benchmark([TINY], [256, 512], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2, 4),
                            pair=(SMALLER, TINY), alphas=(0.0, 0.5, 0.9), gamma=4, out=tmp_path)
    target = results["models"][TINY]["contexts"]
    assert set(target) == {"256", "512"}
    for row in target.values():
        assert row["prefill_s"] > 0 and row["step_ms"] > 0 and set(row["verify_ms"]) == {2, 4}
    draft = results["models"][SMALLER]["contexts"]
    assert set(draft) == {"256", "256 α=0.5", "256 α=0.9", "512", "512 α=0.5", "512 α=0.9"}
    assert draft["512"]["cached"] > draft["512 α=0.5"]["cached"] > draft["512 α=0.9"]["cached"]
    table = results["speculative"]
    assert [(r["n_video"], r["alpha"]) for r in table] == [(256, 0.0), (256, 0.5), (256, 0.9), (512, 0.0), (512, 0.5), (512, 0.9)]
    for r in table:
        assert r["tp_ms"] == target[str(r["n_video"])]["verify_ms"][4]
        assert abs(r["c"] - r["tp_ms"] / r["tq_ms"]) < 1e-9
    assert json.loads((tmp_path / "results.json").read_text())["speculative"]
    assert "c* = Tp/Tq" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "realsize.png").stat().st_size > 0


def test_the_peer_is_timed_beside_each_context(tmp_path):
    results = run_benchmark([SMALLER], [256], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2,), peer="off",
                            out=tmp_path)
    (row,) = results["models"][SMALLER]["contexts"].values()
    assert row["peer_step_ms"] > 0 and row["peer_mode"] == "off"
    assert "peer ms/token" in (tmp_path / "table.md").read_text()


def test_sparrow_costs_and_the_projection(tmp_path):
    results = run_benchmark([SMALLER], [256], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2,),
                            sparrow={"total": 10, "depth": 3, "topk": 3}, taus=(2.0, 4.0), out=tmp_path)
    (row,) = results["sparrow"]
    assert row["shape"] == "10-3-3" and row["tree_verify_ms"] > 0 and row["head_tree_ms"] > 0
    assert row["round_ms"] == row["tree_verify_ms"] + row["head_tree_ms"] + row["head_step_ms"]
    assert abs(row["projected"][4.0] - 2 * row["projected"][2.0]) < 1e-9
    assert "projected speedup at τ = 2 / 4" in (tmp_path / "table.md").read_text()


def test_the_heads_tree_with_a_draft_vocabulary_is_timed_beside_and_projected(tmp_path):
    results = run_benchmark([SMALLER], [256], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2,),
                            sparrow={"total": 10, "depth": 3, "topk": 3, "vocab": 500}, taus=(2.0,), out=tmp_path)
    (row,) = results["sparrow"]
    assert row["draft_vocab"] == 500 and row["head_tree_vocab_ms"] > 0 and row["head_tree_ms"] > 0
    assert row["round_ms"] == row["tree_verify_ms"] + row["head_tree_vocab_ms"] + row["head_step_ms"]
    assert "(500 tokens)" in (tmp_path / "table.md").read_text()


def test_paths_and_the_profile_of_a_step(tmp_path):
    """Several decode paths timed on one cache (the compiled one built and warmed on first use),
    each with a profile of its step; the cache is as long after the profile as before."""
    results = run_benchmark([SMALLER], [256], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2,),
                            paths=("lean", "compiled"), profile=True, out=tmp_path)
    (row,) = results["models"][SMALLER]["contexts"].values()
    assert set(row["step_ms_by_path"]) == {"lean", "compiled"} and row["path"] == "compiled"
    assert set(row["profile"]) == {"lean", "compiled"}
    assert "aten::" in row["profile"]["lean"]
    assert "## qwen2.5-vl-7b" in (tmp_path / "profile.md").read_text()


def test_captured_paths_over_packed_copies(tmp_path):
    """"+packed" paths time a captured step over packed copies of the layers (uncaptured on the
    CPU: the same body a graph replays), beside the step over the weights as loaded."""
    results = run_benchmark([SMALLER], [128], device="cpu", dtype="float32", steps=2, repeats=1, ks=(2,),
                            paths=("cudagraph", "cudagraph+packed"), out=tmp_path)
    (row,) = results["models"][SMALLER]["contexts"].values()
    assert set(row["step_ms_by_path"]) == {"cudagraph", "cudagraph+packed"} and row["path"] == "cudagraph+packed"
