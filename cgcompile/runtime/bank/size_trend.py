"""Which input size grows from one new input size to the next, for the message of a partition that stops
capturing new sizes (policy.stop_message).

Sizes that never repeat have two common causes with different fixes. Rows picked by the data (`nonzero`, a boolean
mask before a graph break) come in any order: padding them to fixed sizes fixes that (dynamic_padding). A sequence
that grows by the same amount at every step (a KV cache concatenated at each decode step, as transformers'
default DynamicCache does, or tokens appended to the input) grows without end: only a cache of fixed size written
in place (a static cache) makes the steps repeat. The bank keys, in the order their sizes first came, tell the
two apart. Pure: it reads keys, positions and names only.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .key import MODE_FIELDS

__all__ = ["MIN_STEPS", "Growth", "changing_float", "growing_size", "what_changed"]

MIN_STEPS = 3  # sizes in a row, each grown by the same amount from the one before, before a growth is named


class Growth(NamedTuple):
    """What changed at every new size: `text` names it for the log; `kind` says what and so which fix applies:
    "tensor" (a tensor's dimension grew: a concatenated cache), "integer" (only an integer the code reads grew: a
    start position passed as a Python int that slices a fixed cache, which is static already), "float" (a
    Python float argument took a new value at every call: a temperature or a mixup weight, baked into a graph)."""

    text: str
    kind: str


def _sizes(argument: Any) -> Optional[Tuple[Tuple[int, ...], bool]]:
    """The sizes one argument's part of a bank key holds, and whether it is a tensor's shape (else an integer's
    value: a size Dynamo passes as a symbol); None for anything else."""
    if isinstance(argument, tuple) and argument and isinstance(argument[0], torch.Size):
        return tuple(argument[0]), True
    if isinstance(argument, tuple) and len(argument) == 2 and argument[0] is int:
        return (argument[1],), False
    return None


def _changes(keys: Sequence[tuple], positions: Sequence[int]) -> Optional[Dict[Tuple[int, int, bool], List[int]]]:
    """Per (argument position, dimension, is a tensor) whose size differs between the keys, its sizes in key order;
    None when the keys differ otherwise (modes, a value that is no size, a tensor's rank or dtype)."""
    if any(key[:MODE_FIELDS] != keys[0][:MODE_FIELDS] or len(key) != MODE_FIELDS + len(positions) for key in keys):
        return None
    found: Dict[Tuple[int, int, bool], List[int]] = {}
    for slot, position in enumerate(positions):
        parts = [key[MODE_FIELDS + slot] for key in keys]
        sized = [_sizes(part) for part in parts]
        first = sized[0]
        if first is None or any(s is None or len(s[0]) != len(first[0]) or s[1] != first[1] for s in sized):
            if any(part != parts[0] for part in parts):
                return None
            continue
        if first[1] and any(part[2:] != parts[0][2:] for part in parts):  # dtype, device, requires_grad
            return None
        for dim in range(len(first[0])):
            values = [s[0][dim] for s in sized]  # type: ignore[index]
            if len(set(values)) > 1:
                found[(position, dim, first[1])] = values
    return found


def _shown(values: Sequence[Any]) -> str:
    """Values as a log lists them: all of up to six, else the first three and the last two."""
    shown = list(values) if len(values) <= 6 else [*values[:3], "...", *values[-2:]]
    return ", ".join(map(str, shown))


def _name(names: Sequence[str], position: int) -> str:
    return names[position] if position < len(names) else f"argument {position}"


def _step(values: List[int]) -> Optional[int]:
    """The amount the values grow by when it is the same positive amount each time, else None."""
    steps = {b - a for a, b in itertools.pairwise(values)}
    return steps.pop() if len(steps) == 1 and min(steps) > 0 else None


def growing_size(keys: Sequence[tuple], positions: Sequence[int], names: Sequence[str]) -> Optional[Growth]:
    """Bank keys in the order their sizes first came (`positions`: the argument positions a key reads after its
    modes, BankKey.dynamic; `names`: per partition input, how logs name it). When the latest MIN_STEPS or more of
    them differ only in sizes, each grown by a fixed amount from one key to the next (earlier keys, a prefill's
    say, may differ otherwise), what grew: "argument `x` dim 2 grew by 1 at each new size (7, 8, 9)", or "argument
    `start_pos`, an integer, grew by 1 at each new value (7, 8, 9)" when no tensor did; else None."""
    for start in range(len(keys) - MIN_STEPS + 1):
        changes = _changes(keys[start:], positions)
        steps = {where: _step(values) for where, values in (changes or {}).items()}
        if not steps or None in steps.values():
            continue
        # a tensor's dimension names the growth better than the integer size Dynamo passes beside it
        best = max(changes, key=lambda where: where[2])
        (position, dim, _), values = best, changes[best]
        name, sizes = _name(names, position), _shown(values)
        others = len({where[0] for where in changes if where[2]} - {position})  # tensors; a size symbol is no news
        also = f", and {others} other input{'s' if others > 1 else ''} with it" if others else ""
        if not best[2]:
            return Growth(f"{name}, an integer, grew by {steps[best]} at each new value ({sizes})", "integer")
        return Growth(f"{name} dim {dim} grew by {steps[best]} at each new size ({sizes}){also}", "tensor")
    return None


def changing_float(keys: Sequence[tuple], positions: Sequence[int], names: Sequence[str]) -> Optional[Growth]:
    """When the latest MIN_STEPS or more bank keys (in the order they first came) differ only in the values of
    Python float arguments, each value new: those arguments ("argument `temp`, a Python float, took a new value at
    each call (1.1, 1.2, 1.3)"); else None."""
    recent = list(keys[-(MIN_STEPS + 3):])
    if len(recent) < MIN_STEPS or any(key[:MODE_FIELDS] != recent[0][:MODE_FIELDS]
                                      or len(key) != MODE_FIELDS + len(positions) for key in recent):
        return None
    changed = [slot for slot in range(len(positions)) if len({key[MODE_FIELDS + slot] for key in recent}) > 1]
    parts = [[key[MODE_FIELDS + slot] for key in recent] for slot in changed]
    if not changed or not all(isinstance(p, tuple) and len(p) == 2 and p[0] is float for ps in parts for p in ps):
        return None
    if any(len({p[1] for p in ps}) < len(ps) for ps in parts):  # a value came back: not a new value at each call
        return None
    values = _shown([f"{p[1]:g}" for p in parts[0]])
    others = len(changed) - 1
    also = f", and {others} other float argument{'s' if others > 1 else ''} with it" if others else ""
    return Growth(f"{_name(names, positions[changed[0]])}, a Python float, took a new value at each call ({values})"
                  f"{also}", "float")


def what_changed(keys: Sequence[tuple], positions: Sequence[int], names: Sequence[str]) -> Optional[Growth]:
    """A size grown at every new size (growing_size), else a float argument new at every call (changing_float)."""
    return growing_size(keys, positions, names) or changing_float(keys, positions, names)
