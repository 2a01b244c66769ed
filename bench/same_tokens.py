"""Whether every method in a sweep answered token for token what `ar` answered.

    python -m bench.same_tokens SWEEP_DIR [--baseline method=ar] [--out FILE]

A speculative method is lossless when, at temperature 0, its answers are the target's own greedy
tokens; `ar` in the same sweep is that reference (its tokens are the target's `generate()`'s, which
the tests check). Each job of the sweep (a folder with .hydra/overrides.yaml and results.jsonl) is
compared with the baseline job whose other overrides are the same (`resources=gpu` with
`resources=gpu`), request by request. Prints a table (and writes it to --out); exits 1 when any
answer differs or a request has no baseline answer, 2 when the sweep has no baseline job.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def job_answers(job: Path) -> dict[str, list[int]]:
    """request id -> its output token ids, for the requests that finished well."""
    answers = {}
    path = job / "results.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line.strip() else None
            if row and row.get("status") == "ok":
                answers[row["request"]] = row["metrics"]["output_ids"]
    return answers


def sweep_jobs(sweep: Path) -> list[tuple[list[str], Path]]:
    """(overrides, folder) of each job under a Hydra sweep dir, in the sweep's order."""
    jobs = []
    for overrides in sweep.glob("*/.hydra/overrides.yaml"):
        job = overrides.parent.parent
        jobs.append((list(yaml.safe_load(overrides.read_text()) or []), job))
    return sorted(jobs, key=lambda j: (len(j[1].name), j[1].name))


def compare(sweep: Path, baseline: str = "method=ar") -> tuple[list[dict], bool]:
    """One row per job: its overrides, requests compared, identical ones, and the first that
    differs; and whether every job matched its baseline on every request."""
    key, _, _ = baseline.partition("=")
    jobs = sweep_jobs(sweep)

    def others(overrides):        # the job's settings apart from the compared one
        return tuple(sorted(o for o in overrides if o.partition("=")[0] != key))

    references = {others(o): job_answers(j) for o, j in jobs if baseline in o}
    if not references:
        raise LookupError(f"no job with {baseline} under {sweep}")
    rows, all_same = [], True
    for overrides, job in jobs:
        if baseline in overrides:
            continue
        reference = references.get(others(overrides))
        answers = job_answers(job)
        if reference is None:
            rows.append({"job": job.name, "overrides": " ".join(overrides), "requests": len(answers),
                         "identical": 0, "first_difference": f"no {baseline} job with the same other settings"})
            all_same = False
            continue
        missing = sorted(set(reference) - set(answers)) + sorted(set(answers) - set(reference))
        same = [r for r in answers if r in reference and answers[r] == reference[r]]
        differ = [r for r in answers if r in reference and answers[r] != reference[r]]
        first = ""
        if differ:
            mine, theirs = answers[differ[0]], reference[differ[0]]
            at = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            first = f"{differ[0]}: token {at} of {len(theirs)}"
        elif missing:
            first = f"answered by one side only: {', '.join(missing[:3])}"
        all_same &= not differ and not missing
        rows.append({"job": job.name, "overrides": " ".join(overrides), "requests": len(answers),
                     "identical": len(same), "first_difference": first})
    return rows, all_same


def table(rows: list[dict], baseline: str) -> str:
    lines = [f"| job | overrides | requests | identical to {baseline} | first difference |", "|---|---|---|---|---|"]
    lines += [f"| {r['job']} | {r['overrides']} | {r['requests']} | {r['identical']} | {r['first_difference']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.same_tokens", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", type=Path, help="a Hydra sweep dir (hydra.sweep.dir)")
    parser.add_argument("--baseline", default="method=ar", help="the override naming the reference jobs")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    try:
        rows, all_same = compare(args.sweep, args.baseline)
    except LookupError as e:
        print(f"same_tokens: {e}", file=sys.stderr)
        return 2
    text = table(rows, args.baseline) + ("\nevery answer identical\n" if all_same else "\nSOME ANSWERS DIFFER\n")
    print(text, end="")
    if args.out:
        args.out.write_text(text)
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
