"""Which transport each edge of the ring gets for GPU arrays (no GPU needed): the rule on the
ranks' records, RINGCOMM_TRANSPORT, and the CUDA-aware-MPI probe and its override."""

from __future__ import annotations

import warnings

import pytest

from ringcomm import transports
from ringcomm.errors import MismatchError
from ringcomm.transports import staged


def rec(node=0, gpu=0, peers=(), aware=False, forced=""):
    return transports.PeerRecord(node, gpu, frozenset(peers), aware, forced)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("RINGCOMM_TRANSPORT", raising=False)
    monkeypatch.delenv("RINGCOMM_CUDA_AWARE_MPI", raising=False)


def test_edge_kind_automatic_choice():
    kind = transports.edge_kind
    assert kind(rec(gpu=1), rec(gpu=1), "") == "ipc"  # one GPU shared by two ranks
    assert kind(rec(gpu=1), rec(gpu=2, peers={1}), "") == "ipc"  # the receiver reads the sender's GPU
    assert kind(rec(gpu=1), rec(gpu=2), "") == "staged"  # no peer access: through host memory
    assert kind(rec(gpu=1, peers={2}), rec(gpu=2), "") == "staged"  # the receiver is the one that reads
    assert kind(rec(gpu=1, aware=True), rec(gpu=2, aware=True), "") == "mpi"
    assert kind(rec(node=0, gpu=1), rec(node=1, gpu=1, peers={1}), "") == "staged"  # other node, same bus id
    assert kind(rec(node=0, aware=True), rec(node=1, aware=True), "") == "mpi"
    assert kind(rec(node=0, aware=True), rec(node=1, aware=False), "") == "staged"


def test_edge_kind_forced():
    kind = transports.edge_kind
    assert kind(rec(), rec(), "staged") == "staged"
    assert kind(rec(), rec(), "ipc") == "ipc"
    assert kind(rec(node=0), rec(node=1), "ipc") == "staged"  # ipc only where it can serve
    assert kind(rec(node=0, aware=True), rec(node=1, aware=True), "ipc") == "mpi"
    assert kind(rec(aware=True), rec(aware=True), "mpi") == "mpi"
    with pytest.raises(ValueError, match="CUDA-aware"):
        kind(rec(aware=True), rec(aware=False), "mpi")


def test_choose_edges_two_nodes_of_two_gpus():
    # ranks 0..3 on nodes a,b,a,b; on each node two GPUs that can access each other
    records = [rec(node=i % 2, gpu=10 + i // 2, peers={10, 11} - {10 + i // 2}) for i in range(4)]
    ring = (0, 2, 1, 3)
    edges = transports.choose_edges(records, ring)
    # edge p is ring[p-1] -> ring[p]: 3 -> 0 leaves node b, 0 -> 2 inside a, 2 -> 1 leaves a, 1 -> 3 inside b
    assert edges == ("staged", "ipc", "staged", "ipc")
    assert transports.describe_edges(ring, edges) == "0 -ipc-> 2 -staged-> 1 -ipc-> 3 -staged-> (0)"
    no_peer = [rec(node=i % 2, gpu=10 + i // 2) for i in range(4)]
    assert transports.choose_edges(no_peer, ring) == ("staged",) * 4
    assert transports.choose_edges([rec()], (0,)) == ("ipc",)


def test_ranks_must_agree_on_the_forced_transport():
    with pytest.raises(MismatchError, match="RINGCOMM_TRANSPORT.*rank 1: staged"):
        transports.choose_edges([rec(), rec(forced="staged")], (0, 1))


def test_peer_record_words_round_trip_and_bus_ids():
    r = rec(node=3, gpu=transports.bus_id("0000:1b:00.0"), peers={5, 7}, aware=True, forced="ipc")
    assert transports.PeerRecord.from_words(r.words()) == r
    assert transports.PeerRecord.from_words(rec().words()) == rec()
    k = transports.PeerRecord(1, 2, frozenset({3}), False, "kernel", 132, True)
    assert transports.PeerRecord.from_words(k.words()) == k
    assert transports.bus_id("0000:00:00.0") == 0
    assert transports.bus_id("0001:0a:1f.3") == (1 << 24) | (0x0A << 16) | (0x1F << 8) | 3
    assert transports.bus_id("0000:0a:00.0") != transports.bus_id("0000:0b:00.0")


def test_environment_override_names(monkeypatch):
    assert transports.override() == ""
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "Staged")
    assert transports.override() == "staged"
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "ipc-stream")  # (removed: the ring kernel replaced it)
    monkeypatch.setattr(transports, "_renamed_warned", set())
    with pytest.warns(FutureWarning, match="ipc-stream was removed; it now selects 'kernel'"):
        assert transports.override() == "kernel"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert transports.override() == "kernel"  # (warned once per process)
    monkeypatch.setenv("RINGCOMM_TRANSPORT", "nccl")
    with pytest.raises(ValueError, match="RINGCOMM_TRANSPORT"):
        transports.override()


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


def test_kernel_fit_needs_mps_to_share_a_gpu_and_an_sm_per_block():
    """executor.kernel_fit: the ring kernel's channels, the same on every rank (at most half a lone
    rank's SMs, one SM per block of every rank on a GPU, at most CHANNELS), or why not."""
    from ringcomm.executor import CHANNELS, kernel_fit

    def k(node=0, gpu=0, sms=132, mps=True):
        return transports.PeerRecord(node, gpu, frozenset(), False, "kernel", sms, mps)

    assert kernel_fit([k(gpu=1), k(gpu=2)]) == (CHANNELS, "")  # a GPU each
    assert kernel_fit([k(), k()]) == (CHANNELS, "")  # one H100 under MPS
    assert kernel_fit([k(sms=5), k(sms=5)]) == (2, "")
    assert kernel_fit([k(sms=5)] * 5) == (1, "")
    assert kernel_fit([k(gpu=1, sms=16), k(gpu=2, sms=6)]) == (3, "")  # the smaller GPU sets every rank's
    channels, why = kernel_fit([k(sms=5)] * 6)
    assert channels == 0 and "GPU 0000:00:00.0 of node 0 has 5 SMs" in why and "6 rank(s)" in why
    channels, why = kernel_fit([k(), k(mps=False), k(gpu=1, mps=False)])
    assert channels == 0 and "ranks 0, 1 share GPU 0000:00:00.0 of node 0, rank(s) 1 not under MPS" in why
    assert kernel_fit([k(gpu=1, mps=False), k(gpu=2, mps=False)]) == (CHANNELS, "")  # no GPU shared: no MPS needed
    bus = transports.bus_id("0001:0a:1f.3")
    assert "GPU 0001:0a:1f.3 of node 2" in kernel_fit([k(node=2, gpu=bus, sms=1)])[1]


def test_one_shot_needs_every_rank_to_reach_every_other():
    """executor.all_reach: a one-shot call writes into every rank's memory, so every GPU must map every
    other's (the same GPU, or peer access from it, on one node); a ring kernel needs only its edges."""
    from ringcomm.executor import all_reach

    assert all_reach([rec(gpu=1), rec(gpu=1), rec(gpu=1)])  # one GPU shared
    assert all_reach([rec(gpu=1, peers={2, 3}), rec(gpu=2, peers={1, 3}), rec(gpu=3, peers={1, 2})])
    # a ring 1 -> 2 -> 3 -> 1 whose every edge maps, but 2 cannot reach 3's memory
    assert not all_reach([rec(gpu=1, peers={2, 3}), rec(gpu=2, peers={1}), rec(gpu=3, peers={1, 2})])
    assert not all_reach([rec(node=0, gpu=1), rec(node=1, gpu=1)])  # another node, the same bus id
