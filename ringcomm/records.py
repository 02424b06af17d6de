"""Small agreements between ranks (status, signatures, names) over ringcomm's own all-gather.

Each rank contributes a fixed 256-byte record: 8 int64 values and a UTF-8 message of at most
192 bytes. Going through :meth:`Communicator.all_gather` keeps the deadline of every ringcomm wait
(no bare blocking MPI call that could hang when a peer never arrives). Uses only the
Communicator's public ``all_gather`` and ``shard_bounds``; ringcomm.zero and ringcomm.bench share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: Bytes per rank's record (a multiple of the collectives' 16-element alignment).
RECORD = 256
#: int64 values per record.
NINTS = 8
#: UTF-8 bytes of message per record (longer messages are cut).
TEXT_BYTES = RECORD - 8 * NINTS


def exchange(comm: Any, ints: Sequence[int], message: str = "") -> list[tuple[list[int], str]]:
    """All ranks' (ints, message), in rank order; collective. ``ints``: at most 8 integers
    (int64; missing ones read back as 0); ``message`` is cut to 192 bytes."""
    if len(ints) > NINTS:
        raise ValueError(f"at most {NINTS} integers per record; got {len(ints)}")
    rec = np.zeros(RECORD, np.uint8)
    rec[: 8 * NINTS].view(np.int64)[: len(ints)] = np.asarray(ints, np.int64)
    text = message.encode("utf-8", "replace")[:TEXT_BYTES]
    rec[8 * NINTS : 8 * NINTS + len(text)] = np.frombuffer(text, np.uint8)
    table = np.empty(RECORD * comm.size, np.uint8)
    lo, hi = comm.shard_bounds(table.size)[comm.rank]
    table[lo:hi] = rec
    comm.all_gather(table[lo:hi], out=table)
    out = []
    for r in range(comm.size):
        row = table[r * RECORD : (r + 1) * RECORD]
        values = [int(v) for v in row[: 8 * NINTS].view(np.int64)]
        msg = bytes(row[8 * NINTS :]).rstrip(b"\0").decode("utf-8", "replace")
        out.append((values, msg))
    return out
