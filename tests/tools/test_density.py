"""The density probe: its cases parse (and impossible ones are refused), and it describes a world
of a chosen event density with a shipped target."""

import pytest

from tools.density import measure, parse_cases
from zoo import world


def test_density_cases_parse_and_bad_ones_are_refused():
    assert parse_cases("30:2-6,120:8-24") == [(30.0, (2.0, 6.0)), (120.0, (8.0, 24.0))]
    for bad in ("30", "30:2", "x:2-6", "30:6-2", "30:0.5-2", "30:0.99-2", "0:2-6"):
        with pytest.raises(ValueError, match="case"):
            parse_cases(bad)


def test_density_describes_a_chosen_world_with_the_shipped_target():
    rows = measure("zoo/weights/qwen-target", [(8.0, (2.0, 3.0))], videos=1, first_seed=200)
    truth = world.make_world(200, 8.0, (2.0, 3.0)).truth
    assert rows[0]["events"] == rows[0]["max_events"] == len(truth.events) >= 2
    assert rows[0]["f1"] > 0.5        # the target describes short worlds near-perfectly; 0 means frames or decoding broke
