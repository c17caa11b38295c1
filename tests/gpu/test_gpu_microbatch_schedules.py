"""tests/test_microbatch_schedules.py with real CUDA graphs (driver "cuda"), where the memory pool the graphs
share is CUDA's own; skipped without a CUDA device. Every schedule trains like eager and replays every graph at
every late step."""

import pytest
import torch

from cgcompile import reset_stats, stats
from tests.test_microbatch_schedules import SCHEDULES, replays_per_step, run_schedule

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_graph_replays_at_every_step_of_a_pipeline_schedule_on_cuda(schedule):
    reset_stats()
    steady = run_schedule(schedule, "cuda", driver="cuda", measure_benefit="off")
    assert [b - a for a, b in zip(steady[-4:], steady[-3:])] == [replays_per_step(schedule)] * 3, steady
    assert stats()["eager_fallbacks"] == []
