"""The reelflow_toy task's functions for lmms-eval (evaluation/toy_task.py builds and scores it)."""

from evaluation.toy_task import LETTERS, chosen
from zoo.videos import ensure_video


def doc_to_visual(doc):
    """The question's toy video, made once into reelflow's cache."""
    path, _ = ensure_video(int(doc["seed"]), float(doc["seconds"]), float(doc["fps"]), int(doc["size"]))
    return [str(path)]


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    """The question as the toy models read it (their grammar)."""
    return doc["prompt"]


def doc_to_target(doc):
    return LETTERS[int(doc["answer"])]


def process_results(doc, results):
    """Exact scoring: the option the free answer states, against the right one."""
    pick = chosen(doc["kind"], results[0], list(doc["options"]))
    return {"accuracy": float(pick == int(doc["answer"]))}
