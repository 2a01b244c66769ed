"""Speed per answer and its summaries (evaluation.speed)."""

from evaluation.speed import flat, percentile, sample_speed, summary


def test_a_sample_speed_from_a_requests_metrics():
    run = {"ttft_s": 0.5, "decode_s": 1.0, "wall_s": 1.5, "n_generated": 11,
           "tokens_meta": {"mean_accepted_length": 3.2, "acceptance_rate": 0.7}}
    s = sample_speed(run, method="sparrow", plugin_s=0.01)
    assert s == {"method": "sparrow", "ttft_s": 0.5, "decode_tokens_per_s": 10.0, "wall_s": 1.5, "n_generated": 11,
                 "mean_accepted_length": 3.2, "acceptance_rate": 0.7, "plugin_s": 0.01}
    ar = sample_speed({"ttft_s": 0.5, "decode_s": 0.0, "wall_s": 0.5, "n_generated": 1, "tokens_meta": None},
                      method="ar", plugin_s=0.0)
    assert ar["decode_tokens_per_s"] is None and ar["mean_accepted_length"] is None


def test_percentiles_and_summaries():
    assert percentile([1, 2, 3, 4, 5], 0.5) == 3 and percentile([1, 2, 3, 4, 5], 0.9) == 4.6
    assert percentile([7.0], 0.9) == 7.0
    records = [{"ttft_s": t, "wall_s": 2 * t, "mean_accepted_length": None} for t in (1.0, 2.0, 3.0)]
    s = summary(records)
    assert s["ttft_s"] == {"median": 2.0, "p90": 2.8, "n": 3} and "mean_accepted_length" not in s
    assert flat(s) == {"ttft_s_median": 2.0, "ttft_s_p90": 2.8, "wall_s_median": 4.0, "wall_s_p90": 5.6}
