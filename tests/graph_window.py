"""The long-run rule of issue 40, "no graph held that is not used", as the tests check it: after a run of steps,
every graph still alive was replayed within the bank policy's release window (the last RELEASE_WINDOW steps).

`replays_by_graph()` is read once per step (a mark); `unused_graphs(marks)` names the live graphs that broke the
rule. Used in-process (tests/test_graph_economy.py) and in spawned ranks (tests/test_graph_economy_distributed.py).
"""

from __future__ import annotations

import gc
from typing import Dict, List


def fresh() -> None:
    """Before a workload: graphs of earlier runs collected (reference cycles) and released, counters reset, so
    stats()['graphs'] holds this workload's graphs only."""
    import torch

    import cgcompile

    torch._dynamo.reset()
    gc.collect()
    cgcompile.release()
    cgcompile.reset_stats()


def replays_by_graph() -> Dict[str, int]:
    """Replays of every live graph, by label: one mark, read at the end of a step."""
    import cgcompile

    return {g["label"]: g["replays"] for g in cgcompile.stats()["graphs"]}


def unused_graphs(marks: List[Dict[str, int]]) -> List[str]:
    """Labels of the graphs alive at the last mark that did not replay within the last RELEASE_WINDOW marks."""
    from cgcompile.runtime.bank.policy import RELEASE_WINDOW

    assert len(marks) > RELEASE_WINDOW, "a run shorter than the window says nothing"
    then, now = marks[-1 - RELEASE_WINDOW], marks[-1]
    return sorted(label for label, replays in now.items() if replays <= then.get(label, 0))
