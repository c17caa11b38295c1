"""The fixed-address check every replay runs (cgcompile._compat.AddressCheck): each implementation available here
(torch's own on CUDA builds, cgcompile's compiled helper, the Python fallback) answers exactly what comparing
`args[i].data_ptr()` one by one answers, moves included; and CI builds the compiled helper."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from cgcompile import _compat

IMPLS = _compat.ADDRESS_CHECK_IMPLS


class Marked(torch.Tensor):
    """A tensor subclass: its data pointer comes from its Python method, not the compiled reader."""


def _arguments():
    base = torch.randn(64)
    return [
        torch.nn.Parameter(torch.randn(4, 3)),
        torch.randn(5),  # a buffer
        base[8:16],  # a view at an offset: its data_ptr is not its storage's
        torch.randn(3).as_subclass(Marked),
        torch.nn.Parameter(torch.randn(2)),
        torch.empty(0),  # no memory
        base,
    ]


def _expected(args, indices, ptrs) -> bool:
    return len(args) > max(indices) and all(args[i].data_ptr() == p for i, p in zip(indices, ptrs))


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=60, deadline=None)
@given(chosen=st.lists(st.integers(0, 6), min_size=1, max_size=7, unique=True),
       moved=st.sets(st.integers(0, 6), max_size=3), as_tuple=st.booleans(), shorter=st.booleans())
def test_each_implementation_answers_what_data_ptr_comparisons_answer(impl, chosen, moved, as_tuple, shorter):
    args = _arguments()
    indices = sorted(chosen)
    check = _compat.AddressCheck(indices, [args[i].data_ptr() for i in indices], impl)
    assert check.matches(tuple(args) if as_tuple else args)
    for i in moved:  # the same objects, their memory elsewhere (as `p.data = ...` does to a parameter)
        if args[i].numel():
            args[i].data = args[i].data.clone()
    if shorter:
        args = args[:max(indices)]
    call = tuple(args) if as_tuple else args
    assert check.matches(call) == _expected(call, indices, check.ptrs)


@pytest.mark.parametrize("impl", IMPLS)
def test_an_argument_without_a_data_pointer_raises_its_own_error(impl):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1.0]), (2, 2))
    check = _compat.AddressCheck([0], [0], impl)
    with pytest.raises(RuntimeError, match="doesn't have storage"):
        check.matches([sparse])  # the compiled reader's C++ error is caught and the Python method's raised


def test_an_unavailable_implementation_is_refused_naming_the_available_ones():
    with pytest.raises(ValueError, match=r"'fortran' is not available here; available: \("):
        _compat.AddressCheck([0], [0], "fortran")


def test_ci_builds_the_compiled_helper():
    """`pip install -e .` compiles it where a C++ compiler exists; CI's machine has one, so a silently failed build
    (the extension is optional) would show here rather than as slower replays."""
    if not os.environ.get("CI"):
        pytest.skip("only required where CI runs: without a C++ compiler the Python fallback is used")
    assert "compiled" in IMPLS, IMPLS


def _torch_contract(tensors: list, data_ptrs: list, indices: list) -> bool:
    """torch._C._tensors_data_ptrs_at_indices_equal as CUDA builds define it (three lists, the pointers by
    argument position): only CUDA builds have it, so the CPU tests check cgcompile's side of the call with this."""
    assert type(tensors) is list and type(data_ptrs) is list and type(indices) is list
    return all(tensors[i].data_ptr() == data_ptrs[i] for i in indices)


@settings(max_examples=40, deadline=None)
@given(chosen=st.lists(st.integers(0, 6), min_size=1, max_size=7, unique=True), moved=st.sets(st.integers(0, 6)),
       as_tuple=st.booleans())
def test_the_torch_builds_check_is_called_with_its_contracts_lists(chosen, moved, as_tuple):
    args = _arguments()
    indices = sorted(chosen)
    ptrs = [args[i].data_ptr() for i in indices]
    check = _compat.by_position_check(_torch_contract, indices, ptrs)
    assert check(tuple(args) if as_tuple else args)
    for i in moved:
        if args[i].numel():
            args[i].data = args[i].data.clone()
    for call in (tuple(args) if as_tuple else args, args + [torch.randn(1)], args[:max(indices)]):
        assert check(call) == _expected(call, indices, ptrs)  # another argument count makes its own lists
