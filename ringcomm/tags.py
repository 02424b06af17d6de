"""Message identity: every ringcomm message says, in its MPI tag, which call it belongs to.

A tag packs, from the low bits up: the channel (what the message is: ring data, a plan's
persistent requests, the CUDA IPC handshake's handles, "ready", "done" and "released" messages, an
abort), then the identity of the call: the collective, the dtype (and whether a half type's partial
sums are float32: accumulate="float32"), the op, the root and the call number (this communicator's
count of collectives, the same on every rank when they call the same sequence). A receive posted for
one call can then never match a message of another: ranks that disagree on the call see a message
they did not expect instead of wrong data, and report it.

The MPI standard promises tags up to ``MPI.TAG_UB`` >= 32767 (15 bits); MPICH gives 2**29 - 1
(29 bits). The fields take, in this order of priority: channel 3 bits, collective 3, dtype 4,
op 3 (13 bits), then the call number at least 8 bits (or what is left), then the root as many
bits as ``size`` needs, then the call number the rest. The call number and the root are kept
modulo 2**bits: with 29 bits and up to 4096 ranks the call number keeps at least 4 bits more
than the root needs (13 bits at 4 ranks: calls 8192 apart alias); with the standard's minimum of
15 bits the call number keeps 2 bits and the root none, so ranks that disagree only on a root
(broadcast, reduce) are then caught by ``check=True`` alone.
"""

from __future__ import annotations

import dataclasses
import functools

from .ops import HALF_DTYPES, SUPPORTED_DTYPES, ReduceOp

#: what a message is (the low 3 bits of its tag); SHARED: no message, a call in the shared-memory
#: window (transports.shm: what its waits expect, so that any message of the call is a mismatch)
DATA, PLAN, HANDLES, READY, DONE, RELEASED, ABORT, SHARED = range(8)
CHANNEL_NAMES = (
    "data",
    "plan (persistent requests)",
    "ipc handles",
    "ipc ready",
    "ipc done",
    "ipc released",
    "abort",
    "in shared memory",
)
#: a plan's persistent requests carry the call number modulo this (engine.Plan)
PLAN_CALLS = 4
#: the collectives a tag can name ("close": the CUDA IPC transport's closing handshake)
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "close")
_OPS = (None, *ReduceOp)
_FIXED = 3 + 3 + 4 + 3


@dataclasses.dataclass(frozen=True)
class Layout:
    """How tags are packed for a communicator of ``size`` ranks under an MPI tag bound ``tag_ub``."""

    bits: int
    root_bits: int
    call_bits: int

    @classmethod
    def for_mpi(cls, tag_ub: int, size: int) -> Layout:
        bits = (int(tag_ub) + 1).bit_length() - 1  # 2**29 - 1 -> 29 bits
        if bits < _FIXED + 2:
            raise ValueError(f"MPI.TAG_UB = {tag_ub} is below the MPI standard's minimum of 32767")
        left = bits - _FIXED
        root_bits = min(max(0, left - 8), int(size).bit_length())  # root + 1 in [0, size]
        return cls(bits, root_bits, left - root_bits)

    def base(self, collective: str, dtype, op: ReduceOp | None, root: int, call: int, wide: bool = False) -> int:
        """The tag of this call's messages, channel 0 (add the channel: ``base | channel``).
        ``wide``: float32 accumulation of a half type (another dtype code: the ranks must agree)."""
        return self.at_call(_identity(collective, dtype, op, root, self.root_bits, wide), call)

    def at_call(self, tag: int, call: int) -> int:
        """``tag``, a tag of call 0, as the same tag of call ``call``."""
        return tag | (call % (1 << self.call_bits)) << (_FIXED + self.root_bits)

    @staticmethod
    def channel(tag: int) -> int:
        return tag & 7

    def later(self, tag: int, call: int) -> bool:
        """Whether ``tag`` is a message of a call after ``call``: a neighbour one call ahead of this
        rank (its messages of the next call may arrive while this rank still waits in ``call``).
        A plan's tag carries its call number modulo PLAN_CALLS only: up to 2 calls ahead count as later."""
        span = PLAN_CALLS if tag & 7 == PLAN else 1 << self.call_bits
        folded = (tag >> (_FIXED + self.root_bits)) % span
        return 0 < (folded - call) % span <= span // 2

    def describe(self, tag: int, near_call: int = 0) -> str:
        """What a tag says, in words, e.g. "reduce_scatter call 7 (float32, sum) data"; the call
        number is the one nearest ``near_call`` with the tag's folded value."""
        if tag & 7 == ABORT:
            return "an abort"
        kind, dt, op = (tag >> 3) & 7, (tag >> 6) & 15, (tag >> 10) & 7
        root = ((tag >> _FIXED) & ((1 << self.root_bits) - 1)) - 1
        span = 1 << self.call_bits
        folded = tag >> (_FIXED + self.root_bits)
        call = near_call + ((folded - near_call + span // 2) % span) - span // 2
        name = COLLECTIVES[kind] if kind < len(COLLECTIVES) else f"collective #{kind}"
        what = [dtype_name(dt)]
        if op < len(_OPS) and _OPS[op] is not None:
            what.append(str(_OPS[op]))
        if root >= 0 and self.root_bits:
            what.append(f"root {root}")
        if tag & 7 == PLAN:  # a plan's persistent requests carry the call number modulo PLAN_CALLS only
            numbered = f"a call numbered {folded % PLAN_CALLS} mod {PLAN_CALLS}"
            return f"{name} ({', '.join(what)}) {CHANNEL_NAMES[PLAN]} of {numbered}"
        return f"{name} call {call} ({', '.join(what)}) {CHANNEL_NAMES[tag & 7]}"


def dtype_code(dtype, wide: bool = False) -> int:
    """The 4-bit dtype field: the index in SUPPORTED_DTYPES, or after them the half types whose
    partial sums are float32 (accumulate="float32": a call ranks must agree on, like the dtype)."""
    if wide:
        return len(SUPPORTED_DTYPES) + HALF_DTYPES.index(dtype)
    return SUPPORTED_DTYPES.index(dtype)


def dtype_name(code: int) -> str:
    """What a dtype field says, e.g. "float16" or "float16, accumulate=float32"."""
    if code < len(SUPPORTED_DTYPES):
        return str(SUPPORTED_DTYPES[code])
    if code - len(SUPPORTED_DTYPES) < len(HALF_DTYPES):
        return f"{HALF_DTYPES[code - len(SUPPORTED_DTYPES)]}, accumulate=float32"
    return f"dtype #{code}"


@functools.lru_cache(maxsize=1024)
def _identity(collective: str, dtype, op: ReduceOp | None, root: int, root_bits: int, wide: bool) -> int:
    t = (COLLECTIVES.index(collective) << 3) | (dtype_code(dtype, wide) << 6) | (_OPS.index(op) << 10)
    return t | ((root + 1) % (1 << root_bits)) << _FIXED
