"""Graph-bank policy: which captured graphs a partition keeps, and when it stops capturing.

Pure decisions over plain numbers (no torch, no graphs), so the thresholds are tested on their own and the
runner (runtime/local/runner.py) only feeds counts in and acts on the answers. Why a policy at all: a partition whose
input sizes come from the data (rows selected by `nonzero` before a graph break) meets a new size on most calls;
capturing each fills the bank with graphs that are never replayed, each holding its static memory, so memory
grows with the number of sizes ever seen. And a partition whose parameters move on every call (FSDP2
re-allocating unsharded parameters) re-captures on every call, slower than eager.

Every decision waits for evidence: a graph is judged on its own reuse, on the clock of its own parameter set
(the calls of the partition with that layer's parameters: one compiled frame serves every layer of a model that
graph-breaks in its layers, and a steady loop calls each layer once a step), so no graph is judged before its
layer has come round again, however deep the model; and the clock is read per round of the loop's cycle (the
set's graphs, or the input sizes in rotation when more), so sizes that cycle come round before they are judged.
The rules (thresholds chosen by measurement, docs/graph-bank.md), in rounds of the graph's parameter set:
- judge: a graph not run again within `JUDGE_AFTER` of them after its capture is *wasted*: released;
- release: a graph not run in the last `RELEASE_WINDOW` of them is released;
- stop on sizes that do not repeat: once `WASTED_TO_STOP` graphs were wasted and they are at least half of those
  judged, or as many input sizes (graph-bank keys) were met by no parameter set (layer) again within
  `JUDGE_AFTER` calls per parameter set, at least half of the sizes so judged: the partition stops capturing new
  sizes; the graphs it has keep replaying;
- stop on a re-capture storm: a graph re-captured `STORM_STREAK` times in a row (static input moved) with no
  replay in between: the partition runs eagerly from then on;
- stop on a warmup that never ends: `WARMUP_BUDGET` x `cuda_graph_warmup_steps` parameter sets (at least
  `WARMUP_BUDGET`) came and went (their identity freed) before any graph of the partition was captured: its
  parameter set is known by a per-call object, so every call would start a new warmup; the partition runs
  eagerly from then on, with the reason in stats()["eager_fallbacks"] (never "planned capture" in silence).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

__all__ = ["JUDGE_AFTER", "RELEASE_WINDOW", "SIZES_KEPT_AFTER_STOP", "STORM_STREAK", "WASTED_TO_STOP", "BankCounters",
           "cycle", "is_judged", "is_stale", "mostly_wasted", "never_warm", "recapture_streak", "stop_message", "storm",
           "WARMUP_BUDGET"]

RELEASE_WINDOW = 16
JUDGE_AFTER = 4
WASTED_TO_STOP = 6
STORM_STREAK = 3
WARMUP_BUDGET = 4
SIZES_KEPT_AFTER_STOP = 64  # input sizes remembered after a stop, so `sizes` counts a size the layers share once


@dataclasses.dataclass
class BankCounters:
    """One partition's graph-bank accounting. calls = replays + misses (forward and inference calls; a backward
    follows its forward instance). replays: calls a graph captured at an earlier call served (steady replays:
    what pays for capture); a miss replayed nothing captured earlier: a warmup call, a capture (whose own run
    replays the new graph), or an eager run (bank full, stopped); warmup_calls: the eager calls before each
    parameter set's first capture. captures and recaptures count
    forward/inference graphs (each with its backward), releases the graphs the policy released; judged/wasted:
    graphs old enough to judge, and those never run again; sizes / one_off_sizes: input signatures seen, and those
    judged seen once only."""

    calls: int = 0
    replays: int = 0
    warmup_calls: int = 0
    misses: int = 0
    captures: int = 0
    recaptures: int = 0
    releases: int = 0
    sizes: int = 0
    one_off_sizes: int = 0
    judged: int = 0
    wasted: int = 0
    copied_outputs: int = 0  # output positions handed out as copies (kept by callers beyond their step)
    stopped: Optional[str] = None  # why the partition stopped capturing (new sizes, or at all)

    def hit_rate(self) -> float:
        return self.replays / self.calls if self.calls else 0.0

    def reuse(self) -> float:
        """Replays per call after warmup: the share of those calls a graph captured at an earlier call served."""
        after = self.calls - self.warmup_calls
        return self.replays / after if after > 0 else 0.0

    def as_dict(self) -> Dict[str, Any]:
        row = dataclasses.asdict(self)
        row["hit_rate"] = round(self.hit_rate(), 3)
        row["reuse"] = round(self.reuse(), 3)
        return row


def is_stale(last_use: int, now: int, graphs: int, window: int = RELEASE_WINDOW) -> bool:
    """Was a graph last run (captured or replayed) more than `window` calls of its parameter set per graph of
    that set ago? Several graphs of one parameter set (sizes, grad and no-grad) share its calls: the window
    stretches with their number."""
    return now - last_use > window * max(1, graphs)


def is_judged(captured_at: int, now: int, graphs: int, judge_after: int = JUDGE_AFTER) -> bool:
    """Is a graph old enough (`judge_after` calls of its parameter set per graph of that set since its capture)
    to tell whether its size repeats? A graph whose size repeats is run again within a few steps."""
    return now - captured_at > judge_after * max(1, graphs)


def mostly_wasted(wasted: int, judged: int, wasted_to_stop: int = WASTED_TO_STOP) -> bool:
    """Have enough of the judged captures (or sizes) gone unused again to stop capturing new sizes?"""
    return wasted >= wasted_to_stop and 2 * wasted >= judged


def recapture_streak(previous_streak: int, replays: int) -> int:
    """The re-capture streak of a graph replacing a stale one: one more than the old graph's when the old graph
    was never replayed after its capture (`replays` counts the capture's own replay), else a fresh 1."""
    return previous_streak + 1 if replays <= 1 else 1


def storm(streak: int, storm_streak: int = STORM_STREAK) -> bool:
    """Is this re-capture part of a storm (the graph re-captured on every use)?"""
    return streak >= storm_streak


def never_warm(sets_gone: int, warmup_steps: int, budget: int = WARMUP_BUDGET) -> bool:
    """Have enough parameter sets come and gone without a capture to say the partition's warmup never ends?"""
    return sets_gone >= budget * max(1, warmup_steps)


def cycle(graphs: int, sizes: int) -> int:
    """How many calls of a parameter set a steady loop takes to come round to each of its graphs: its graphs
    (sizes, grad and no-grad, instances), or the input sizes in rotation when more (each size seen)."""
    return max(1, graphs, sizes)


def stop_message(reason: str, growth: Optional[Tuple[str, str]] = None) -> str:
    """What a partition that stops capturing new sizes says (logged once, in stats()["bank_stops"]), with the fix:
    `growth` (size_trend.Growth: what changed, and its kind: a tensor's size, an integer, a float's value) when a
    size grew by a fixed amount at every new size, a sequence whose sizes never come back, or a float argument took
    a new value at every call; else sizes from the data."""
    text, kind = growth if growth is not None else (None, None)
    if kind == "float":
        return (f"{reason}: its inputs do not repeat: {text}; a CUDA graph keeps the value it captured, so each "
                f"value is a graph of its own. New values run eagerly, the graphs it has keep replaying. "
                f"{_FLOAT_FIX_HINT}")
    if kind is not None:
        example = ("a decode step's start position, or a step counter" if kind == "integer" else
                   "a KV cache concatenated at each decode step, or a growing batch")
        return (f"{reason}: its input sizes do not repeat: {text}, a sequence growing at every step (e.g. {example}); "
                f"new sizes run eagerly, the graphs it has keep replaying. "
                f"{_INTEGER_GROWTH_FIX_HINT if kind == 'integer' else _GROWTH_FIX_HINT}")
    return (f"{reason}: its input sizes do not repeat (e.g. rows selected by nonzero before a graph break); new sizes "
            f"run eagerly, the graphs it has keep replaying. {_FIX_HINT}")


_FIX_HINT = ("Fix: dynamic_padding='buckets' (or 'max') with torch._dynamo.config.capture_dynamic_output_shape_ops="
             "True when the sizes come from nonzero or a boolean mask, or capture_sizes=[...] when they are a batch "
             "dimension.")
_GROWTH_FIX_HINT = ("Fix: a cache of fixed size written in place at each step's positions, so every step has the same "
                    "sizes (transformers: generate(..., cache_implementation=\"static\")), or capture_sizes=[...] when "
                    "it is a batch dimension.")
_INTEGER_GROWTH_FIX_HINT = ("Fix: pass it as a tensor on the model's device; for a decode position, as transformers' "
                            "cache_position, reading the whole fixed-size cache with a mask of the positions written "
                            "so far, so no size depends on its value (a slice such as cache[:, :start_pos + n] has a "
                            "new length at every step).")
_FLOAT_FIX_HINT = ("Fix: pass it as a tensor on the model's device (torch.tensor(value, device=...)): it is copied "
                   "into the graph at every call, one graph for every value.")
