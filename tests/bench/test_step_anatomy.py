"""bench.step_anatomy's bookkeeping on the CPU with a tiny random shape (the figures need a GPU)."""

import torch

from bench.step_anatomy import main, packed_products, products
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
        assert sum("prefix-attention path" in n for n in names) == 3 and sum("split attention" in n for n in names) == 3
        assert any("RMSNorm" in n for n in names)
        assert all(float(r[1]) > 0 for r in rows)
    assert capsys.readouterr().out.count("### ") == 2          # each table printed as it is done
