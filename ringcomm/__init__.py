"""ringcomm: ring collectives (reduce-scatter, all-gather, all-reduce, broadcast, reduce) over MPI.

>>> import numpy as np, ringcomm
>>> comm = ringcomm.init()
>>> x = np.ones(10, np.float32)
>>> comm.all_reduce(x)            # in place: x == comm.size everywhere
"""

import importlib
from typing import Any

from .errors import AbortError, MismatchError, RingcommError, TimeoutError
from .ops import SUPPORTED_DTYPES, ReduceOp, bfloat16

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The Communicator needs an MPI library (mpi4py.MPI loads it); importing it lazily lets the
    # single-process parts (schedule, ops, the CUDA kernels and their benchmark) run without one.
    if name in ("Communicator", "init"):
        from . import communicator

        return getattr(communicator, name)
    # imported on first use, so that `python -m ringcomm.schedule` runs a module not imported yet
    # (runpy warns when the package has already imported the module it is asked to run)
    if name == "schedule":
        return importlib.import_module(".schedule", __name__)
    raise AttributeError(f"module 'ringcomm' has no attribute {name!r}")


__all__ = [
    "AbortError",
    "Communicator",
    "MismatchError",
    "ReduceOp",
    "RingcommError",
    "SUPPORTED_DTYPES",
    "TimeoutError",
    "bfloat16",
    "init",
    "schedule",
    "__version__",
]
