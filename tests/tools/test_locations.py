"""The move-error diagnostics: recall by event kind counts each stated event once, and the
location probe finds a location that is in the features and not one that is absent."""

import torch

from tools.locations import location_probe, recall_by_kind
from zoo import captions, world


def test_recall_by_kind_splits_moves_by_direction_and_counts_each_stated_event_once():
    truth = world.make_world(1_000_021, 40).truth
    reference = captions.caption(truth)
    full = recall_by_kind([(reference, truth)])
    assert all(hit == total for hit, total in full.values())
    assert sum(total for _, total in full.values()) == len(truth.events)
    moves = [e for e in truth.events if e.kind == "move"]
    if moves:
        assert f"move {moves[0].change}" in full
    first = captions.parse(reference)[0]                          # state the first event twice, nothing else
    twice = recall_by_kind([(f"{reference.split(' . ')[0]} . {reference.split(' . ')[0]} .", truth)])
    kind = f"move {first[-1]}" if first[0] == "move" else first[0]
    assert twice[kind][0] == 1 and sum(hit for hit, _ in twice.values()) == 1


def test_location_probe_reads_a_location_the_tokens_carry_and_not_one_they_lack():
    g = torch.Generator().manual_seed(0)
    tokens, cells = [], []
    for _ in range(4):
        n = 90
        cell = torch.arange(n) % 9
        labels = torch.stack([torch.ones(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                              torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                              cell // 3, cell % 3], 1)
        noise = torch.randn(n, 8, generator=g)
        noise[:, 0] += 6.0 * (cell // 3).float()                    # the row is in the features, the column is not
        tokens.append(noise)
        cells.append(labels)
    acc = location_probe(tokens, cells)
    assert acc["row"] > 0.9 and acc["column"] < 0.6
