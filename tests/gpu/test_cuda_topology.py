"""A ring over simulated nodes on the GPU: RINGCOMM_NODES with several GPUs per node.

With ``RINGCOMM_NODES=a,a,b,b`` (or ``a,b,a,b``) four ranks form two "nodes" of two ranks; each
rank takes the GPU of its node-local rank (mod the GPU count), as the bench does. Edges inside a
node are CUDA IPC where the receiving GPU can read the sending one (the same GPU, or peer access),
edges between nodes are CUDA-aware MPI or staged: one ring mixes transports. On the emulated GPU
(tests/test_cuda_emulated.py) this is 2 nodes x 2 devices with peer access. Every collective, op
and dtype must stay bitwise the host path's and identical on all ranks.
"""

from __future__ import annotations

import pytest
from conftest import default_gpu_transport, make_comm, require_gpu

cupy, _ngpu = require_gpu()

from test_cuda_collectives import check_every_op_and_dtype  # noqa: E402

from ringcomm.transports.staged import cuda_aware_mpi  # noqa: E402


def expected_edges(comm) -> tuple[str, ...]:
    """Each ring edge's transport by the documented rule, from the layout and the devices."""
    labels = comm.nodes
    local = {r: labels[:r].count(labels[r]) for r in range(comm.size)}  # node-local rank
    device = {r: local[r] % _ngpu for r in range(comm.size)}
    aware = cuda_aware_mpi()
    edges = []
    for p in range(comm.size):
        a, b = comm.ring[p - 1], comm.ring[p]
        if labels[a] != labels[b]:
            edges.append("mpi" if aware else "staged")
        elif device[a] == device[b] or cupy.cuda.runtime.deviceCanAccessPeer(device[b], device[a]):
            edges.append(default_gpu_transport())
        else:
            edges.append("staged")
    if "kernel" in edges and set(edges) != {"kernel"}:  # the ring executor runs whole rings only
        edges = ["ipc" if e == "kernel" else e for e in edges]
    return tuple(edges)


@pytest.mark.parallel(nprocs=[4])
def test_mixed_ring_every_op_and_dtype(monkeypatch):
    for layout in ("a,a,b,b", "a,b,a,b"):
        monkeypatch.setenv("RINGCOMM_NODES", layout)
        comm = make_comm()
        cupy.cuda.Device(comm.node_comm.rank % _ngpu).use()
        x = cupy.ones(1000, cupy.float32)
        comm.all_reduce(x)
        assert (cupy.asnumpy(x) == comm.size).all()
        want = expected_edges(comm)
        link = comm._transport("cuda")
        assert link.edges == want, (layout, link.edges)
        p = comm.position
        assert comm.edge_transport(x) == want[p]
        assert comm.transport_name(x) == (want[0] if len(set(want)) == 1 else "mixed")
        assert len(set(want)) > 1 or _ngpu > 1 and not cupy.cuda.runtime.deviceCanAccessPeer(0, 1), want
        check_every_op_and_dtype([None])
        comm.close()
    cupy.cuda.Device(0).use()
