"""score: an answer against the request's reference (caption_eval), so a run's quality sits next
to its speed. What a reference is and how an answer is scored belong to the data's world, not to
the stage: the config names the scorer, `scorer(text, reference) -> {name: value}` (the toy
world's is zoo.captions.score_reference: event-level precision / recall / F1)."""

from __future__ import annotations

from hydra.utils import get_method

from graph.stage import In, Out, Stage
from stages.types import Request, Score, Tokens


class CaptionScore(Stage):
    placement = "cpu"
    inputs = {"tokens": In(Tokens), "request": In(Request)}
    outputs = {"score": Out(Score)}

    def __init__(self, scorer: str):
        self.score = get_method(scorer)   # a dotted path: "pkg.module.function"

    def __call__(self, ctx, tokens: Tokens, request: Request):
        if request.reference is None:
            raise ValueError(f"request {request.id} has no reference to score against "
                             "(use data=toy_eval, or a manifest with a 'reference' truth per row)")
        return {"score": Score(dict(self.score(tokens.text or "", request.reference)))}
