"""score: an answer against the request's reference (caption_eval): the toy world's event-level
precision / recall / F1 (zoo.world.score), so a run's quality sits next to its speed."""

from __future__ import annotations

from graph.stage import In, Out, Stage
from stages.types import Request, Score, Tokens
from zoo import captions, world


class CaptionScore(Stage):
    placement = "cpu"
    inputs = {"tokens": In(Tokens), "request": In(Request)}
    outputs = {"score": Out(Score)}

    def __call__(self, ctx, tokens: Tokens, request: Request):
        if request.reference is None:
            raise ValueError(f"request {request.id} has no reference to score against "
                             "(use data=toy_eval, or a manifest with a 'reference' truth per row)")
        truth = world.Truth.from_dict(request.reference)
        values = captions.score(tokens.text or "", truth)
        return {"score": Score({k: values[k] for k in ("precision", "recall", "f1")} | {"events": len(truth.events)})}
