"""The local lmms-eval task's questions and their exact scoring (evaluation.toy_task): an answer
that tells the truth picks the right option for every shipped question, a wrong one does not, and
the shipped questions are what their random seeds make."""

import json

import pytest

from evaluation.toy_task import QUESTIONS, chosen, clause_key, multiple_choice, questions, write_questions
from zoo.captions import caption
from zoo.world import Truth, make_world


def _truthful_answer(doc: dict) -> str:
    """What a model that saw everything would answer the doc's prompt, in the toy grammar."""
    truth = make_world(doc["seed"], doc["seconds"]).truth
    if doc["kind"] == "color":
        return f"{doc['options'][doc['answer']]} ."
    if doc["kind"] == "events":        # the events after the named appearance, in order
        color, shape = doc["prompt"].split()[4:6]
        i = next(i for i, e in enumerate(truth.events) if e.kind == "appear" and (e.color, e.shape) == (color, shape))
        return caption(Truth(truth.seconds, truth.events[i + 1:]))
    return caption(truth)


def test_the_shipped_questions_are_what_the_seeds_make(tmp_path):
    shipped = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]
    assert shipped == write_questions(tmp_path / "q.jsonl")
    assert {d["kind"] for d in shipped} == {"color", "events", "order"}
    assert len({d["id"] for d in shipped}) == len(shipped) == 24


SHIPPED = [json.loads(line) for line in QUESTIONS.read_text().splitlines()]


@pytest.mark.parametrize("doc", SHIPPED, ids=lambda d: d["id"])
def test_a_truthful_answer_picks_the_right_option(doc):
    assert chosen(doc["kind"], _truthful_answer(doc), doc["options"]) == doc["answer"]
    wrong = [o for i, o in enumerate(doc["options"]) if i != doc["answer"]][0]
    if doc["kind"] == "color":
        assert chosen("color", f"{wrong} .", doc["options"]) != doc["answer"]
    elif doc["kind"] == "events":
        assert chosen("events", wrong, doc["options"]) != doc["answer"]
    else:   # the other event told first
        assert chosen("order", f"{wrong} {doc['options'][doc['answer']]}", doc["options"]) != doc["answer"]


def test_answers_stating_no_option_are_wrong():
    doc = questions(3)[0]
    assert chosen(doc["kind"], "", doc["options"]) == -1
    assert chosen("events", "the purple ring grows .", ["the red star grows .", "a small red star appears ."]) == -1
    assert chosen("order", "the background is plain .", ["the red star grows .", "the blue ring shrinks ."]) == -1


def test_clause_keys_and_the_readable_question():
    assert clause_key("the red star turns blue .") == ("recolor", "red", "star", "blue")
    with pytest.raises(ValueError, match="not one clause"):
        clause_key("the red star grows . the blue ring grows .")
    text = multiple_choice(questions(0)[0])
    assert text.splitlines()[1].startswith("A. ") and text.endswith("Answer with the option's letter.")
