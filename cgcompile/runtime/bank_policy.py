"""Graph-bank policy: which captured graphs a partition keeps, and when it stops capturing.

Pure decisions over plain numbers (no torch, no graphs), so the thresholds are tested on their own and the
runner (partition_runner.py) only feeds counts in and acts on the answers. Why a policy at all: a partition whose
input sizes come from the data (rows selected by `nonzero` before a graph break) meets a new size on most calls;
capturing each fills the bank with graphs that are never replayed, each holding its static memory, so memory
grows with the number of sizes ever seen. And a partition whose parameters move on every call (FSDP2
re-allocating unsharded parameters) re-captures on every call, slower than eager.

The rules (thresholds chosen by measurement, docs/graph-bank.md). The clock is the partition's own calls,
counted per live graph of the partition (a steady loop calls each graph it uses about once a step):
- judge: a graph not replayed within `JUDGE_AFTER` calls per live graph of its capture is *wasted*: released;
- release: a graph not replayed in the last `RELEASE_WINDOW` calls per live graph is released;
- stop on sizes that do not repeat: more distinct sizes than the bank may hold, on at least half of the calls
  (`new_sizes_keep_coming`), or `WASTED_TO_STOP` wasted graphs that are at least half of those judged
  (`sizes_do_not_repeat`): the partition stops capturing new sizes; the graphs it has keep replaying;
- stop on a re-capture storm: a graph re-captured `STORM_STREAK` times in a row (static input moved) with no
  replay in between: the partition runs eagerly from then on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

__all__ = ["JUDGE_AFTER", "RELEASE_WINDOW", "STORM_STREAK", "WASTED_TO_STOP", "BankCounters", "is_judged",
           "is_stale", "new_sizes_keep_coming", "recapture_streak", "sizes_do_not_repeat", "storm"]

RELEASE_WINDOW = 16
JUDGE_AFTER = 4
WASTED_TO_STOP = 6
STORM_STREAK = 3


@dataclasses.dataclass
class BankCounters:
    """One partition's graph-bank accounting. calls = replays + misses (forward and inference calls; a backward
    follows its forward instance); a miss replayed nothing: a warmup call, a capture, or an eager run (bank full,
    stopped). captures and recaptures count forward/inference graphs (each with its backward), releases the
    graphs the policy released; judged/wasted: graphs old enough to judge, and those never replayed."""

    calls: int = 0
    replays: int = 0
    misses: int = 0
    captures: int = 0
    recaptures: int = 0
    releases: int = 0
    sizes: int = 0  # distinct input signatures seen (graph-bank keys)
    judged: int = 0
    wasted: int = 0
    stopped: Optional[str] = None  # why the partition stopped capturing (new sizes, or at all)

    def hit_rate(self) -> float:
        return self.replays / self.calls if self.calls else 0.0

    def as_dict(self) -> Dict[str, Any]:
        row = dataclasses.asdict(self)
        row["hit_rate"] = round(self.hit_rate(), 3)
        return row


def is_stale(last_use: int, now: int, graphs: int, window: int = RELEASE_WINDOW) -> bool:
    """Was a graph last used (captured or replayed) more than `window` calls per live graph of its partition ago?

    `now` and `last_use` count the partition's calls. A steady loop calls each graph it uses about once a step,
    and one partition may hold several (every layer, when one compiled frame serves them all; several shapes;
    grad and no-grad), so the window scales with their number and reads as steps."""
    return now - last_use > window * max(1, graphs)


def is_judged(captured_at: int, now: int, graphs: int, judge_after: int = JUDGE_AFTER) -> bool:
    """Is a graph old enough (`judge_after` calls per live graph since its capture, see is_stale) to tell
    whether its size repeats? A graph whose size repeats is replayed within a few steps."""
    return now - captured_at > judge_after * max(1, graphs)


def new_sizes_keep_coming(sizes: int, calls: int, cap: int) -> bool:
    """Does at least every other call bring a size never seen before, more sizes than the bank may hold per
    parameter set (`cap`)? Then most sizes never get a graph (each warms up first), whatever is captured."""
    return sizes > cap and 2 * sizes >= calls


def sizes_do_not_repeat(counters: BankCounters, wasted_to_stop: int = WASTED_TO_STOP) -> bool:
    """Have enough of this partition's judged captures gone unreplayed to stop capturing new sizes?"""
    return counters.wasted >= wasted_to_stop and 2 * counters.wasted >= counters.judged


def recapture_streak(previous_streak: int, replays: int) -> int:
    """The re-capture streak of a graph replacing a stale one: one more than the old graph's when the old graph
    was never replayed after its capture (`replays` counts the capture's own replay), else a fresh 1."""
    return previous_streak + 1 if replays <= 1 else 1


def storm(streak: int, storm_streak: int = STORM_STREAK) -> bool:
    """Is this re-capture part of a storm (the graph re-captured on every use)?"""
    return streak >= storm_streak
