"""What a partition's inputs are, for the names in logs, graph labels and the memory registry: which arguments of
the call in progress are parameters or buffers (their storages), what each aot graph argument is called, and how
a new graph and its parameter set are labelled. The PartitionRunner (runtime/local/runner.py) holds one; the graph
families pass it the arguments of the call in progress (runtime/local/call.py)."""

from __future__ import annotations

from typing import Any, Dict, FrozenSet, List, Optional, Sequence

import torch
import torch.fx as fx

from ..tensors import inner_tensors, is_param_or_buffer, storage_ptr

__all__ = ["PartitionInputs"]


class PartitionInputs:
    """Names and parameter storages of one partition's inputs."""

    def __init__(self, submod: fx.GraphModule, name: str, frame: str, location: Optional[str],
                 static_indices: FrozenSet[int], input_names: Sequence[str]):
        self.submod = submod
        self.name = name
        self.frame = frame
        self.location = location
        self.static_indices = static_indices
        self.input_names = list(input_names)  # per submod input, how logs name it (see input_description)
        self._param_set_ids: Dict[frozenset, int] = {}
        self._serial = 0

    def describe(self) -> str:
        return f"partition {self.name}" + (f" ({self.location})" if self.location else "")

    def static_storages(self, call_args: Sequence[Any]) -> set:
        """Storages of a call's parameters and buffers: the indices given, Parameters, Dynamo-marked
        static tensors, and the submodule's own parameters/buffers (aot passes those first); of a wrapper
        parameter (DTensor), its inner tensors' storages, which are what aot hands the graphs."""
        found = set()
        for index, arg in enumerate(call_args):
            if is_param_or_buffer(arg) or (isinstance(arg, torch.Tensor) and index in self.static_indices):
                found.update(storage_ptr(inner) for inner in inner_tensors(arg))
        for tensor in list(self.submod.parameters()) + list(self.submod.buffers()):
            found.update(storage_ptr(inner) for inner in inner_tensors(tensor))
        found.discard(0)
        return found

    def input_names_of(self, args: Sequence[Any], call_args: Sequence[Any]) -> List[Optional[str]]:
        """Per argument of an aot graph, the name of the partition input it is (aot passes the call's tensors,
        `call_args`, through as they are), or None (a saved tensor, a tangent, a lifted parameter)."""
        own = {id(arg): i for i, arg in enumerate(call_args)}
        names = self.input_names
        return [names[own[id(arg)]] if id(arg) in own and own[id(arg)] < len(names) else None for arg in args]

    def param_set_number(self, param_storages: frozenset) -> int:
        """The parameter set's number in graph and arena labels (in order of first capture)."""
        return self._param_set_ids.setdefault(param_storages, len(self._param_set_ids))

    def graph_name(self, args: Sequence[Any], param_storages: frozenset) -> str:
        """A unique, readable name for a new forward/inference graph (its backward's label starts with it):
        partition, frame, the shapes of its non-parameter inputs, which parameter set, a serial number."""
        params = self.param_set_number(param_storages)
        self._serial += 1
        shapes: List[str] = []
        for index, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and index not in self.static_indices and not is_param_or_buffer(arg):
                shape = "x".join(map(str, arg.shape)) or "()"
                if shape not in shapes:
                    shapes.append(shape)
        sizes = ",".join(shapes[:3]) + (",..." if len(shapes) > 3 else "")
        return f"{self.name} in {self.frame} [{sizes}] params {params} #{self._serial}"
