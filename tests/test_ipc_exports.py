"""The IPC sending half's memory of what it exported (transports.ipc.IpcSend._exports), on fakes.

A call on the arrays of the call before makes no driver query: the address of each array is
remembered with its allocation's handle while that allocation stays pinned. Once the right
neighbour reports the mapping closed and the pin goes, the allocation may be freed and its address
handed to a new one; the next export must then ask the driver again, or the neighbour would map
freed memory. CUDA can reuse addresses; the emulated GPU never does, hence these fakes.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ringcomm.transports import ipc


class FakeDriver:
    """Allocations by base address; every query counted."""

    IPC_CAPABLE, BUFFER_ID = "ipc capable", "buffer id"

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, int]] = {}  # base -> (size, buffer id)
        self.queries = 0

    def _find(self, ptr: int) -> int:
        return next(base for base, (size, _) in self.live.items() if base <= ptr < base + size)

    def attribute(self, ptr: int, attr: str) -> int:
        self.queries += 1
        base = self._find(ptr)
        return 1 if attr == self.IPC_CAPABLE else self.live[base][1]

    def allocation(self, ptr: int) -> tuple[int, int]:
        self.queries += 1
        base = self._find(ptr)
        return base, self.live[base][0]


def handle(buffer_id: int) -> bytes:
    return (b"handle-%d" % buffer_id).ljust(64, b"\0")  # 64 bytes, as CUDA's


def fake_array(ptr: int, nbytes: int) -> SimpleNamespace:
    return SimpleNamespace(data=SimpleNamespace(ptr=ptr), nbytes=nbytes)


def test_exports_are_remembered_only_while_pinned(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(ipc, "_driver", driver)
    comm = SimpleNamespace(size=2, rank=0, right=1, left=1)
    send = ipc.IpcSend(comm)
    ids = iter(range(1, 100))
    runtime = SimpleNamespace(ipcGetMemHandle=lambda base: handle(driver.live[base][1]))
    send._cupy = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime))
    base = 0x7000_0000
    driver.live[base] = (1 << 20, next(ids))
    a = fake_array(base + 256, 4096)

    def describe(x) -> bytes:
        send._describe(x, x, None)
        return send._desc_out[ipc.SRC, 4:].tobytes()

    def pinned_ever_since() -> None:  # every address remembered lies in an allocation pinned now
        assert all(h in send._pins for h, *_ in send._exports.values())

    def released(h: bytes) -> None:  # the right's reply: it closed its mapping of ``h``
        send._reply_in[:] = 0
        send._reply_in[1] = 1
        send._reply_in[3:11] = ipc._words(h)

    assert describe(a) == handle(1) and driver.queries == 3
    assert send._desc_out[ipc.SRC, 1] == 256  # the offset inside the allocation
    assert describe(a) == handle(1) and driver.queries == 3  # remembered: no query
    pinned_ever_since()

    # closed by the right, but described again in the call whose reply says so (it maps it anew):
    # the pin stays, and so does what is remembered
    released(handle(1))
    send._unpin_released(described=True)
    assert describe(a) == handle(1) and driver.queries == 3
    pinned_ever_since()

    # closed, and not described again: the pin goes, and the memory may be freed
    released(handle(1))
    send._unpin_released()
    assert not send._pins and not send._exports
    del driver.live[base]
    driver.live[base] = (1 << 20, next(ids))  # a new allocation at the same address
    b = fake_array(base + 256, 4096)
    assert describe(b) == handle(2) and driver.queries == 6
    assert describe(b) == handle(2) and driver.queries == 6
    pinned_ever_since()

    # closing unpins everything: nothing is remembered after it
    send._reply_in[:] = 0
    send._reply_in[2] = 1
    send._unpin_released()
    assert describe(b) == handle(2) and driver.queries == 9
    assert np.count_nonzero(send._desc_out[ipc.WORK, 4:]) and send._slot_of == {ipc.SRC: ipc.SRC, ipc.WORK: ipc.WORK}
