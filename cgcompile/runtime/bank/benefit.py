"""Does a partition's graph pay? The measured-benefit rule and the memory budget's choice, as pure decisions.

A replay saves the host's launch work but still copies the partition's inputs into its static buffers and holds
graph memory, so a partition of one large GEMM can be slower captured than eager. `BenefitMeter` keeps one
partition's times (eager warmup calls and the first replays after capture, per graph kind, timed by the driver's
timer, runtime/drivers/timing.py) and says whether its replay pays: a call's time is the sum over the kinds one
call runs (forward and backward, or inference), each kind's fastest sample (the first eager call pays lazy
initialization, a timed replay the timer's own wait). `make_room` chooses which graphs a capture under a memory
budget releases. No torch here: numbers in, decisions out (runtime/local/benefit.py times, runtime/local/budget.py
acts).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["BENEFIT_MARGIN", "REPLAY_SAMPLES", "BenefitMeter", "make_room", "pays"]

BENEFIT_MARGIN = 0.05  # a replay must be this much faster than the eager call, or the partition runs eagerly
REPLAY_SAMPLES = 3  # replays timed after a capture, per kind; later replays are never timed
_GROUPS = (("forward", "backward"), ("inference",))  # the kinds one call runs: a training call, an inference call


def pays(eager_s: float, replay_s: float, margin: float = BENEFIT_MARGIN) -> bool:
    """Is a replay faster than the eager call by the margin?"""
    return replay_s <= eager_s * (1.0 - margin)


class BenefitMeter:
    """One partition's measured times and verdict (`profitable`: None until measured). `open` while it still
    wants samples: only then are calls timed, and the steady replay path waits for the verdict."""

    def __init__(self, enabled: bool):
        self.open = enabled
        self.eager: Dict[str, List[float]] = {}
        self.replay: Dict[str, List[float]] = {}
        self.eager_bytes: Dict[str, int] = {}  # per kind: what an eager call's inputs and outputs take (budget)
        self.profitable: Optional[bool] = None
        self.times: Optional[Tuple[float, float]] = None  # (eager, replay) seconds per call, once measured

    def eager_sample(self, kind: str, seconds: float, nbytes: int) -> None:
        self.eager.setdefault(kind, []).append(seconds)
        self.eager_bytes[kind] = max(self.eager_bytes.get(kind, 0), nbytes)

    def wants_replay(self, kind: str) -> bool:
        return self.open and kind in self.eager and len(self.replay.get(kind, ())) < REPLAY_SAMPLES

    def replay_sample(self, kind: str, seconds: float) -> None:
        self.replay.setdefault(kind, []).append(seconds)

    def ready(self) -> Optional[Tuple[str, ...]]:
        """The kinds of the first call group (training, inference) measured in full, if any."""
        for group in _GROUPS:
            kinds = tuple(k for k in group if k in self.eager)
            if self.open and kinds and all(len(self.replay.get(k, ())) >= REPLAY_SAMPLES for k in kinds):
                return kinds
        return None

    def decide(self, kinds: Sequence[str]) -> bool:
        """The verdict from these kinds' samples; timing ends."""
        self.open = False
        self.times = (sum(min(self.eager[k]) for k in kinds), sum(min(self.replay[k]) for k in kinds))
        self.profitable = pays(*self.times)
        return self.profitable

    def eager_estimate(self) -> float:
        """Seconds one call takes eagerly: the measured time, else the fastest eager samples (0 when unmeasured)."""
        if self.times is not None:
            return self.times[0]
        group = next((g for g in _GROUPS if any(k in self.eager for k in g)), ())
        return sum(min(self.eager[k]) for k in group if k in self.eager)

    def saving(self) -> Optional[float]:
        """Seconds a replay saves per call (negative: it costs), once measured."""
        return None if self.times is None else self.times[0] - self.times[1]

    def bytes_needed(self, kind: str) -> int:
        """Bytes a new graph of `kind` is expected to hold (its backward's included), from the eager calls."""
        kinds = ("forward", "backward") if kind == "forward" else (kind,)
        return sum(self.eager_bytes.get(k, 0) for k in kinds)

    def as_dict(self, calls_per_step: int) -> Dict[str, Any]:
        """stats()["partitions"] and the report: times in ms per call, and the saving per step."""
        if self.times is None:
            return {"eager_ms": None, "replay_ms": None, "saving_ms": None, "saving_per_step_ms": None,
                    "profitable": None}
        eager, replay = self.times
        return {"eager_ms": round(eager * 1e3, 4), "replay_ms": round(replay * 1e3, 4),
                "saving_ms": round((eager - replay) * 1e3, 4),
                "saving_per_step_ms": round((eager - replay) * 1e3 * calls_per_step, 4), "profitable": self.profitable}


def make_room(need: int, held: int, limit: int, candidates: Sequence[Tuple[Any, int]]) -> Optional[List[Any]]:
    """The candidates to release, in the order given (least worth first), so `need` more bytes fit under `limit`;
    [] when they fit already, None when releasing every candidate would not make room (nothing is released)."""
    chosen: List[Any] = []
    for candidate, nbytes in candidates:
        if held + need <= limit:
            break
        chosen.append(candidate)
        held -= nbytes
    return chosen if held + need <= limit else None
