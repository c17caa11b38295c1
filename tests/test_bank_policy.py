"""The graph-bank policy's decisions on plain counters (cgcompile/runtime/bank_policy.py); the runtime that feeds
them is tested end to end in test_graph_bank.py."""

from __future__ import annotations

from cgcompile.runtime import bank_policy
from cgcompile.runtime.bank_policy import BankCounters


def test_a_graph_is_stale_only_after_the_window_per_live_graph():
    window = bank_policy.RELEASE_WINDOW
    assert not bank_policy.is_stale(last_use=10, now=10 + window, graphs=1)
    assert bank_policy.is_stale(last_use=10, now=11 + window, graphs=1)
    # a partition holding 8 graphs (8 layers, or shapes) is called about 8 times a step: the window stretches
    assert not bank_policy.is_stale(last_use=10, now=11 + window, graphs=8)
    assert bank_policy.is_stale(last_use=10, now=11 + 8 * window, graphs=8)
    assert bank_policy.is_stale(last_use=0, now=3, graphs=0, window=2)  # no graph counts as one


def test_graphs_are_judged_after_a_few_calls_per_live_graph():
    after = bank_policy.JUDGE_AFTER
    assert not bank_policy.is_judged(captured_at=5, now=5 + after, graphs=1)
    assert bank_policy.is_judged(captured_at=5, now=6 + after, graphs=1)
    assert not bank_policy.is_judged(captured_at=5, now=6 + after, graphs=2)


def test_new_sizes_on_most_calls_beyond_the_cap_stop_capture():
    assert not bank_policy.new_sizes_keep_coming(sizes=8, calls=8, cap=8)  # the bank can hold them all
    assert bank_policy.new_sizes_keep_coming(sizes=9, calls=9, cap=8)
    assert bank_policy.new_sizes_keep_coming(sizes=9, calls=18, cap=8)
    assert not bank_policy.new_sizes_keep_coming(sizes=9, calls=19, cap=8)  # sizes repeat on most calls


def test_unreplayed_captures_stop_capture_only_when_most_judged_graphs_were_wasted():
    enough = bank_policy.WASTED_TO_STOP
    assert not bank_policy.sizes_do_not_repeat(BankCounters(judged=enough, wasted=enough - 1))
    assert bank_policy.sizes_do_not_repeat(BankCounters(judged=2 * enough, wasted=enough))
    assert not bank_policy.sizes_do_not_repeat(BankCounters(judged=2 * enough + 1, wasted=enough))


def test_a_storm_is_re_captures_in_a_row_without_a_replay_between():
    streak = 0
    for _ in range(bank_policy.STORM_STREAK):
        assert not bank_policy.storm(streak)
        streak = bank_policy.recapture_streak(streak, replays=1)  # only the capture's own replay
    assert bank_policy.storm(streak)
    # one replay in between and the count starts over: an occasional re-allocation is no storm
    assert bank_policy.recapture_streak(streak, replays=2) == 1


def test_counters_report_the_hit_rate():
    row = BankCounters(calls=10, replays=8, misses=2).as_dict()
    assert row["hit_rate"] == 0.8 and row["calls"] == row["replays"] + row["misses"]
    assert BankCounters().hit_rate() == 0.0
