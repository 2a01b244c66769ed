"""Port types that compute: the speculative record's figures on a hand-made run."""

from stages.types import SpeculativeStats, Tokens


def test_speculative_figures_from_rounds():
    # 3 rounds of γ = 4: accepted 4, 1, 0 draft tokens, each round + the target's own token = 8 committed
    stats = SpeculativeStats(committed=8, accepted=(4, 1, 0), drafted=(4, 4, 4), windows=(4, 4, 4),
                             verify_s=(0.002, 0.004, 0.003), tq_s=0.0005, stale_proposals=1)
    m = stats.metrics()
    assert m["rounds"] == 3 and m["mean_accepted_length"] == round(8 / 3, 4)
    assert m["acceptance_rate"] == round(5 / 12, 4)
    assert m["per_position_acceptance"] == [round(2 / 3, 4), round(1 / 3, 4), round(1 / 3, 4), round(1 / 3, 4)]
    assert m["tp_ms"] == 3.0 and m["tq_ms"] == 0.5 and m["window_last"] == 4 and m["stale_proposals"] == 1
    # the paper's M: rounds 2 and 3 rejected, so the 8 tokens came in two runs between rollbacks
    assert m["tokens_per_rollback"] == 4.0


def test_tokens_between_rollbacks_count_a_last_run_without_one():
    # accepted whole, rejected, accepted whole: runs end at the rejection and at the end
    stats = SpeculativeStats(committed=13, accepted=(4, 2, 4), drafted=(4, 4, 4))
    assert stats.runs_between_rollbacks() == 2 and stats.metrics()["tokens_per_rollback"] == 6.5
    assert SpeculativeStats(committed=5, accepted=(4,), drafted=(4,)).metrics()["tokens_per_rollback"] == 5.0


def test_tokens_details_join_meta_and_the_record():
    plain = Tokens([1, 2], "a b", {"model": "m"})
    assert plain.details() == {"model": "m"}
    spec = Tokens([1, 2], "a b", {"model": "m"}, SpeculativeStats(committed=2, accepted=(1,), drafted=(2,)))
    assert spec.details()["model"] == "m" and spec.details()["mean_accepted_length"] == 2.0
    assert SpeculativeStats(committed=0).metrics()["mean_accepted_length"] is None     # no round at all
