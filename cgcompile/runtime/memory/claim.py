"""Who still holds a captured graph's memory: the one answer a graph (runtime/local/instance.py) and an output arena (arena.py) share.

A graph owns storages: its static outputs and the input buffers it copies into (an arena owns its blocks). The
runtime keeps references of its own to them: the static tensors, and the static inputs of graphs that borrow
them. Anything else referencing them makes the memory *held*, and a replay would overwrite what it reads: an alias
the last replay handed out (alive while the caller, autograd's saved tensors or an eager island's autograd context
keeps it), a view of one, stolen gradients. Both are seen: a weak reference per alias handed out, and each
storage's use count against its *idle* count (the runtime's own references, settled after capture and raised by
each borrower).

Once found free, memory stays free until the next replay hands out new aliases: nothing else creates references
to it (a borrower replaying on it needs a live alias first). So `held()` caches a free answer until then, which
keeps the pool rule's checks (runtime/local/model_runtime.py) cheap.
"""

from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Set

from ... import _compat

__all__ = ["MemoryClaim"]


class MemoryClaim:
    """Storages owned (ptr -> [storage handle, idle use count]) and the aliases the last replay handed out."""

    def __init__(self) -> None:
        self.storages: Dict[int, List[int]] = {}
        self._watched: List[List[int]] = []  # the entries of storages others can reach (see own)
        self._handed: List[Optional[weakref.ref]] = []
        self._free = True  # nothing handed out since found free (or since capture)

    def own(self, ptr: int, handle: int, reachable: bool = True) -> None:
        """Claim the storage at ptr; its idle use count is taken by settle(). A storage no output lives in (a
        graph's input buffer that no output aliases) can be referenced by nobody outside, so held() skips it."""
        entry = self.storages[ptr] = [handle, 0]
        if reachable:
            self._watched.append(entry)

    def settle(self) -> None:
        """Now, with nothing handed out, the use counts are the runtime's own references: the idle baseline."""
        for entry in self.storages.values():
            entry[1] += _compat.storage_use_count(entry[0])

    def use_counts(self) -> Dict[int, int]:
        return {ptr: _compat.storage_use_count(handle) for ptr, (handle, _) in self.storages.items()}

    def keep(self, ptr: int, references: int) -> None:
        """A borrower keeps `references` to the storage at ptr while idle (or, negative, gave them up)."""
        if ptr in self.storages:
            self.storages[ptr][1] += references

    def hand_out(self, aliases: Iterable[Optional[object]]) -> None:
        """A replay handed these aliases of the memory out, one per output position (None where it handed out
        something else): held until they die."""
        self._handed = [weakref.ref(a) if a is not None else None for a in aliases]
        self._free = False

    def replayed(self) -> None:
        """A replay wrote the memory and handed out no aliases to track by weak reference (inference and backward
        graphs, an arena member's copy): what it handed out holds the memory through the use counts alone."""
        self._free = False

    def handed_nothing(self) -> None:
        """The replay that took this memory handed nothing of it out (its outputs were copied out of it): free
        again, as after capture."""
        self._free = True

    def held(self) -> bool:
        """Does anything beyond the runtime reference this memory? A free answer is cached until the next replay."""
        if self._free:
            return False
        if self._referenced():
            return True
        self._free = True
        return False

    def take(self) -> bool:
        """For a replay about to run (the steady replay, runtime/local/runner.py): False when the memory is held; else
        True, and the memory counts as replayed from now on (if the replay then does not run, the next held() looks
        again)."""
        if not self._free and self._referenced():
            return False
        self._free = False
        return True

    def _referenced(self) -> bool:
        """An alias handed out alive, or a storage used beyond its idle count (on every replay's path: loops that
        stop at the first holder, no lists built)."""
        for ref in self._handed:
            if ref is not None and ref() is not None:
                return True
        use_count = _compat.storage_use_count
        for handle, idle in self._watched:
            if use_count(handle) > idle:
                return True
        return False

    def held_storages(self) -> Set[int]:
        """The storages referenced beyond their idle count now."""
        return {ptr for ptr, (handle, idle) in self.storages.items() if _compat.storage_use_count(handle) > idle}

    def aliases(self) -> List[Optional[object]]:
        """The aliases of the last replay, by output position (None where dead or not tracked)."""
        return [ref() if ref is not None else None for ref in self._handed]

    def alive_aliases(self) -> List[int]:
        """Positions (in the order handed out) of the aliases still alive."""
        return [j for j, ref in enumerate(self._handed) if ref is not None and ref() is not None]
