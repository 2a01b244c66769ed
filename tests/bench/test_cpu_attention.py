"""bench.cpu_attention: runs on a small cache and prints one row per thread count and row count,
with the kernel checked against torch's products before they are timed."""

from __future__ import annotations

from bench import cpu_attention


def test_the_table_has_a_row_per_thread_count_and_row_count(capsys):
    cpu_attention.main(["--cached", "40", "--rows", "2", "40", "--threads", "1", "--calls", "3"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert [r.split("|")[2].strip() for r in rows] == ["2", "40"]
    assert all(float(cell) > 0 for r in rows for cell in r.strip("|").split("|")[2:])
