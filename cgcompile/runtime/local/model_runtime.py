"""ModelRuntime: what every partition of one compiled frame shares.

The driver, the memory pool token and the memory registry (which captured graph owns which memory, and the pool
rule: runtime/memory/registry.py), the list of live graphs (each registers at capture and leaves when discarded),
graphs whose parameters were freed, the capture summary and its progress display. runtime/local/runner.py keeps
the per-partition graph bank.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ... import _compat
from ...counters import add as count, reuse
from .. import release as releases
from ..drivers.base import Driver
from ..drivers.select import EagerDriver, captures_on, get_driver
from .frame_outputs import copy_out
from .sources import source_of
from ..memory.garbage import CycleCollector
from ..memory.registry import MemoryRegistry
from .budget import GraphBudget, check_after_capture
from .instance import GraphInstance, memory_of
from .lineage import FrameLineage, Supersession

log = logging.getLogger("cgcompile")

PROGRESS_AFTER_S = 2.0  # a capture wave longer than this shows progress
_EAGER = EagerDriver()


class ModelRuntime:
    """One per compiled frame: owns the driver, the graph pool, the memory registry and the live graphs.

    Pool: every graph the runtime captures (forward, backward, inference, every instance and size, output arenas'
    members) goes into one memory pool, in capture order; the pool rule, which keeps that sharing safe, is the
    memory registry's (runtime/memory/registry.py).

    Capture summary: one INFO line ("captured N graphs in X s, Y GiB") when the first capture wave ends, i.e. at
    the first replay of a graph after the call that captured it; `log_capture_summary()` logs it earlier if
    called (once either way). When the wave's captures take longer than 2 s a progress display appears.
    """

    def __init__(self, config: Any, device: Any, plan: Any = None, lineage: Optional[FrameLineage] = None):
        self.config = config
        self.lineage = lineage  # the code object and inputs it was compiled for (lineage.py), None when unknown
        # held through each call of the frame and of its backward graphs: one thread's at a time (serialized.py)
        self.calls = threading.RLock()
        others = live_runtimes()
        # the earlier frames of the same code this one supersedes: released when its first capture wave ends
        self._superseded = Supersession(lineage, others, lambda rt: rt.config == config, _frame_calls)
        for other in others:  # a deleted model's frame is never called again: its graphs go now (release_dead)
            if other.dead:
                other.when_idle(other.release_dead)
        self.driver: Driver = get_driver(str(config.driver), device)
        self.device = getattr(self.driver, "device", None) or torch.device(device)  # cuda: with its index
        self.memory = MemoryRegistry()
        self.cycles = CycleCollector()  # reference cycles collected before a graph looking held is acted on
        self.plan = plan  # the frame's GraphPlan (plan.py): its eager partitions too, for cgcompile.report()
        self.budget = GraphBudget(config, self.driver)  # cuda_graph_memory_budget
        self._pool: Any = None
        self._wave_open = True
        self._wave = {"graphs": 0, "seconds": 0.0, "bytes": 0}
        self._summary_logged = False
        self._progress: Optional[_Progress] = None
        self._live: Dict[int, GraphInstance] = {}  # id -> captured graph alive now, in capture order
        # PartitionRunners using this runtime, in the order they were added (a WeakSet's order follows addresses)
        self._runners: "weakref.WeakKeyDictionary[Any, None]" = weakref.WeakKeyDictionary()
        self.dead: List[Tuple[Any, GraphInstance]] = []  # (runner, graph) whose parameters were freed: released next call
        releases.register(self)

    # public ---------------------------------------------------------------------------------------------

    def finish_frame_outputs(self, outputs: Any) -> Any:
        """Clone the frame outputs that alias static memory (when config.clone_outputs), so the next replay
        cannot overwrite what the caller holds; several at once in a kernel per dtype (frame_outputs.py).
        Handles a tensor or a flat list/tuple (Dynamo's output). An
        output of a warmup run is told it leaves the frame: the caller keeping it is no reason to hand that
        position out as a copy later (runtime/local/family.py), since replays' frame outputs are cloned here."""
        if not self.config.clone_outputs:
            return outputs
        for out in (outputs if isinstance(outputs, (list, tuple)) else (outputs,)):
            leaves = getattr(source_of(out), "leaves_frame", None)
            if leaves is not None:
                leaves(out)
        memory = self.memory
        if not memory.any_owned():
            return outputs
        if isinstance(outputs, torch.Tensor):
            return outputs.clone() if memory.owns(outputs) else outputs
        if isinstance(outputs, (list, tuple)):
            if len(outputs) == 1:  # a decode step's token: the per-step path as short as it was
                fixed = [o.clone() if memory.owns(o) else o for o in outputs]
            else:
                fixed = self._copied_out(outputs)
            if type(outputs) in (list, tuple):
                return type(outputs)(fixed)
            return type(outputs)(*fixed)  # namedtuple
        return outputs

    def _copied_out(self, outputs: Sequence[Any]) -> List[Any]:
        """`outputs` with those in graph memory copied out, several of one dtype at once (frame_outputs.py)."""
        memory = self.memory
        owned = [j for j, o in enumerate(outputs) if memory.owns(o)]
        fixed = list(outputs)
        plain = [j for j in owned if not _compat.is_wrapper_subclass(outputs[j])]
        for j, copied in zip(plain, copy_out([outputs[j] for j in plain], zeros=True)):  # a kernel per dtype
            fixed[j] = copied
        for j in set(owned) - set(plain):  # a wrapper subclass (DTensor): its own clone
            fixed[j] = outputs[j].clone()
        return fixed

    def log_capture_summary(self) -> None:
        """Log the capture summary line now (once per runtime; no-op before the first capture)."""
        if self._summary_logged or not self._wave["graphs"]:
            return
        self._summary_logged = True
        if self._progress is not None:
            self._progress.close()
            self._progress = None
        wave = self._wave
        memory = f", {wave['bytes'] / 2**30:.2f} GiB" if self.driver.name == "cuda" else ""
        rows = self.partition_stats()
        bank = ", ".join(f"{row['partition']} {row['calls']}/{row['replays']}/{row['captures']}/{row['misses']}"
                         for row in rows)
        inner = "inductor" if self.config.fuses_with_inductor(self.driver.name) else "eager"
        log.info("cgcompile: captured %d graphs in %.1f s%s (driver %s, inner compiler %s); reuse after warmup so far "
                 "%.0f%%; graph bank per partition, calls/replays/captures/misses (stats()['partitions']): %s",
                 wave["graphs"], wave["seconds"], memory, self.driver.name, inner, 100 * reuse(rows), bank)

    def release(self) -> None:
        """Drop every graph, the pool and the driver's stream (cgcompile.release()); the partitions warm up and
        capture again on their next calls. A pending backward of a released forward runs eagerly. Called from
        another thread, it waits for the call running there to end."""
        with self.calls:
            for runner in list(self._runners):
                runner.release()
            self.memory.clear()
            self._live.clear()
            self._pool, self._wave_open = None, True
            self.dead = []
            self.driver.release()

    def graph_memory(self) -> List[Dict[str, Any]]:
        """Per live graph: its partition, unique label, kind, replays, the collectives it runs (by name and count),
        the pool bytes its capture reserved (CUDA only), and the bytes of the static input buffers and outputs it
        owns (what it keeps between calls)."""
        with self.calls:  # read between calls, not while another thread's call changes them
            return [{"partition": g.partition, "label": g.label, "kind": g.kind, "replays": g.replays,
                     "steady_replays": max(0, g.replays - 1), "collectives": dict(g.family.collectives),
                     **memory_of(g, g.family.saved)} for g in self.live_graphs()]

    def partition_stats(self) -> List[Dict[str, Any]]:
        """Per partition that ran since it was created or released: its frame and graph-bank accounting
        (bank_policy.BankCounters), how many of its sizes were compiled, the bytes its graphs hold, why it fell back
        to eager for good (or None), and its measured times (option measure_benefit: bank/benefit.py)."""
        with self.calls:  # counting the steady replays writes their records: not during another thread's call
            counted = [(r, r.bank_counters()) for r in self.runners()]
            return [{"partition": r.name, "frame": r.frame, **counters.as_dict(), "compiled_sizes": r.bank_size(),
                     "graph_bytes": self.bytes_of(r), "fallback": r.broken,
                     **r.benefit.meter.as_dict(max(1, len(r.ledger.param_sets)))}
                    for r, counters in counted if counters.calls]

    def bytes_of(self, runner: Any) -> int:
        """What `runner`'s live graphs hold (its share of stats()["graph_bytes"])."""
        return releases.held_bytes([memory_of(g) for g in self.live_graphs() if g.family.part is runner])

    def budget_refuses(self, runner: Any, kind: str) -> Optional[str]:
        """Before `runner` captures a graph of `kind`: why the memory budget refuses it, after making what room it
        may (runtime/local/budget.py), or None."""
        return self.budget.refuses(runner, kind, live_runtimes())

    def captured_within_budget(self, runner: Any) -> None:
        """After `runner` captured a graph: past the memory budget it runs eagerly for good (budget.py)."""
        check_after_capture(self.budget, runner, live_runtimes())

    def live_graphs(self) -> List[GraphInstance]:
        """The captured graphs alive now (forward, backward and inference instances), in capture order.
        Read-only introspection for tests and tools (docs: Understanding the plan)."""
        return list(self._live.values())

    def runners(self) -> List[Any]:
        """The PartitionRunners (captured partitions) that run on this runtime."""
        return list(self._runners)

    def add_runner(self, runner: Any) -> None:
        """A PartitionRunner on this runtime: release() forgets its graphs too."""
        self._runners[runner] = None

    # internal -------------------------------------------------------------------------------------------

    def driver_for(self, example_inputs: Sequence[Any]) -> Driver:
        """The runtime's driver, or eager for a partition the cuda driver cannot capture: no CUDA tensor, or
        CUDA tensors on another device than the runtime's (drivers.captures_on)."""
        if self.driver.name == "cuda" and not captures_on(self.device, example_inputs):
            return _EAGER
        return self.driver

    def pool(self) -> Any:
        """The pool token every capture of this runtime uses."""
        if self._pool is None:
            self._pool = self.driver.new_pool()
        return self._pool

    def register(self, graph: GraphInstance, lenders: Dict[int, Tuple[Any, int, int]]) -> None:
        """A new graph: its memory in the registry (`lenders`: MemoryRegistry.lenders, measured before the
        capture), it among the live graphs, its capture in the counters and the capture wave."""
        self.memory.register(graph, lenders)
        self.cycles.memory_changed()
        self._live[id(graph)] = graph
        captured = graph.captured
        seconds = graph.capture_seconds
        count("graphs_captured")
        count("capture_seconds", seconds)
        count("pool_bytes", captured.pool_bytes)
        if not self._summary_logged:
            self._wave["graphs"] += 1
            self._wave["seconds"] += seconds
            self._wave["bytes"] += captured.pool_bytes
            if self._wave["seconds"] > PROGRESS_AFTER_S:
                if self._progress is None:
                    self._progress = _Progress(self._wave["graphs"])
                else:
                    self._progress.update()

    def discard(self, graph: Optional[GraphInstance]) -> None:
        """Forget a graph (re-capture, fallback, release): release its memory claims so its storage can be freed."""
        self.cycles.memory_changed()
        while graph is not None:
            self._live.pop(id(graph), None)
            graph = self.memory.discard(graph)  # then its backward graph

    def mark_in_flight(self, graph: GraphInstance) -> None:
        """A graph ran (replayed, or captured and run): in flight for the pool rule until found free. Its first
        replay after the call that captured it ends the capture wave."""
        self.memory.mark_in_flight(graph)
        if graph.replays > 1 and self._wave_open:
            self._wave_open = False
            self.log_capture_summary()
            self._release_superseded()

    def note_dead(self, runner: Any, graph: GraphInstance) -> None:
        """A parameter `graph` reads was freed (called from a weak reference's callback): `runner`, the partition
        that captured it, releases it at the next call, outside the garbage collector."""
        self.dead.append((runner, graph))

    def in_call(self) -> bool:
        """Is one of this frame's partitions in the middle of a call (through its full path)?"""
        return any(runner.call is not None for runner in self.runners())

    def when_idle(self, action: Any) -> bool:
        """`action()` now, from outside this frame's calls, if no call of it is running (on any thread: its
        lock is free; on this one: none of its partitions is mid-call); whether it ran. Never waits: another
        runtime's lock taken while holding one's own could wait for a thread waiting for us."""
        if not self.calls.acquire(blocking=False):
            return False
        try:
            if self.in_call():
                return False
            action()
            return True
        finally:
            self.calls.release()

    def release_dead(self) -> None:
        """Release the graphs whose parameters were freed (each by the partition that captured it): at the next call
        of one of this frame's partitions, or when another frame is compiled (a model deleted, its frame never
        called again, as in a sweep over model sizes)."""
        dead, self.dead = self.dead, []
        for runner, graph in dead:
            if graph.alive:
                runner.releaser.release([graph], "a parameter it reads was freed (e.g. replaced by "
                                                 "load_state_dict(assign=True))", force=True)

    def _release_superseded(self) -> None:
        """The frames this one superseded (lineage.py) that made no call since it was made: their graphs go, with
        their memory; a call of one captures anew."""
        for old in self._superseded.due():
            graphs = old.live_graphs()
            if not graphs:
                continue
            nbytes = releases.held_bytes([memory_of(g) for g in graphs])
            if not old.when_idle(old.release):  # another thread is calling it now: not superseded for its sizes
                continue
            count("graphs_released", sum(g.kind != "backward" for g in graphs))  # each with its backward, as a release
            log.info("cgcompile: %s was compiled again with dynamic sizes as %s, which Dynamo now calls for its sizes "
                     "too: released its %d graph(s), %.1f KiB returned (a later call of it captures anew)",
                     _frame_name(old), _frame_name(self), len(graphs), nbytes / 1024)


def _frame_name(runtime: ModelRuntime) -> str:
    return "a frame" if runtime.plan is None else f"graph {runtime.plan.index}"


def _frame_calls(runtime: ModelRuntime) -> int:
    """The calls a frame's captured partitions have counted (its steady replays' pending ones too)."""
    return sum(runner.bank_counters().calls for runner in runtime.runners())


def live_runtimes() -> List[ModelRuntime]:
    """Every ModelRuntime alive now (one per compiled frame with captured partitions), for introspection."""
    return [h for h in releases.holders() if isinstance(h, ModelRuntime)]


class _Progress:
    """Shows progress of a long capture wave: tqdm when installed, else a throttled stderr line."""

    def __init__(self, done: int):
        self.done = done
        self._last = 0.0
        try:
            from tqdm import tqdm
            self._bar = tqdm(desc="cgcompile: capturing CUDA graphs", unit="graph", initial=done)
        except ImportError:
            self._bar = None
        self._show()

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        else:
            self._show()

    def _show(self) -> None:
        now = time.monotonic()
        if self._bar is None and now - self._last >= 1.0:
            self._last = now
            sys.stderr.write(f"\rcgcompile: capturing CUDA graphs... {self.done} captured")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            sys.stderr.write("\n")
