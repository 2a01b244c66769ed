"""A draft vocabulary for a Sparrow head: the N tokens answers use most, counted from the target's
own answers (a run's results.jsonl) or from text files tokenized with the target's tokenizer.

    python -m run +experiment=ar data=folder data.folder=~/videos hydra.run.dir=runs/ar   # the target's own answers
    python -m tools.draft_vocab runs/ar --size 32768 --out draft_vocab.json
    python -m tools.draft_vocab answers/ --model ~/ckpt/qwen2.5-vl-7b --size 32768 --out draft_vocab.json
    python -m run +experiment=sparrow graph.draft_vocab=draft_vocab.json

Sources: a run's answers (results.jsonl, each finished request's output_ids as the target
produced them; metrics.json for a one-request run) and .txt files (tokenized with --model's
tokenizer, which only a text source needs; a run folder's own .txt files are left out); a folder
is searched for both, recursively. Writes {"ids": [...most used first], "covered": the share of the counted
tokens the ids cover, "counted", "distinct", "sources"} and prints the coverage; the head also
always keeps the target's end-of-answer tokens (speculative.draft_vocab adds them).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def files_of(sources: list[Path]) -> list[Path]:
    """The answer files (results.jsonl; metrics.json where no results.jsonl sits beside it, which
    would hold the same answers) and .txt files among `sources` (files, or folders searched
    recursively)."""
    found = []
    for source in sources:
        if not source.exists():
            raise FileNotFoundError(f"{source}: no such file or folder")
        if source.is_dir():
            found += sorted(p for p in source.rglob("*") if p.name == "results.jsonl"
                            or (p.name == "metrics.json" and not (p.parent / "results.jsonl").exists())
                            or (p.suffix == ".txt" and not _run_dir(p.parent)))
        else:
            found.append(source)
    if not found:
        raise FileNotFoundError(f"no results.jsonl, metrics.json or .txt files in {', '.join(map(str, sources))}")
    return found


def _run_dir(folder: Path) -> bool:
    """A reelflow run's folder (finished or not), whose .txt files (plan.txt, error.txt) are not answers."""
    return any((folder / name).exists() for name in ("results.jsonl", "metrics.json", "plan.txt", "error.txt",
                                                      ".hydra"))


def count_tokens(files: list[Path], tokenizer=None) -> Counter:
    """Token id -> how often it occurs: a results.jsonl's answers as they are, a text file's words
    through `tokenizer` (needed only for text files)."""
    counts: Counter = Counter()
    for path in files:
        if path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                row = json.loads(line) if line.strip() else {}
                ids = (row.get("metrics") or {}).get("output_ids") if row.get("status") == "ok" else None
                counts.update(ids or [])
        elif path.suffix == ".json":              # a run's metrics.json: one answer, or several as runs
            metrics = json.loads(path.read_text())
            for run in metrics.get("runs") or [metrics]:
                counts.update(run.get("output_ids") or [])
        else:
            if tokenizer is None:
                raise ValueError(f"{path}: a text file is tokenized with the target's tokenizer: pass --model")
            counts.update(tokenizer(path.read_text(), add_special_tokens=False)["input_ids"])
    if not counts:
        raise ValueError("no tokens counted: the results hold no finished answers, the text files are empty")
    return counts


def most_used(counts: Counter, size: int) -> dict:
    """The `size` most used ids (ties: the smaller id first) and what share of the counts they cover."""
    if size < 1:
        raise ValueError(f"--size must be ≥ 1, got {size}")
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
    total = sum(counts.values())
    return {"ids": [i for i, _ in ranked], "covered": sum(c for _, c in ranked) / total, "counted": total,
            "distinct": len(counts)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.draft_vocab",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("sources", nargs="+", type=Path,
                        help="a run's results.jsonl or metrics.json, .txt files, or folders of them")
    parser.add_argument("--size", type=int, required=True, help="how many token ids to keep")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument("--model", help="the target (a directory or hub id on disk): its tokenizer, for text files")
    args = parser.parse_args(argv)
    try:
        files = files_of(args.sources)
        tokenizer = None
        if args.model and any(p.suffix != ".jsonl" for p in files):
            from models.load import tokenizer_of

            tokenizer = tokenizer_of(args.model).tokenizer
        chosen = most_used(count_tokens(files, tokenizer), args.size)
    except (FileNotFoundError, ValueError) as e:
        print(f"draft_vocab: {e}", file=sys.stderr)
        return 2
    chosen["sources"] = [str(p) for p in files]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(chosen))
    print(f"{len(chosen['ids'])} token ids of {chosen['distinct']} seen cover {100 * chosen['covered']:.1f} % of "
          f"{chosen['counted']} tokens counted in {len(files)} files -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
