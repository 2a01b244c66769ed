"""zoo.train.labels: the training-only targets sit on the cells and steps that show each event."""

from zoo import captions, world
from zoo.train.labels import AUX, cell_labels


def test_cell_labels_say_what_is_on_each_cell_and_where_the_cell_is():
    w = world.make_world(1_000_011, 20)
    labels = cell_labels(w, 2.0, 40, 2)                 # 20 temporal steps of 9 row-major cells
    assert labels.shape == (20 * 9, len(AUX))
    names = list(AUX)
    row, column = labels[:, names.index("row")], labels[:, names.index("column")]
    assert row.tolist() == [i // 3 for i in range(9)] * 20 and column.tolist() == [i % 3 for i in range(9)] * 20
    scene = world.scene_at(w, 39 / 2.0)                   # the last step's last frame
    last = labels[-9:]
    for sp in scene.sprites:
        cell = last[min(int(sp.y), 2) * 3 + min(int(sp.x), 2)]
        assert AUX["shape"][cell[0]] == sp.shape and AUX["color"][cell[1]] == sp.color
    assert (last[:, 0] > 0).sum() == len(scene.sprites)


def test_event_labels_mark_each_event_on_its_cell_in_the_step_that_first_shows_it():
    """A move marks its source cell `leave` when the glide starts and its destination with the
    direction when it ends; every event lands in the temporal step of the first frame showing it."""
    from zoo.train.labels import EVENT_CLASSES, event_labels

    w = world.make_world(3, 30)
    labels = event_labels(w, 2.0, 60, 2).reshape(30, 9)
    marked = {(int(s), int(c)): EVENT_CLASSES[labels[s, c]] for s, c in (labels != 0).nonzero()}
    # seed 3: appear 0.0 s and 4.33 s, recolor 6.97 s, moves left 10.53 s and right 14.25 s, ...
    moves = [(e, cell) for e, cell in zip(w.truth.events, w.cells) if e.kind == "move"]
    assert [e.change for e, _ in moves] == ["left", "right"]
    (_, (c, r)), _ = moves
    assert marked[(11, r * 3 + c + 1)] == "leave"              # moves left at 10.53 s: frame 22 is in step 11
    assert marked[(12, r * 3 + c)] == "left"                   # the glide ends 11.53 s: frame 24, step 12
    assert marked[(14, r * 3 + c)] == "leave" and marked[(15, r * 3 + c + 1)] == "right"    # and back at 14.25 s
    assert sorted(marked.values()).count("appear") == 3 and "recolor" in marked.values()
    assert len(marked) == 9


def test_event_tokens_are_where_each_event_is_shown():
    """Seed 3 at 2 fps, 2 frames a step: the first appearance in step 0 on its cell, a move on the
    cell it leaves (step 11) and the one it reaches (step 12), the opening background on all 9."""
    from zoo.train.labels import event_tokens

    w = world.make_world(3, 30)
    tokens = event_tokens(w, 2.0, 60, 2)
    assert len(tokens) == len(w.truth.events) and tokens[0] == list(range(9))
    first = w.cells[1]
    assert tokens[1] == [first[1] * 3 + first[0]]
    i = next(i for i, e in enumerate(w.truth.events) if e.kind == "move")
    (c, r) = w.cells[i]                                        # where the left move ends
    assert tokens[i] == [11 * 9 + r * 3 + c + 1, 12 * 9 + r * 3 + c]
    assert event_tokens(w, 2.0, 20, 2)[i] == []                # 10 s of video: the move is not in it
    earlier = event_tokens(w, 2.0, 60, 2, before=True)     # a change: also its cell one step before
    for j, e in enumerate(w.truth.events):
        if e.kind in ("disappear", "recolor", "grow", "shrink"):
            assert earlier[j] == [tokens[j][0] - 9] + tokens[j]
        else:
            assert earlier[j] == tokens[j]


def test_grounding_marks_each_clauses_tokens_with_its_events_cells():
    """The positions whose next token belongs to clause j look at event j's visual tokens; a
    "what happened after" answer starts at the event after the named one; other answers mark nothing."""
    from zoo.train.labels import answer_events, event_tokens, grounding_mask

    w = world.make_world(3, 30)
    truth, tokens = w.truth, event_tokens(w, 2.0, 60, 2)
    assert answer_events(truth, captions.caption(truth)) == list(range(len(truth.events)))
    assert answer_events(truth, captions.caption(world.Truth(30.0, truth.events[3:]))) == list(range(3, len(truth.events)))
    assert answer_events(truth, "red .") is None
    answer_at, video_at, width = 300, 5, 400
    mask = grounding_mask(truth, captions.caption(truth), tokens, answer_at, video_at, width)
    first, second = (len(captions.clause(e).split()) for e in truth.events[:2])
    assert mask[answer_at - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[0]]
    assert mask[answer_at + first - 2].nonzero().flatten().tolist() == [video_at + t for t in tokens[0]]
    assert mask[answer_at + first - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[1]]
    assert mask[answer_at + first + second - 1].nonzero().flatten().tolist() == [video_at + t for t in tokens[2]]
    assert not mask[: answer_at - 1].any()
    assert not grounding_mask(truth, "red .", tokens, answer_at, video_at, width).any()


def test_chain_marks_each_events_tokens_with_the_previous_events_before_them():
    """Rows: the visual tokens showing event j >= 1; columns: those showing event j - 1 that come
    before the row and do not show event j too. Nothing else has a target."""
    from zoo.train.labels import chain_mask, event_tokens

    w = world.make_world(3, 30)
    tokens, video_at = event_tokens(w, 2.0, 60, 2), 5
    mask = chain_mask(tokens, video_at, 700)
    appear = tokens[1][0]                      # event 1 appears in step 0, where the background (event 0) is on all 9
    assert mask[video_at + appear].nonzero().flatten().tolist() == [video_at + i for i in range(appear)]
    for j in range(2, len(tokens)):
        for q in tokens[j]:
            expected = [video_at + i for i in tokens[j - 1] if i < q and i not in tokens[j]]
            assert mask[video_at + q].nonzero().flatten().tolist() == expected
    rows = {video_at + q for ts in tokens[1:] for q in ts}
    assert all(int(r) in rows for r in mask.any(-1).nonzero().flatten())

