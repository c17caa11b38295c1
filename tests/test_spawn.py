"""The worker launcher of the distributed tests (tests/spawn.py): workers a signal ended are started once more,
as are workers whose port another test took; the first attempt reported as a warning; a worker failing with a
Python error fails the test at once. `serve`, the worker frame: the work's result comes back through the group's
collectives and `run_ranks`, and work that raises fails the run with its traceback."""

import textwrap

import pytest

from tests.spawn import run_ranks

SERVED = textwrap.dedent('''
    import os, sys
    sys.path.insert(0, os.environ["PYTHONPATH"])
    import torch
    import torch.distributed as dist
    from tests.spawn import serve

    def work(rank, world):
        if "{mode}" == "raise" and rank == 1:
            raise ValueError("the work failed on rank 1")
        total = torch.tensor([rank + 1.0])
        dist.all_reduce(total)  # on rank 0 with "raise": blocked until its peer's group is gone (or killed)
        return {{"rank": rank, "world": world, "sum": total.item()}}

    serve(work, 60)
''')

WORKER = textwrap.dedent('''
    import os, sys
    sys.path.insert(0, os.environ["PYTHONPATH"])
    from tests.spawn import write_result
    rank, out = int(sys.argv[1]), sys.argv[4]
    marker = os.path.join(out, "attempted")
    if rank == 0 and not os.path.exists(marker):
        open(marker, "w").close()
        if "{mode}" == "abort":
            os.abort()  # as gloo's threads end a process: SIGABRT
        if "{mode}" == "port":  # what gloo's TCPStore raises when another test's workers took the port first
            raise RuntimeError("The server socket has failed to listen on any local network address. port: 29500, "
                               "code: -98, name: EADDRINUSE, message: Address already in use")
        raise RuntimeError("a real failure")
    write_result(out, rank, {{"rank": rank}})
''')


def _script(tmp_path, mode):
    path = tmp_path / f"worker_{mode}.py"
    path.write_text(WORKER.format(mode=mode))
    return str(path)


def test_workers_a_signal_ended_run_once_more_with_the_first_output_kept(tmp_path):
    with pytest.warns(UserWarning, match=r"ended by a signal or lost their port; started once more(.|\n)*"
                                         r"rank 0 \(exit -6, result absent\)"):
        results = run_ranks(_script(tmp_path, "abort"), tmp_path, 2, 60, "test")
    assert [r["rank"] for r in results] == [0, 1]


def test_workers_whose_port_was_taken_run_once_more(tmp_path):
    """free_port() releases the port it found; with two test processes (pytest-xdist) another test's workers may
    bind it first: that attempt is started again on a new port, not reported as the test's failure."""
    with pytest.warns(UserWarning, match=r"lost their port; started once more(.|\n)*Address already in use"):
        results = run_ranks(_script(tmp_path, "port"), tmp_path, 2, 60, "test")
    assert [r["rank"] for r in results] == [0, 1]


def test_a_worker_failing_with_a_python_error_fails_at_once(tmp_path):
    with pytest.raises(pytest.fail.Exception, match=r"test workers failed:(.|\n)*RuntimeError: a real failure"):
        run_ranks(_script(tmp_path, "error"), tmp_path, 2, 60, "test")


def test_serve_runs_the_work_in_the_group_and_writes_what_it_returns(tmp_path):
    path = tmp_path / "served.py"
    path.write_text(SERVED.format(mode="return"))
    assert run_ranks(str(path), tmp_path, 2, 60, "test") == [{"rank": 0, "world": 2, "sum": 3.0},
                                                             {"rank": 1, "world": 2, "sum": 3.0}]


def test_serve_fails_the_run_with_the_work_s_error_printed_once(tmp_path):
    """Work that raises on one rank: its traceback, printed before the group's teardown, fails the run at once
    (not at the deadline), and no result is written for that rank. Its exit code is 1, or the runner's kill when
    its peer's failure (the connection its raise closed) was seen first."""
    path = tmp_path / "served.py"
    path.write_text(SERVED.format(mode="raise"))
    with pytest.raises(pytest.fail.Exception, match=r"test workers failed:(.|\n)*rank 1 \(exit (1|-9), result absent\)"
                                                    r"(.|\n)*ValueError: the work failed on rank 1") as failure:
        run_ranks(str(path), tmp_path, 2, 60, "test")
    assert str(failure.value).count("ValueError: the work failed on rank 1") == 1
