"""bench_cpu table (g): what a replay costs on the host, and whether the graphs captured are reused.

Host time per replay, ours vs a minimal CUDA-graph wrapper measured in the same process: the minimal wrapper keys
on the non-static inputs' shapes, looks the graph up in a dict, copies the non-static inputs into its static
buffers in one call, replays, returns the static outputs (what vLLM's wrapper does; it checks no parameter address
and bumps no version counter). Both replay the same kind of graph. The decode rows time a real decode loop (a new
token and position every step, decode_call_times): the same split with every partition answering from a cache is
the step's bound, and a step's time over it, shared out over its partition calls, is the time per call (timing one
call with its arguments repeated saw half of what a real loop pays: issue 36). On the CPU every emulated
replay is made a no-op returning the static outputs during the timed calls, so what is timed is the host work
around a replay (on a GPU the replay itself is one graph launch); bench_gpu.py times the same on CUDA with real
graphs. Workloads: an 8-layer KV-cache decode step in layer scope (one partition per layer, 17 arguments, 12 of
them parameters) and in block scope (one partition, 120 arguments, 101 of them parameters and 16 cache buffers
it writes), and a training step of a model with a graph break in every layer (one compiled frame serves every
layer) at 8, 24 and 96 layers: the time inside the partition per forward call should not grow with depth. The
cycle collector is paused during timed calls, as timeit does (a collection costs what every live object costs).
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

import cgcompile
from cgcompile.runtime.local import runner as partition_runner
from cgcompile.runtime.drivers.emulate import EmulatedGraph
from tests.models import kv_gpt

__all__ = ["address_check_times", "decode_call_times", "decode_candidates", "decode_host_times", "decode_step_times",
           "BreakBlock", "depth_host_times", "glue_bound", "inner_host_times", "minimal_partitions", "python_host_path",
           "split_with_stand_ins", "StandIns"]


class MinimalWrapper:
    """Key from the non-static inputs' shapes, one dict lookup, copy them into static buffers in one call,
    replay, return the static outputs."""

    def __init__(self, fn: Callable[[list], Any], static: Sequence[int], args: Sequence[Any], driver: Any):
        self.fn, self.graphs, self.driver = fn, {}, driver
        self.dynamic = [i for i, a in enumerate(args) if i not in set(static) and isinstance(a, torch.Tensor)]

    def __call__(self, *args: Any) -> List[Any]:
        key = tuple(args[i].shape for i in self.dynamic)
        entry = self.graphs.get(key)
        if entry is None:
            inputs = [a.clone() if i in self.dynamic else a for i, a in enumerate(args)]
            entry = self.graphs[key] = (self.driver.capture(self.fn, inputs), [inputs[i] for i in self.dynamic])
        graph, buffers = entry
        torch._foreach_copy_(buffers, [args[i] for i in self.dynamic])
        return graph.replay()


@contextlib.contextmanager
def replays_as_launches():
    """Every emulated replay returns its static outputs and runs nothing: the timed work is the host's."""
    replay = EmulatedGraph.replay
    EmulatedGraph.replay = lambda self: self.static_outputs
    try:
        yield
    finally:
        EmulatedGraph.replay = replay


@contextlib.contextmanager
def collector_paused():
    """Python's cycle collector off during timed calls, as timeit runs them: a collection's cost follows every object
    alive (the deeper the model, the more), not the calls timed, and lands in whichever call it interrupts."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _first_calls(run: Callable[[], Any], keep: Optional[int] = None) -> Tuple[List[Any], Optional[tuple]]:
    """The partitions `run` calls, in order of first call, each as the frame calls it (a PartitionRunner, or for a
    frame that is one partition call, the runner's frame_call(): its compiled steady replay where built), and the
    arguments of the `keep`-th one's first call. Only that one's: arguments kept for the timed calls must not hold
    the outputs of the partition timed (the next partition's arguments would, keeping its graph held and every timed
    call on another instance), which a decode loop never does."""
    seen: List[Any] = []
    kept: List[tuple] = []
    runner_class = partition_runner.PartitionRunner
    call, leaving = runner_class.__call__, runner_class.leaving
    entered: Dict[int, Any] = {}
    cgcompile.stats()  # reading the counts disarms the compiled steady replays: `run`'s calls enter the runners

    def first(runner: Any, args: tuple, as_frame: bool = False) -> None:
        if all(runner is not r for r in seen):
            seen.append(runner)
            entered[id(runner)] = runner.frame_call() if as_frame else runner
            if len(seen) - 1 == keep:
                kept.append(args)

    def recording(self, *args):
        first(self, args)
        return call(self, *args)

    def recording_leaving(self, args):  # a frame that is this one call (block scope) enters here
        first(self, args, as_frame=True)
        return leaving(self, args)

    runner_class.__call__, runner_class.leaving = recording, recording_leaving
    try:
        run()
    finally:
        runner_class.__call__, runner_class.leaving = call, leaving
    return [entered[id(r)] for r in seen], (kept[0] if kept else None)


def decode_host_times(scope: str, layers: int = 8, calls: int = 2000, repeats: int = 7,
                      device: str = "cpu") -> Tuple[float, float]:
    """(ours, minimal): median host seconds per partition call of a steady decode step, averaged over its
    partitions, interleaved repeats. On CUDA both replay real graphs (host time: the calls are not synchronized;
    the device catches up after each timed loop); on the CPU emulated replays are made no-ops."""
    from cgcompile.runtime.drivers.select import get_driver

    cuda = device != "cpu"
    torch._dynamo.reset()
    model = kv_gpt.build(num_layers=layers).to(device).eval()
    options = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": scope,
               "driver": "cuda" if cuda else "emulate"}
    step = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options=options)
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8, device=device)
    timing = contextlib.nullcontext if cuda else replays_as_launches
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with torch.no_grad():
        kv_gpt.generate(step, model, prompt, 6)  # warmup and capture
        ours, minimal = [], []
        for index in range(len(_first_calls(lambda: kv_gpt.generate(step, model, prompt, 1))[0])):
            runners, args = _first_calls(lambda: kv_gpt.generate(step, model, prompt, 1), index)
            runner = runners[index]
            partition = getattr(runner, "runner", runner)  # a compiled steady replay: its runner
            entry = next(iter(partition.bank.values()))
            wrapper = MinimalWrapper(entry.inference.run, partition.static_indices, args,
                                     get_driver(options["driver"], device))
            wrapper(*args)
            times: Dict[str, List[float]] = {"ours": [], "minimal": []}
            with timing(), collector_paused():
                for _ in range(repeats):
                    times["ours"].append(_per_call(lambda: runner(*args), calls))
                    sync()
                    times["minimal"].append(_per_call(lambda: wrapper(*args), calls))
                    sync()
            ours.append(statistics.median(times["ours"]))
            minimal.append(statistics.median(times["minimal"]))
            del runners, runner, args, entry, wrapper
    return sum(ours) / len(ours), sum(minimal) / len(minimal)


def inner_host_times(scope: str, layers: int = 8, calls: int = 2000, repeats: int = 7) -> Dict[str, float]:
    """{inner compiler: median host seconds per partition call of a steady decode step}, "eager" and "inductor",
    both models compiled and warmed up first, then timed partition by partition with the two alternating (only
    the timed partition's arguments are kept, as in decode_host_times); emulated replays made no-ops."""
    torch._dynamo.reset()
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    built = {}
    for inner in ("eager", "inductor"):
        model = kv_gpt.build(num_layers=layers).eval()
        step = torch.compile(kv_gpt.DecodeStep(model), backend="cudagraph_modules", options={
            "cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": scope, "driver": "emulate",
            "inner_compiler": inner})
        with torch.no_grad():
            kv_gpt.generate(step, model, prompt, 6)  # warmup and capture
        built[inner] = (step, model)
    one_step = {inner: (lambda s=step, m=model: kv_gpt.generate(s, m, prompt, 1))
                for inner, (step, model) in built.items()}
    found: Dict[str, List[float]] = {inner: [] for inner in built}
    with torch.no_grad():
        for index in range(len(_first_calls(one_step["eager"])[0])):
            timed = {}
            for inner in built:
                runners, args = _first_calls(one_step[inner], index)
                timed[inner] = (runners[index], args)
            samples: Dict[str, List[float]] = {inner: [] for inner in built}
            with replays_as_launches(), collector_paused():
                for r in range(repeats):
                    for inner in (list(timed) if r % 2 == 0 else list(reversed(timed))):
                        runner, args = timed[inner]
                        samples[inner].append(_per_call(lambda: runner(*args), calls))
            for inner, times in samples.items():
                found[inner].append(statistics.median(times))
            del timed, runners, args
    return {inner: sum(times) / len(times) for inner, times in found.items()}


class StandIns:
    """How many partitions a split_with_stand_ins backend put in place of those cgcompile would capture: a graph's
    code is straight-line, so a step of a frame compiled to one graph calls each once (a step's time shared out
    per partition call)."""

    def __init__(self) -> None:
        self.made = 0


def split_with_stand_ins(options: dict, stand_in: Callable[[Callable[..., Any]], Callable[..., Any]],
                         tally: Optional[StandIns] = None, finish: Optional[Callable[[Any], Any]] = None
                         ) -> Callable[[torch.fx.GraphModule, list], Callable[..., Any]]:
    """A backend that plans and splits the graph as cgcompile splits it with these options, each partition it would
    capture replaced by `stand_in(its plain forward)`, the partitions it leaves eager (the glue between the layers
    in layer scope) run as cgcompile runs them. `tally` counts the stand-ins it puts in; `finish`, what the frame
    does with its outputs as they leave it."""
    from cgcompile.config import CudaGraphConfig
    from cgcompile.frame_plan import make_plan
    from cgcompile.plan import submodule_name
    from cgcompile.split import call_directly, plain_forward, replace_submodule, split

    config = CudaGraphConfig.from_options(options)

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        graph_plan = make_plan(gm, example_inputs, config, 0)
        split_gm = split(gm, graph_plan)
        for partition in graph_plan.captured:
            name = submodule_name(partition.id)
            replace_submodule(split_gm, name, stand_in(plain_forward(getattr(split_gm, name))))
            if tally is not None:
                tally.made += 1
        return call_directly(split_gm, finish)
    return backend


def first_outputs(run: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in that answers every call with the outputs of its first: a replay and its checks costing nothing."""
    kept: List[Any] = []

    def answer(*args: Any) -> Any:
        if not kept:
            kept.append(run(*args))
        return kept[0]
    return answer


def glue_bound(options: dict, tally: Optional[StandIns] = None
               ) -> Callable[[torch.fx.GraphModule, list], Callable[..., Any]]:
    """A backend for the lowest host time a runtime could reach with these options' plan: the graph planned and
    split as cgcompile splits it, each partition it would capture answering with the outputs of its first call
    (a replay and its checks costing nothing), the partitions it leaves eager (the glue between the layers in
    layer scope) run as cgcompile runs them."""
    return split_with_stand_ins(options, first_outputs, tally)


def minimal_partitions(options: dict, held: set, tally: Optional[StandIns] = None
                       ) -> Callable[[torch.fx.GraphModule, list], Callable[..., Any]]:
    """The same split, each partition cgcompile would capture run by a MinimalWrapper around an emulated capture of
    it (its inputs copied in unless `held`, the ids of the model's parameters and buffers, has them; its static
    outputs handed on as they are, and cloned only as they leave the frame, where the next replay would overwrite
    what the caller keeps): a partition call of the minimal wrapper as a real decode loop makes it."""
    from cgcompile.runtime.drivers.select import get_driver

    driver = get_driver("emulate", "cpu")
    static_outputs: set = set()  # the data pointers of the stand-ins' static outputs

    def minimal(run: Callable[..., Any]) -> Callable[..., Any]:
        made: List[Tuple[MinimalWrapper, bool]] = []

        def call(*args: Any) -> Any:
            if not made:  # the first call runs the partition eagerly (a warmup call) and builds the wrapper
                one = isinstance(run(*args), torch.Tensor)
                static = [i for i, a in enumerate(args) if id(a) in held]
                made.append((MinimalWrapper(lambda inputs: [run(*inputs)] if one else list(run(*inputs)), static,
                                            args, driver), one))
            wrapper, one = made[0]
            captured = len(wrapper.graphs)
            out = wrapper(*args)
            if len(wrapper.graphs) != captured:  # a capture: its static outputs
                static_outputs.update(t.data_ptr() for t in out if isinstance(t, torch.Tensor))
            return out[0] if one else tuple(out)
        return call

    def leaving(outputs: Any) -> Any:  # the frame's outputs (a flat list or tuple, as Dynamo's)
        return type(outputs)(o.clone() if isinstance(o, torch.Tensor) and o.data_ptr() in static_outputs else o
                             for o in outputs)
    return split_with_stand_ins(options, minimal, tally, leaving)


def own_decode_step(model: nn.Module) -> nn.Module:
    """kv_gpt.DecodeStep(model) whose forward has a code object of its own. Dynamo keeps the entries it compiles per
    code object and checks them in turn at every call, so candidates sharing DecodeStep.forward would each pay for
    the guards of the ones compiled before them (measured: a candidate's step 0.2x the floor faster or slower by its
    place in that list); a user's one compiled model checks only its own."""
    forward = kv_gpt.DecodeStep.forward
    own = types.FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                             forward.__defaults__, forward.__closure__)
    return type("DecodeStep", (kv_gpt.DecodeStep,), {"forward": own})(model)


@contextlib.contextmanager
def python_host_path():
    """Models compiled (at their first call) meanwhile run their host path in Python: cgcompile's compiled steady
    replay and scope gate left out, as where they could not be built (cgcompile/native.py's switch)."""
    from cgcompile import native

    saved = os.environ.get(native.PYTHON_HOST_PATH)
    os.environ[native.PYTHON_HOST_PATH] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[native.PYTHON_HOST_PATH]
        else:
            os.environ[native.PYTHON_HOST_PATH] = saved


def decode_candidates(scopes: Sequence[str] = ("layer", "block"), layers: int = 8, inner: str = "eager",
                      python_path: bool = False, tallies: Optional[Dict[str, StandIns]] = None
                      ) -> Tuple[List[str], Callable[[str, int], None]]:
    """The decode steps decode_step_times (and step_instructions.py) compare, each a torch.compile of the decode step of
    one KV-cache model of `layers` layers: "floor", a backend that returns the outputs of its first call (Dynamo's
    guards and frame call: what any backend pays); "minimal", a backend that copies the step's non-parameter inputs
    into buffers of its own in one `_foreach_copy_` and returns clones of its first outputs (what any CUDA-graph
    backend that copies inputs in and hands out outputs a next replay cannot overwrite pays at least); cgcompile
    per scope; with layer scope, "layer bound" too (glue_bound: the layers answered from a cache, the glue between
    them eager); with `python_path`, "block python" too (block scope with the host path in Python: cgcompile where
    its compiled helpers were not built); with `tallies`, per scope "<scope> bound" and "<scope> minimal" (the same
    split with each partition a MinimalWrapper, minimal_partitions), tallies[scope] counting its partitions per
    step. The model is prefilled. Returns the names and `run(name, steps)`, which runs that candidate's
    next `steps` steps of a real decode loop (each at the next position, with a new token tensor); call it under
    torch.no_grad()."""
    torch._dynamo.reset()
    model = kv_gpt.build(num_layers=layers).eval()
    (prompt,) = kv_gpt.example_inputs(batch=4, seq=8)
    positions = kv_gpt.positions(model.max_seq)
    held = {id(t) for t in (*model.parameters(), *model.buffers())}  # read in place (the cache too: written there)

    def cached_outputs(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        outputs = gm(*example_inputs)
        return lambda *args: outputs

    def minimal_replay(gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        outputs = gm(*example_inputs)
        moving = [i for i, a in enumerate(example_inputs) if isinstance(a, torch.Tensor) and id(a) not in held]
        buffers = [example_inputs[i].clone() for i in moving]

        def replay(*args: Any) -> Any:
            torch._foreach_copy_(buffers, [args[i] for i in moving])
            return [out.clone() for out in outputs]
        return replay

    floor = torch.compile(own_decode_step(model), backend=cached_outputs)
    steps_of: Dict[str, Callable[..., Any]] = {
        "floor": floor, "minimal": torch.compile(own_decode_step(model), backend=minimal_replay)}
    for scope in scopes:
        options = {"cuda_graph_modules": ["attn", "mlp"], "inference_cuda_graph_scope": scope, "driver": "emulate",
                   "inner_compiler": inner}
        steps_of[scope] = torch.compile(own_decode_step(model), backend="cudagraph_modules", options=options)
        if tallies is not None:
            tally = tallies[scope] = StandIns()
            steps_of[f"{scope} bound"] = torch.compile(own_decode_step(model), backend=glue_bound(options, tally))
            steps_of[f"{scope} minimal"] = torch.compile(own_decode_step(model),
                                                         backend=minimal_partitions(options, held))
        elif scope == "layer":
            steps_of["layer bound"] = torch.compile(own_decode_step(model), backend=glue_bound(options))
        if scope == "block" and python_path:
            steps_of["block python"] = torch.compile(own_decode_step(model), backend="cudagraph_modules",
                                                     options=options)
            with python_host_path(), torch.no_grad():  # compiled at its first call
                steps_of["block python"](torch.zeros(4, 1, dtype=torch.long), positions[8])

    generator = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, kv_gpt.VOCAB, (4, 1), generator=generator) for _ in range(16)]
    span = model.max_seq - 8
    done = dict.fromkeys(steps_of, 0)  # steps each candidate has run: its next step is at the next position

    def run(name: str, steps: int) -> None:
        step, first = steps_of[name], done[name]
        for i in range(first, first + steps):
            step(tokens[i % len(tokens)], positions[8 + i % span])
        done[name] = first + steps

    with torch.no_grad():
        kv_gpt.prefill(model, prompt)
    return list(steps_of), run


def decode_step_times(scopes: Sequence[str] = ("layer", "block"), layers: int = 8, rounds: int = 2000,
                      block: int = 5, inner: str = "eager", python_path: bool = False) -> Dict[str, float]:
    """Host seconds per whole decode step in a real decode loop, emulated replays made no-ops (as a launch), per
    candidate of decode_candidates. Each round runs `block` steps of every candidate, in turn (the order reversed
    every other round), and each candidate's time is the median over the rounds of its block's process CPU time:
    a neighbour's load or a slow moment lands on all candidates alike and on few samples (whole runs of 200 steps
    per candidate, timed apart, moved the ratio by up to 50% on a shared machine)."""
    names, run = decode_candidates(scopes, layers, inner, python_path)
    return {name: statistics.median(found) for name, found in _interleaved(names, run, rounds, block).items()}


def decode_call_times(scopes: Sequence[str] = ("layer", "block"), layers: int = 8, rounds: int = 2000,
                      block: int = 5) -> Dict[str, Tuple[float, float]]:
    """Per scope: (ours, minimal), host seconds per partition call in a real decode loop (a new position every step),
    replays as launches: a step's time over its bound's (every partition answering from a cache, the glue as
    cgcompile runs it), shared out over the step's partition calls, for cgcompile and for the same split with each
    partition a MinimalWrapper (decode_candidates with tallies; timed as decode_step_times times)."""
    tallies: Dict[str, StandIns] = {}
    names, run = decode_candidates(scopes, layers, tallies=tallies)
    samples = _interleaved(names, run, rounds, block)

    def over_bound(name: str, scope: str) -> float:  # paired by round: a slow moment lands on both of a pair
        return statistics.median(t - b for t, b in zip(samples[name], samples[f"{scope} bound"])) / tallies[scope].made
    return {scope: (over_bound(scope, scope), over_bound(f"{scope} minimal", scope)) for scope in scopes}


def _interleaved(names: Sequence[str], run: Callable[[str, int], None], rounds: int,
                 block: int) -> Dict[str, List[float]]:
    """decode_step_times' timing of decode_candidates' `names` (its docstring): per candidate, its seconds per step
    in each round."""
    samples: Dict[str, List[float]] = {name: [] for name in names}
    with torch.no_grad():
        for name in names:  # compile, warm up, capture, and the bank policy's first judgement
            run(name, 200)
        order = list(names)
        with replays_as_launches(), collector_paused():
            for r in range(rounds):
                for name in (order if r % 2 == 0 else order[::-1]):
                    start = time.process_time()  # this process's CPU time: other sessions' load stays out
                    run(name, block)
                    samples[name].append((time.process_time() - start) / block)
    return samples


def address_check_times(count: int = 118, calls: int = 2000, repeats: int = 7, device: str = "cpu") -> Dict[str, float]:
    """Per way of checking fixed input addresses available here (_compat.ADDRESS_CHECK_IMPLS): median seconds to
    check `count` parameters' addresses (block-scope decode checks 118), all matching."""
    from cgcompile import _compat

    args = [nn.Parameter(torch.randn(8, device=device)) for _ in range(count)]
    found = {}
    with collector_paused():
        for impl in _compat.ADDRESS_CHECK_IMPLS:
            check = _compat.AddressCheck(range(count), [a.data_ptr() for a in args], impl)
            assert check.matches(args)
            found[impl] = statistics.median(_per_call(lambda: check.matches(args), calls) for _ in range(repeats))
    return found


class BreakBlock(nn.Module):
    """A block with a graph break in the middle: Dynamo compiles its code once and reuses it for every layer."""

    def __init__(self, width: int = 32):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        x = x + torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return x + torch.relu(self.b(x))


def depth_host_times(depths: Sequence[int], steps: int = 4, repeats: int = 3) -> Dict[int, float]:
    """Per depth: median host seconds inside a partition per forward call of a steady training step."""
    found = {}
    for layers in depths:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Sequential(*[BreakBlock() for _ in range(layers)])
        compiled = torch.compile(model, backend="cudagraph_modules", options={"driver": "emulate"})
        x = torch.randn(4, 32)
        for _ in range(5):  # warmup and capture
            compiled(x).sum().backward()
        spent, count = [0.0], [0]
        runner_class = partition_runner.PartitionRunner
        call, leaving = runner_class.__call__, runner_class.leaving

        def timing(fn):
            def timed(self, *args):
                forward = torch.is_grad_enabled()
                start = time.perf_counter()
                try:
                    return fn(self, *args)
                finally:
                    if forward:
                        spent[0] += time.perf_counter() - start
                        count[0] += 1
            return timed

        samples = []
        # a frame that is one partition's call (each block here) enters through leaving (its output's copy included)
        runner_class.__call__, runner_class.leaving = timing(call), timing(leaving)
        try:
            with replays_as_launches():
                for _ in range(repeats):
                    spent[0], count[0] = 0.0, 0
                    with collector_paused():
                        for _ in range(steps):
                            compiled(x).sum().backward()
                    samples.append(spent[0] / count[0])
        finally:
            runner_class.__call__, runner_class.leaving = call, leaving
        found[layers] = statistics.median(samples)
    return found
