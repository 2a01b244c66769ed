"""bench.tiled_kernel: runs on a small weight and prints one row per thread count and row count,
with float32 and bfloat16 tiles checked equal before they are timed."""

from __future__ import annotations

from bench import tiled_kernel


def test_the_table_has_a_row_per_thread_count_and_row_count(capsys):
    tiled_kernel.main(["--shape", "64", "40", "--rows", "1", "3", "--threads", "1", "--cold-mib", "0.05"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "3"]
    assert all(float(cell) > 0 for r in rows for cell in r.strip("|").split("|")[2:])
