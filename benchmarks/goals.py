"""How the CPU benchmarks judge a measured ratio against its goal: as printed (two decimals), so a row never
reads '1.10x <= 1.10x MISS'."""

from __future__ import annotations

__all__ = ["judged", "within"]


def within(ratio: float, goal: float) -> bool:
    return round(ratio, 2) <= goal


def judged(ratio: float, goal: float) -> str:
    return "PASS" if within(ratio, goal) else "MISS"
