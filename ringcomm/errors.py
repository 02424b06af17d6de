"""Exceptions raised by ringcomm.

Argument errors are plain ``TypeError`` / ``ValueError`` (raised on the local rank before any
communication). Failures that involve other ranks derive from :class:`RingcommError`.
"""

from __future__ import annotations

import builtins


class RingcommError(RuntimeError):
    """Base class of the errors that involve more than the local rank."""


class TimeoutError(RingcommError, builtins.TimeoutError):  # noqa: A001 - the name is the contract
    """A peer did not answer before the communicator's deadline.

    Attributes name what was waited for: ``collective``, ``step`` (``None`` for set-up waits),
    ``rank`` (this rank), ``peer`` (the rank waited for) and ``timeout`` (seconds).
    """

    def __init__(self, collective: str, step: int | None, rank: int, peer: int, timeout: float, what: str = ""):
        self.collective, self.step, self.rank, self.peer, self.timeout = collective, step, rank, peer, timeout
        where = "during set-up" if step is None else f"at step {step}"
        detail = f" ({what})" if what else ""
        super().__init__(
            f"{collective}: rank {rank} waited {timeout:g} s for rank {peer} {where}{detail}; "
            "the peer is dead, stuck or never joined. The communicator is aborted; create a new one."
        )


class MismatchError(RingcommError):
    """Ranks called different collectives or gave different arguments (``check=True``)."""
