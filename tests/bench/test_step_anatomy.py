"""bench.step_anatomy's bookkeeping on the CPU with a tiny random shape (the figures need a GPU)."""

import pytest
import torch

from bench.step_anatomy import (
    best_setting,
    describe,
    main,
    packed_products,
    products,
    sweep_markdown,
    sweep_settings,
)
from models.load import load_model
from models.packing import packed_layers
from tests.models.test_shapes import TINY


def test_the_products_run_every_layer_over_every_row():
    lm = load_model(TINY)
    x = torch.randn(3, lm.hidden_size)
    assert products(lm.lean, x).shape == (3, lm.hidden_size)
    # the same products, fused (float32 rounding apart: another blocking of the same sums)
    torch.testing.assert_close(packed_products(packed_layers(lm.text), x), products(lm.lean, x), rtol=1e-4, atol=1e-5)


def test_a_run_writes_a_table_per_context_with_the_floor_first(tmp_path, capsys):
    main([TINY, "--contexts", "64", "96", "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path)])
    text = (tmp_path / "anatomy.md").read_text()
    tables = text.split("### ")[1:]
    assert len(tables) == 2 and "64 cached entries" in tables[0] and "96 cached entries" in tables[1]
    for table in tables:
        rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
        assert rows[0][0] == "| floor: the step's bytes over the copy bandwidth" and rows[0][2] == "1.00 |"
        names = [r[0] for r in rows]
        # every part the module doc lists, on the CPU (captured steps and SDPA need CUDA)
        assert sum("weight products" in n for n in names) == 6 and sum("LM head" in n for n in names) == 3
        assert sum("weight products packed" in n for n in names) == 3
        products = [n for n in names if " 1 row: " in n]                    # each packed product alone, one row
        assert [n.split(" ×")[0].removeprefix("| ") for n in products] == ["q, k, v (one product)", "o",
                                                                          "gate, up (one product)", "down"]
        assert all(n.endswith("TB/s") for n in products)
        assert sum("prefix-attention path" in n for n in names) == 3 and sum("split attention" in n for n in names) == 3
        assert any("RMSNorm" in n for n in names)
        assert all(float(r[1]) > 0 for r in rows)
    assert capsys.readouterr().out.count("### ") == 2          # each table printed as it is done


def test_the_kernel_sweep_covers_the_defaults_and_names_settings_as_the_environment_takes_them():
    from models.prefix_attention import Tuning, tuning_from

    settings = sweep_settings()
    assert settings[0] == Tuning() and len(set(settings)) == len(settings) == 24      # the defaults first
    assert any(t.max_block_r == 128 for t in settings)
    assert all(tuning_from("" if describe(t) == "defaults" else describe(t)) == t for t in settings)
    assert describe(Tuning()) == "defaults" and describe(Tuning(block_n=128)) == "block_n=128"


def test_the_fastest_setting_is_judged_relative_to_the_defaults_everywhere():
    # at 8K the second setting saves 20 %, at 32K the first saves 10 %: relative, the second wins,
    # though the long context's milliseconds favour the first
    short = {"defaults": {1: 1.0, 32: 1.0}, "a": {1: 1.0, 32: 1.0}, "b": {1: 0.8, 32: 0.8}, "c": {1: 0.1}}
    long = {"defaults": {1: 10.0, 32: 10.0}, "a": {1: 9.0, 32: 9.0}, "b": {1: 10.0, 32: 10.0}, "c": {1: 0.1}}
    assert best_setting([short, long]) == "b"      # "c", timed at one token count only, is not a candidate
    table = sweep_markdown("t", short, {"d": "32 tokens: OutOfResources: shared memory"})
    assert table.splitlines()[4].startswith("| c | 0.100 | – |")     # sorted by the one-token time
    assert table.splitlines()[-1] == "- left out: d: 32 tokens: OutOfResources: shared memory"


def test_the_kernel_sweep_needs_a_cuda_device(capsys):
    with pytest.raises(SystemExit):
        main([TINY, "--device", "cpu", "--dtype", "float32", "--kernel-sweep"])
    assert "CUDA device" in capsys.readouterr().err


def test_a_setting_that_fails_or_answers_otherwise_is_left_out(monkeypatch):
    """kernel_sweep's bookkeeping on the CPU (the torch path; the settings change nothing there):
    a launch that raises and one whose output differs from the defaults' are named, not timed."""
    import bench.step_anatomy as anatomy
    from models import prefix_attention
    from models.prefix_attention import Tuning

    real = anatomy.held_attention

    def held_attention(*args):
        tuning = prefix_attention.TUNING
        if tuning.block_n == 16:
            raise RuntimeError("out of resource: shared memory, required: 262144")
        out = real(*args)
        return out + 1 if tuning.splits_per_sm == 8 else out

    monkeypatch.setattr(anatomy, "held_attention", held_attention)
    monkeypatch.setattr(anatomy, "sweep_settings", lambda: [Tuning(), Tuning(block_n=16), Tuning(splits_per_sm=8),
                                                            Tuning(num_warps=8)])
    lm = load_model(TINY)
    _, times, failures = anatomy.kernel_sweep(lm, 48, tokens=(1, 4))
    assert set(times) == {"defaults", "num_warps=8"} and all(set(row) == {1, 4} for row in times.values())
    assert failures["block_n=16"].startswith("1 tokens: RuntimeError: out of resource")
    assert "differs from the defaults'" in failures["splits_per_sm=8"]
    assert best_setting([times]) in times
