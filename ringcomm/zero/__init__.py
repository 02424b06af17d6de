"""ZeRO (Rajbhandari et al., 2020) on ringcomm's collectives.

>>> from ringcomm.zero import ZeroShardManager, estimate_memory
>>> mgr = ZeroShardManager(comm, params, stage=2, lr=1e-3)   # params: numpy/CuPy arrays
>>> mgr.step(grads)                                           # this rank's local gradients
>>> with mgr.gathered():                                      # stage 3: full parameters here only
...     loss = forward(mgr.params)

- :class:`ZeroShardManager`: stages 0-3, mixed-precision AdamW, loss scaling, clipping, sharded
  checkpoints (``save``/``load`` at any world size).
- :func:`estimate_memory`: the paper's bytes per rank of model states;
  ``python -m ringcomm.zero estimate --params 7.5B --world-size 64`` prints the table.
- :func:`consolidate`: read a sharded checkpoint in one process.
"""

from .adam import adam_update, apply_adam
from .checkpoint import CheckpointError, consolidate
from .layout import FlatLayout
from .manager import ZeroShardManager
from .memory import estimate_memory, format_estimate, formula, memory_breakdown, parse_count
from .scaler import LossScaler

__all__ = [
    "CheckpointError",
    "FlatLayout",
    "LossScaler",
    "ZeroShardManager",
    "adam_update",
    "apply_adam",
    "consolidate",
    "estimate_memory",
    "format_estimate",
    "formula",
    "memory_breakdown",
    "parse_count",
]
