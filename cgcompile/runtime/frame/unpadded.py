"""A padded frame that gives its padding up when a padded partition falls back to eager.

dynamic_padding makes a data-dependent row count static by padding the rows to their upper bound (`max`) or to
a bucket. That pays only while the padded partition is replayed: run eagerly it still computes every padded
row (a 64-expert top-8 MoE padded to `max` does 8x the routed work; seen on an H200, 2026-11-28: 624 ms per eager
call against a 105 ms eager step). So when a padded partition falls back for good (the benefit rule's
`not_profitable`, a failed capture, the memory budget), the frame is compiled again from its graph as Dynamo gave
it, without dynamic_padding, and runs that from its next call: the unpadded code the user wrote, its rows in
eager islands, every other partition captured as before. The switch happens at a frame call, never inside one,
logged once and counted in `stats()["padding_withdrawn"]`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from ...counters import record

__all__ = ["UnpaddedOnFallback"]

log = logging.getLogger("cgcompile")


class UnpaddedOnFallback:
    """Runs the padded frame `run` until one of its padded partitions' runners (`padded`, names) has fallen back,
    then the frame `compile_unpadded(args)` builds (once, from that call's arguments), from then on."""

    def __init__(self, run: Callable[..., Any], padded: Sequence[str],
                 compile_unpadded: Callable[[Sequence[Any]], Callable], name: str):
        self.run = run
        self.runtime = getattr(run, "runtime", None)
        self.name = name
        by_name = {r.name: r for r in (self.runtime.runners() if self.runtime is not None else ())}
        self.padded = [by_name[name] for name in padded if name in by_name]  # plan order: one withdrawal reason
        self.compile_unpadded: Optional[Callable[[Sequence[Any]], Callable]] = compile_unpadded

    def __call__(self, *args: Any) -> Any:
        if self.compile_unpadded is not None:
            fallen = next((r for r in self.padded if r.broken is not None), None)
            if fallen is not None:
                self._withdraw(fallen, args)
        return self.run(*args)

    def _withdraw(self, fallen: Any, args: Sequence[Any]) -> None:
        """Log, count, drop the padded frame's graphs (a pending backward of one runs eagerly: ModelRuntime.release)
        and build the unpadded frame."""
        build, self.compile_unpadded, self.padded = self.compile_unpadded, None, []
        log.warning("cgcompile: %s: the padded %s runs eagerly (%s); its padded rows would cost more eagerly than "
                    "the code as written, so the frame is compiled again without dynamic_padding",
                    self.name, fallen.describe(), fallen.broken)
        record("padding_withdrawn", fallen.name, fallen.broken, once=True)
        if self.runtime is not None:
            self.runtime.release()
        self.run = build(args)
        self.runtime = getattr(self.run, "runtime", None)
