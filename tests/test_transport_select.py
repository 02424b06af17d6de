"""Which transport GPU arrays get (no GPU needed): the automatic choice, RINGCOMM_TRANSPORT, the
CUDA-aware-MPI probe and its override, and the IPC transport's collective fallback decision."""

from __future__ import annotations

import logging
import types

import pytest

from ringcomm import transports
from ringcomm.transports import ipc, staged
from ringcomm.transports.mpi import MpiTransport


def stub(single_node: bool, size: int = 2):
    return types.SimpleNamespace(rank=0, size=size, left=size - 1, right=1 % size, single_node=single_node,
                                 slice_bytes=1 << 20, mpi=None, timeout=5.0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("RINGCOMM_TRANSPORT", raising=False)
    monkeypatch.delenv("RINGCOMM_CUDA_AWARE_MPI", raising=False)


def test_automatic_choice(monkeypatch, caplog):
    with caplog.at_level(logging.DEBUG, logger="ringcomm"):
        assert isinstance(transports.select(stub(True), "cuda"), ipc.IpcTransport)
    assert any("cuda transport" in r.getMessage() and ": ipc" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "0")
    assert isinstance(transports.select(stub(False), "cuda"), staged.StagedTransport)
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "1")
    t = transports.select(stub(False), "cuda")
    assert isinstance(t, MpiTransport) and t.name == "mpi"
    assert isinstance(transports.select(stub(True, size=1), "cuda"), ipc.IpcTransport)
    assert isinstance(transports.select(stub(True), "host"), MpiTransport)


def test_environment_overrides(monkeypatch):
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "staged")
    assert isinstance(transports.select(stub(True), "cuda"), staged.StagedTransport)
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "ipc")
    assert isinstance(transports.select(stub(False), "cuda"), ipc.IpcTransport)
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "mpi")
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "0")
    with pytest.raises(ValueError, match="CUDA-aware"):
        transports.select(stub(True), "cuda")
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "1")
    assert isinstance(transports.select(stub(True), "cuda"), MpiTransport)
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="RINGCOMM_TRANSPORT"):
        transports.select(stub(True), "cuda")


def test_cuda_aware_probe(monkeypatch):
    # without the variable the library's own answer (a bool, whatever this MPI is); with it, the variable
    assert staged.cuda_aware_mpi() is staged._query_library()
    assert isinstance(staged._query_library(), bool)
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "0")
    assert staged.cuda_aware_mpi() is False
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "yes")
    assert staged.cuda_aware_mpi() is True
    monkeypatch.setenv("RINGCOMM_CUDA_AWARE_MPI", "maybe")
    with pytest.raises(ValueError, match="RINGCOMM_CUDA_AWARE_MPI"):
        staged.cuda_aware_mpi()


def test_slices():
    assert staged.slices(0, 4) == []
    assert staged.slices(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert staged.slices(8, 4) == [(0, 4), (4, 8)]
