"""python -m tools.keys on a small random checkpoint: one row per layer, sane shares."""

from __future__ import annotations

from tests.models.test_adapters import random_checkpoint
from tools.keys import layer_report, main


def test_key_report_has_a_row_per_layer(tmp_path, capsys):
    path = random_checkpoint(tmp_path / "m", "qwen-draft", seed=5)
    rows = layer_report(str(path), videos=1, seconds=8.0)
    assert [r["layer"] for r in rows] == [0, 1]
    for r in rows:
        assert 0 <= r["objects_among_kept_half"] <= 1 and 0 < r["object_share"] < 1
        assert -1 <= r["spearman_score_vs_attention"] <= 1 and r["key_norm_object"] > 0
    assert main(["--model", str(path), "--videos", "1"]) == 0
    assert "| layer |" in capsys.readouterr().out
