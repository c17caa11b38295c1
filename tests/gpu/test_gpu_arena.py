"""Output arenas with real CUDA graphs: sizes of one partition share their outputs' memory and pool, graphs in
flight together get separate arenas, outputs the caller keeps survive another size; skipped without CUDA.

The same checks as tests/test_arena.py on the emulate driver; here what only CUDA can show: the in-graph copy
into arena views captures and replays on a stream, and members capturing into one pool do not corrupt each other.
"""

import pytest
import torch

from tests.test_arena import (check_graphs_in_flight_get_separate_arenas, check_kept_outputs_survive_another_size,
                              check_sizes_share_one_arena)

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_sizes_share_one_arena_and_train_like_eager():
    check_sizes_share_one_arena(device="cuda", driver="cuda")


def test_cuda_graphs_in_flight_together_get_separate_arenas():
    check_graphs_in_flight_get_separate_arenas(device="cuda", driver="cuda")


def test_cuda_outputs_kept_by_the_caller_survive_another_size():
    check_kept_outputs_survive_another_size(device="cuda", driver="cuda")
