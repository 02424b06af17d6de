"""The ring follows the topology: RINGCOMM_NODES layouts on host arrays, N = 3..5.

Every collective, op and dtype (the whole families of test_collectives, against MPI and float64
numpy, bitwise identical on all ranks) with each node's ranks adjacent in the ring, so that ring
places and MPI ranks differ; results must keep MPI rank order (shards, roots, all_gather order).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_comm
from mpi4py import MPI
from test_collectives import check_chain_family, check_ring_family

LAYOUTS = {3: ["a,b,c"], 4: ["a,a,b,b", "a,b,a,b"], 5: ["a,a,a,b,b"]}


def rings_of(layout: str) -> tuple[int, ...]:
    labels = layout.split(",")
    return tuple(sorted(range(len(labels)), key=lambda r: (labels.index(labels[r]), r)))


@pytest.mark.parallel(nprocs=[3, 4, 5])
def test_every_collective_under_node_layouts(monkeypatch):
    n = MPI.COMM_WORLD.size
    for layout in LAYOUTS[n]:
        monkeypatch.setenv("RINGCOMM_NODES", layout)
        comm = make_comm()
        labels = layout.split(",")
        assert comm.nodes == tuple(labels)
        assert comm.ring == rings_of(layout), layout
        # each node's ranks adjacent: the ring leaves every node once
        crossings = sum(labels[comm.ring[p - 1]] != labels[comm.ring[p]] for p in range(n))
        assert crossings == len(set(labels))
        p = comm.ring.index(comm.rank)
        assert (comm.left, comm.right) == (comm.ring[p - 1], comm.ring[(p + 1) % n])
        assert comm.node_comm.size == labels.count(labels[comm.rank])
        assert not comm.single_node
        assert comm.transport_name(np.empty(1)) == comm.edge_transport(np.empty(1)) == "mpi"
        check_ring_family()
        check_chain_family()
        comm.close()


@pytest.mark.parallel(nprocs=[2, 4])
def test_one_node_is_mpi_order(monkeypatch):
    monkeypatch.delenv("RINGCOMM_NODES", raising=False)
    comm = make_comm()
    assert comm.ring == tuple(range(comm.size))
    assert comm.single_node and len(set(comm.nodes)) == 1
    monkeypatch.setenv("RINGCOMM_NODES", ",".join(["x"] * comm.size))
    same = make_comm()
    assert same.ring == tuple(range(comm.size)) and same.single_node


@pytest.mark.parallel(nprocs=[2])
def test_bad_node_layouts_fail_at_creation(monkeypatch):
    for bad, why in (("a,b,c", "one node label per rank"), ("a", "one node label per rank"), ("a,", "empty")):
        monkeypatch.setenv("RINGCOMM_NODES", bad)
        with pytest.raises(ValueError, match=f"RINGCOMM_NODES.*{why}"):
            make_comm()
