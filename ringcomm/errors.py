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
    """Ranks called different collectives or gave different arguments: seen in a message's identity
    or size, in the window's call headers, or (``check=True``) in the agreement before any data moves."""


class NotCoResident(RingcommError):
    """The ring kernel's set-up probe (ringcomm.executor): the ranks' blocks did not all run at once.
    Agreed by every rank, before any data moved, so the communicator stays usable (the ring stays
    host-driven)."""


class AbortError(RingcommError):
    """Another rank aborted the communicator while this one was in a collective (abort propagation).

    A rank that fails inside a collective (a timeout, a mismatch, an MPI error) tells both ring
    neighbours, which abort too and pass it on, so every rank raises within milliseconds instead
    of after its own timeout. ``origin``: the rank where the failure started; ``reason``: its
    error; ``collective``, ``step``, ``rank``, ``peer``: what this rank was waiting for.
    """

    def __init__(self, collective: str, step: int | None, rank: int, peer: int, origin: int, reason: str):
        self.collective, self.step, self.rank, self.peer = collective, step, rank, peer
        self.origin, self.reason = origin, reason
        where = "during set-up" if step is None else f"at step {step}"
        super().__init__(
            f"{collective}: rank {rank} stopped {where} (waiting for rank {peer}): rank {origin} aborted the "
            f"communicator: {reason}"
        )
