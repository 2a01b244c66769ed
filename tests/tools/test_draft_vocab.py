"""tools.draft_vocab: the most used token ids of a run's answers or of text files, and its errors."""

import json

from tools.draft_vocab import count_tokens, files_of, main, most_used

TARGET = "zoo/weights/qwen-target"


def results(path, answers, failed=0):
    rows = [{"request": f"r{i}", "status": "ok", "metrics": {"output_ids": ids}} for i, ids in enumerate(answers)]
    rows += [{"request": f"f{i}", "status": "failed", "error": "boom"} for i in range(failed)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_runs_answers_are_counted_and_the_most_used_kept(tmp_path, capsys):
    results(tmp_path / "run" / "results.jsonl", [[5, 6, 5, 3], [5, 7, 3]], failed=1)
    counts = count_tokens(files_of([tmp_path]))
    assert counts == {5: 3, 3: 2, 6: 1, 7: 1}
    chosen = most_used(counts, 3)
    assert chosen["ids"] == [5, 3, 6] and chosen["covered"] == 6 / 7       # 6 before 7: a tie goes to the smaller id
    assert chosen["distinct"] == 4
    out = tmp_path / "vocab.json"
    assert main([str(tmp_path / "run"), "--size", "2", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["ids"] == [5, 3]
    assert "2 token ids of 4 seen cover 71.4 % of 7 tokens" in capsys.readouterr().out


def test_a_one_request_runs_metrics_count_and_a_results_files_metrics_do_not_count_twice(tmp_path):
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "metrics.json").write_text(json.dumps({"output_ids": [9, 9, 4]}))
    results(tmp_path / "many" / "results.jsonl", [[9, 4]])
    (tmp_path / "many" / "metrics.json").write_text(json.dumps({"runs": [{"output_ids": [9, 4]}]}))
    (tmp_path / "many" / "plan.txt").write_text("a run's plan, not an answer")
    (tmp_path / "failed").mkdir()                                   # a run that failed at setup: no answers
    (tmp_path / "failed" / "plan.txt").write_text("plan")
    (tmp_path / "failed" / "error.txt").write_text("Traceback")
    assert count_tokens(files_of([tmp_path])) == {9: 3, 4: 2}


def test_text_files_go_through_the_targets_tokenizer(tmp_path):
    from models.load import tokenizer_of

    (tmp_path / "a.txt").write_text("a red circle moves left . a red square stays .")
    out = tmp_path / "vocab.json"
    assert main([str(tmp_path / "a.txt"), "--model", TARGET, "--size", "4", "--out", str(out)]) == 0
    tokenizer = tokenizer_of(TARGET).tokenizer
    ids = tokenizer("a red circle moves left . a red square stays .", add_special_tokens=False)["input_ids"]
    want = sorted(set(ids), key=lambda i: (-ids.count(i), i))[:4]
    assert json.loads(out.read_text())["ids"] == want


def test_what_cannot_be_counted_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("words")
    assert main([str(tmp_path / "a.txt"), "--size", "4", "--out", str(tmp_path / "v.json")]) == 2
    assert "pass --model" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), "--size", "4", "--out", str(tmp_path / "v.json")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    results(tmp_path / "r" / "results.jsonl", [], failed=2)
    assert main([str(tmp_path / "r"), "--size", "4", "--out", str(tmp_path / "v.json")]) == 2
    assert "no tokens counted" in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()
