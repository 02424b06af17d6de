"""ringcomm: ring collectives (reduce-scatter, all-gather, all-reduce, broadcast, reduce) over MPI.

>>> import numpy as np, ringcomm
>>> comm = ringcomm.init()
>>> x = np.ones(10, np.float32)
>>> comm.all_reduce(x)            # in place: x == comm.size everywhere
"""

from . import schedule
from .communicator import Communicator, init
from .errors import MismatchError, RingcommError, TimeoutError
from .ops import SUPPORTED_DTYPES, ReduceOp, bfloat16

__version__ = "0.1.0"

__all__ = [
    "Communicator", "MismatchError", "ReduceOp", "RingcommError", "SUPPORTED_DTYPES", "TimeoutError",
    "bfloat16", "init", "schedule", "__version__",
]
