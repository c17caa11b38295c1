"""The graph-bank policy's decisions on plain counters (cgcompile/runtime/bank/policy.py); the runtime that feeds
them is tested end to end in test_graph_bank.py."""

from __future__ import annotations

from cgcompile.runtime.bank import policy as bank_policy
from cgcompile.runtime.bank.policy import BankCounters


def test_a_graph_is_stale_only_after_the_window_per_graph_of_its_parameter_set():
    window = bank_policy.RELEASE_WINDOW
    assert not bank_policy.is_stale(last_use=10, now=10 + window, graphs=1)
    assert bank_policy.is_stale(last_use=10, now=11 + window, graphs=1)
    # a parameter set holding 8 graphs (sizes, grad and no-grad) shares its calls among them: the window stretches
    assert not bank_policy.is_stale(last_use=10, now=11 + window, graphs=8)
    assert bank_policy.is_stale(last_use=10, now=11 + 8 * window, graphs=8)
    assert bank_policy.is_stale(last_use=0, now=3, graphs=0, window=2)  # no graph counts as one


def test_graphs_are_judged_after_a_few_calls_per_graph_of_their_parameter_set():
    after = bank_policy.JUDGE_AFTER
    assert not bank_policy.is_judged(captured_at=5, now=5 + after, graphs=1)
    assert bank_policy.is_judged(captured_at=5, now=6 + after, graphs=1)
    assert not bank_policy.is_judged(captured_at=5, now=6 + after, graphs=2)


def test_capture_stops_only_when_most_judged_graphs_or_sizes_went_unused():
    enough = bank_policy.WASTED_TO_STOP
    assert not bank_policy.mostly_wasted(wasted=enough - 1, judged=enough)
    assert bank_policy.mostly_wasted(wasted=enough, judged=2 * enough)
    assert not bank_policy.mostly_wasted(wasted=enough, judged=2 * enough + 1)


def test_a_storm_is_re_captures_in_a_row_without_a_replay_between():
    streak = 0
    for _ in range(bank_policy.STORM_STREAK):
        assert not bank_policy.storm(streak)
        streak = bank_policy.recapture_streak(streak, replays=1)  # only the capture's own replay
    assert bank_policy.storm(streak)
    # one replay in between and the count starts over: an occasional re-allocation is no storm
    assert bank_policy.recapture_streak(streak, replays=2) == 1


def test_counters_report_the_hit_rate_and_the_reuse_after_warmup():
    row = BankCounters(calls=10, replays=6, misses=4, warmup_calls=2).as_dict()
    assert row["hit_rate"] == 0.6 and row["calls"] == row["replays"] + row["misses"]
    assert row["reuse"] == 0.75  # 6 of the 8 calls after warmup replayed a graph captured earlier
    assert BankCounters().hit_rate() == 0.0 and BankCounters(calls=3, warmup_calls=3).reuse() == 0.0
