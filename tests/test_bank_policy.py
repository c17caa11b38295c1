"""The graph-bank policy's decisions on plain counters (cgcompile/runtime/bank/policy.py) and what its stop message
reads from the bank keys (size_trend.py); the runtime that feeds them is tested end to end in test_graph_bank.py."""

from __future__ import annotations

import torch

from cgcompile.runtime.bank import policy as bank_policy
from cgcompile.runtime.bank.key import BankKey
from cgcompile.runtime.bank.policy import BankCounters
from cgcompile.runtime.bank.size_trend import MIN_STEPS, changing_float, growing_size


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


def _keys(calls):
    """The real bank keys of calls (argument 0 a parameter, left out of the key as the runtime leaves it)."""
    keys = BankKey(frozenset({0}), static_shapes=False)
    keys.learn(calls[0])
    return keys.dynamic, [keys.of(args) for args in calls]


NAMES = ["argument `w`", "argument `x`", "argument `cache`", "argument `length`", "argument `mask`"]


def test_a_size_grown_by_the_same_amount_at_every_new_size_is_named_after_a_prefill():
    w = torch.nn.Parameter(torch.zeros(8, 8))
    prefill = [(w, torch.zeros(2, 6, 8), torch.zeros(2, 0, 16), 0, torch.zeros(2, 6))]
    decode = [(w, torch.zeros(2, 1, 8), torch.zeros(2, t, 16), t, torch.zeros(2, t + 1)) for t in range(6, 14)]
    positions, keys = _keys(prefill + decode)
    assert growing_size(keys, positions, NAMES).text == (
        "argument `cache` dim 1 grew by 1 at each new size (6, 7, 8, ..., 12, 13), and 1 other input with it")
    assert growing_size(keys[:MIN_STEPS], positions, NAMES) is None  # the prefill and too few decode steps
    assert growing_size(keys[:MIN_STEPS + 1], positions, NAMES) is not None


def test_sizes_the_data_picks_or_that_differ_otherwise_are_no_growth():
    w = torch.nn.Parameter(torch.zeros(8, 8))
    picked = [(w, torch.zeros(rows, 8)) for rows in (9, 5, 12, 4, 10, 7)]  # rows selected by nonzero, say
    assert growing_size(*_keys(picked)[::-1], NAMES) is None
    by_two = [(w, torch.zeros(rows, 8)) for rows in (4, 6, 8, 10)]
    assert growing_size(*_keys(by_two)[::-1], NAMES) == (
        "argument `x` dim 0 grew by 2 at each new size (4, 6, 8, 10)", "tensor")
    shrinking = [(w, torch.zeros(rows, 8)) for rows in (10, 8, 6, 4)]
    assert growing_size(*_keys(shrinking)[::-1], NAMES) is None
    dtypes = [(w, torch.zeros(rows, 8, dtype=torch.float16 if rows % 2 else torch.float32)) for rows in (4, 5, 6, 7)]
    assert growing_size(*_keys(dtypes)[::-1], NAMES) is None
    both = [(w, torch.zeros(4, 8)), (w, torch.zeros(5, 8)), (w, torch.zeros(6, 9)), (w, torch.zeros(7, 8))]
    assert growing_size(*_keys(both)[::-1], NAMES) is None  # one dimension grew, another came and went
    positions, keys = _keys([(w, torch.zeros(rows, 8)) for rows in (4, 5, 6, 7)])
    with torch.no_grad():
        modes = BankKey(frozenset({0}), static_shapes=False)
        modes.learn((w, torch.zeros(4, 8)))
        keys[2] = modes.of((w, torch.zeros(6, 8)))  # a no_grad call among grad ones
    assert growing_size(keys, positions, NAMES) is None


def test_a_float_argument_with_a_new_value_at_every_call_is_named():
    w = torch.nn.Parameter(torch.zeros(8, 8))
    x = torch.zeros(2, 8)
    temperatures = [(w, x, 1.0 + step / 10) for step in range(8)]
    positions, keys = _keys(temperatures)
    assert changing_float(keys, positions, NAMES) == (
        "argument `cache`, a Python float, took a new value at each call (1.2, 1.3, 1.4, 1.5, 1.6, 1.7)", "float")
    assert growing_size(keys, positions, NAMES) is None  # no size grew
    assert changing_float(keys[:MIN_STEPS - 1], positions, NAMES) is None
    cycling = [(w, x, 1.0 + step % 2) for step in range(8)]  # values that come back are not new at every call
    assert changing_float(*_keys(cycling)[::-1], NAMES) is None
    grown = [(w, torch.zeros(2 + step, 8), 1.0 + step) for step in range(8)]  # a tensor changed too
    assert changing_float(*_keys(grown)[::-1], NAMES) is None
