"""The call of a partition in progress: what its graph families need of it while aot's wrapper runs them.

aot_autograd's runtime wrapper stands between the partition runner and the graph families it calls, so the call's
parameter set, arguments and bank entry reach the families through this one object, set by the runner
(runtime/local/runner.py) for the duration of the call and read by the families (runtime/local/family.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

__all__ = ["PartitionCall"]


@dataclasses.dataclass(frozen=True)
class PartitionCall:
    args: Sequence[Any]  # the partition's arguments (aot passes its tensors through to the graphs as they are)
    param_set: int  # runtime/bank/key.py: the layer whose graphs the call uses
    bank_key: Any  # its input signature
    entry: Any  # the BankEntry of that signature
    direct: bool  # its inference graph is called without aot's wrapper: a replay becomes the steady replay
