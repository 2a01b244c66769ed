"""The lossless check over a sweep's answers, on sweep folders written as Hydra and the runner do."""

import json

from bench.same_tokens import compare, main


def job(sweep, name, overrides, answers, failed=()):
    folder = sweep / name
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    rows = [{"request": r, "status": "ok", "metrics": {"output_ids": ids}} for r, ids in answers.items()]
    rows += [{"request": r, "status": "failed", "error": "boom"} for r in failed]
    (folder / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_each_job_is_compared_with_the_ar_job_of_its_own_other_settings(tmp_path, capsys):
    job(tmp_path, "0", ["resources=gpu", "method=ar"], {"a": [1, 2, 3], "b": [4, 5]})
    job(tmp_path, "1", ["resources=gpu", "method=sparrow"], {"a": [1, 2, 3], "b": [4, 5]})
    job(tmp_path, "2", ["resources=split", "method=ar"], {"a": [1, 2, 9], "b": [4, 5]})
    job(tmp_path, "3", ["resources=split", "method=sparrow"], {"a": [1, 2, 9], "b": [4, 5]})
    rows, same = compare(tmp_path)
    assert same and [(r["job"], r["identical"]) for r in rows] == [("1", 2), ("3", 2)]
    assert main([str(tmp_path), "--out", str(tmp_path / "t.md")]) == 0
    assert "every answer identical" in (tmp_path / "t.md").read_text()


def test_a_different_token_or_a_missing_answer_fails_and_says_where(tmp_path, capsys):
    job(tmp_path, "0", ["method=ar"], {"a": [1, 2, 3, 4], "b": [4, 5]})
    job(tmp_path, "1", ["method=vanilla_sd"], {"a": [1, 2, 7, 4], "b": [4, 5]})
    job(tmp_path, "2", ["method=parallelvlm"], {"a": [1, 2, 3, 4]}, failed=["b"])
    rows, same = compare(tmp_path)
    assert not same
    assert rows[0]["first_difference"] == "a: token 2 of 4" and rows[0]["identical"] == 1
    assert rows[1]["first_difference"] == "answered by one side only: b"
    assert main([str(tmp_path)]) == 1
    assert "SOME ANSWERS DIFFER" in capsys.readouterr().out


def test_a_sweep_without_the_baseline_is_its_own_error(tmp_path, capsys):
    job(tmp_path, "0", ["method=sparrow"], {"a": [1]})
    assert main([str(tmp_path)]) == 2
    assert "no job with method=ar" in capsys.readouterr().err
