"""A draft vocabulary: the tokens a Sparrow head may propose, with their rows of the LM head.

EAGLE-2's tree scores every level's nodes against the target's whole LM head. At the 7B's width
that is 152K rows × 3,584 a level, 1.09 GB read four times for a 4-level tree: on an H200 about
1.1 ms of a 2.5-ms tree (bench.step_anatomy's LM head over a few rows, 0.27 ms, four times),
more than the head's own layer. Letting the head propose only the N
tokens answers use most (as FR-Spec and EAGLE-3's draft vocabularies do) reads N rows instead.

Lossless whatever N: the target verifies with its own full LM head, so a token outside the set can
still be committed (as the target's own token after a rejection); it is only never drafted. What N
costs is acceptance where answers use rarer tokens; what it saves is the LM head's share of the
head's time, about N / V of it.

    vocab = DraftVocabulary.load("draft_vocab.json", lm)     # a JSON list of token ids, most used first
    vocab = DraftVocabulary.of(lm, ids)                      # or ids in hand
    logits = vocab.logits(states)                            # [..., N] float32: rows of the set
    tokens = vocab.ids[logits.topk(k).indices]               # back to the target's token ids

`python -m tools.draft_vocab` writes such a list from the target's own answers (a run's
results.jsonl) or from text files tokenized with the target's tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent          # relative paths are also tried from the project root


@dataclass(frozen=True)
class DraftVocabulary:
    ids: torch.Tensor                 # [N] int64 token ids, on the target's device
    weight: torch.Tensor              # [N, hidden] their LM head rows (a copy: a level reads these alone)
    bias: torch.Tensor | None = None  # [N] where the LM head has a bias

    @classmethod
    def of(cls, lm, ids, *, among: int | None = None) -> DraftVocabulary:
        """The set `ids` (token ids of lm's vocabulary, no repeats; its end-of-answer tokens are
        added when missing, so a drafted answer can end) over lm's LM head. among: the ids allowed
        (default lm.vocabulary, the tokens its tokenizer defines; a timing run of a `random:` shape,
        whose tokenizer is a toy's, passes the LM head's rows)."""
        ids, among = [int(i) for i in ids], lm.vocabulary if among is None else among
        bad = [i for i in ids if not 0 <= i < among]
        if bad:
            raise ValueError(f"draft vocabulary: token ids {bad[:5]} are outside the target's vocabulary "
                             f"of {among}")
        if len(set(ids)) != len(ids):
            raise ValueError("draft vocabulary: a token id is listed twice")
        ids += [e for e in sorted(lm.eos_ids) if e not in set(ids) and e < among]
        if not ids:
            raise ValueError("draft vocabulary: no token ids")
        head = lm.lm_head
        index = torch.tensor(ids, dtype=torch.long, device=head.weight.device)
        bias = head.bias.index_select(0, index) if getattr(head, "bias", None) is not None else None
        return cls(index, head.weight.index_select(0, index).contiguous(), bias)

    @classmethod
    def load(cls, path, lm) -> DraftVocabulary:
        """A JSON file: a list of token ids, or {"ids": [...], ...} as tools.draft_vocab writes. A
        relative path is tried as given, then from the project root (as a head's directory is)."""
        given = Path(path).expanduser()
        path = next((p for p in (given, ROOT / given) if p.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"draft vocabulary {given}: no such file (python -m tools.draft_vocab makes one)")
        data = json.loads(path.read_text())
        ids = data["ids"] if isinstance(data, dict) else data
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"draft vocabulary {path}: expected a list of token ids")
        return cls.of(lm, ids)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Final-norm states [..., hidden] -> float32 logits [..., N] over the set (the LM head's
        rows of these tokens: what lm.logits(states)[..., ids] would be)."""
        return F.linear(states, self.weight, self.bias).float()
