"""ringcomm-bench on the emulated GPU, NCCL baseline included (issue 8, items 1 and 7).

``mpiexec -n 2 python -m ringcomm.bench --device cuda --impl ringcomm,nccl,mpi`` runs end to end
through the CuPy stand-in (tests/emulated: kernels through tests/csrc_harness.cpp, and
``cupy.cuda.nccl`` with CuPy 14's signatures, backed by MPI). Rank 0's output is parsed as a person
reads it: NCCL has rows in every table and every row is checked (#wrong 0); an emulated NCCL that
writes wrong values has exactly those counted, and the exit status says so; the two ranks share the
one emulated GPU, so NCCL's rows are marked as time-sliced; an NCCL older than 2.30 refuses the
shared GPU, and the header says so with its version. The single-process tests below check the id's
two forms (CuPy 14's bytes, older CuPy's tuple of chars) against narrow fakes of both APIs.
Skipped without a C++ compiler or mpiexec, and where a real CuPy is installed.
"""

from __future__ import annotations

import json
import os

import pytest
from conftest import TEST_TIMEOUT, run_emulated, why_not_emulated
from mpi4py import MPI

import ringcomm
from ringcomm import schedule
from ringcomm.bench import impls
from ringcomm.bench.report import parse_tables

SWEEP = ["-b", "512", "-e", "4K", "-f", "8", "-n", "2", "-w", "1"]
emulated_gpu = pytest.mark.skipif(bool(why_not_emulated()), reason=why_not_emulated() or "runs")


@pytest.fixture(scope="module")
def gpu_env(emulated_gpu_env):
    """The emulated GPU's environment, without the variables these runs set themselves."""
    env = dict(emulated_gpu_env)
    env["RINGCOMM_TIMEOUT"] = str(int(TEST_TIMEOUT))
    for name in (
        "NCCL_MULTI_RANK_GPU_ENABLE",
        "RINGCOMM_EMULATED_NCCL_VERSION",
        "RINGCOMM_EMULATED_NCCL_CORRUPT",
        "CUDA_MPS_PIPE_DIRECTORY",
    ):
        env.pop(name, None)
    return env


def _bench(env: dict, args: list[str], **extra: str) -> tuple[int, str, str]:
    cmd = [
        "mpiexec",
        "-n",
        "2",
        "python",
        "-m",
        "ringcomm.bench",
        "--device",
        "cuda",
        "--impl",
        "ringcomm,nccl,mpi",
        "--timeout",
        "60",
        *args,
    ]
    run = run_emulated({**env, **extra}, cmd, 240)
    return run.returncode, run.stdout, run.stderr


def _measured(row: dict) -> list[dict]:
    return [row[m] for m in ("out-of-place", "in-place") if row[m]["time"] is not None]


def _header(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#")]


@emulated_gpu
def test_nccl_rows_run_and_are_checked(gpu_env, tmp_path):
    path = tmp_path / "bench.json"
    rc, out, err = _bench(gpu_env, ["-c", "all", *SWEEP, "--json", str(path)])
    assert rc == 0, out[-3000:] + err[-3000:]
    head = _header(out)
    assert not [h for h in head if "NCCL could not run" in h], head
    assert any(h.startswith("# Versions:") and "NCCL 2.30.7" in h for h in head), head
    assert (
        "# nccl*: 2 ranks time-slice one GPU without MPS; NCCL's kernels spin, so its times are not those of "
        "separate GPUs"
    ) in head
    tables = parse_tables(out)
    assert len(tables) == len(schedule.COLLECTIVES)
    for coll, table in zip(schedule.COLLECTIVES, tables):
        assert table.status == "OK" and table.wrong == 0, coll
        assert {r["impl"] for r in table.rows} == {"ringcomm", "nccl*", "mpi"}, coll
        nccl = [r for r in table.rows if r["impl"] == "nccl*"]
        assert len(nccl) == 2 and all(len(_measured(r)) == 2 for r in nccl), (coll, nccl)  # both modes
        for row in table.rows:
            for group in _measured(row):
                assert group["#wrong"] == 0 and group["time"] > 0, (coll, row)
    doc = json.loads(path.read_text())
    assert set(doc["environment"]["footnotes"]) == {"nccl*"}
    assert doc["environment"]["versions"]["NCCL"] == "2.30.7"
    marks = {(r["impl"], r["mark"]) for r in doc["rows"]}
    assert marks == {("ringcomm", ""), ("nccl", "*"), ("mpi", "")}

    # every type and op NCCL has, on all_reduce: checked the same way
    rc, out, err = _bench(
        gpu_env, ["-c", "all_reduce", "-d", "all", "-o", "all", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"]
    )
    assert rc == 0, out[-3000:] + err[-3000:]
    (table,) = parse_tables(out)
    nccl = [r for r in table.rows if r["impl"] == "nccl*" and _measured(r)]
    assert {r["type"] for r in nccl} == {
        "int8",
        "uint8",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "half",
        "float",
        "double",
        "bfloat16",
    }
    assert len(nccl) == 4 * 10 + 4  # sum, prod, min, max on each type; avg on the 4 floating types
    assert all(g["#wrong"] == 0 for r in nccl for g in _measured(r)) and table.wrong == 0


@emulated_gpu
def test_wrong_nccl_results_are_counted(gpu_env):
    """An NCCL that writes one wrong element per rank and call: each NCCL row counts exactly the
    ranks whose result NCCL wrote (reduce: the root only), nothing else is wrong, and the run fails."""
    rc, out, err = _bench(gpu_env, ["-c", "all", *SWEEP], RINGCOMM_EMULATED_NCCL_CORRUPT="1")
    assert rc == 1, out[-3000:] + err[-3000:]
    tables = parse_tables(out)
    assert len(tables) == len(schedule.COLLECTIVES)
    for coll, table in zip(schedule.COLLECTIVES, tables):
        writers = 1 if coll == "reduce" else 2
        planted = 0
        for row in table.rows:
            for group in _measured(row):
                expected = writers if row["impl"] == "nccl*" else 0
                assert group["#wrong"] == expected, (coll, row)
                planted += expected
        assert table.status == "FAILED" and table.wrong == planted > 0, coll


@pytest.mark.parametrize(
    "extra, reason",
    [
        (
            {"RINGCOMM_EMULATED_NCCL_VERSION": "2.27.7"},
            "2 ranks share a GPU here, which NCCL before 2.30 refuses "
            "(NCCL_MULTI_RANK_GPU_ENABLE needs NCCL 2.30 or later)",
        ),
        (
            {"NCCL_MULTI_RANK_GPU_ENABLE": "0"},
            "2 ranks share a GPU here, and NCCL_MULTI_RANK_GPU_ENABLE=0 (1 allows it)",
        ),
    ],
    ids=["NCCL 2.27", "disabled"],
)
@emulated_gpu
def test_nccl_refusing_a_shared_gpu_is_a_note_with_its_version(gpu_env, extra, reason):
    rc, out, err = _bench(gpu_env, ["-c", "all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"], **extra)
    assert rc == 0, out[-3000:] + err[-3000:]
    version = extra.get("RINGCOMM_EMULATED_NCCL_VERSION", "2.30.7")
    notes = [h for h in _header(out) if "nccl: NCCL could not run" in h]
    assert len(notes) == 1, _header(out)
    assert notes[0] == (
        f"#   nccl: NCCL could not run: NCCL {version}: ncclCommInitRank failed on rank 0 (NcclError: "
        "NCCL_ERROR_INVALID_USAGE: invalid usage (run with NCCL_DEBUG=WARN for details)); " + reason
    )
    assert any(h.startswith("# Versions:") and f"NCCL {version}" in h for h in _header(out))
    (table,) = parse_tables(out)
    assert {r["impl"] for r in table.rows} == {"ringcomm", "mpi"} and table.wrong == 0


# ------------------------------------------------------------------- the id's two forms, one rank


def test_unique_id_forms_round_trip():
    to_bytes, to_form = impls.unique_id_bytes, impls.unique_id_for
    raw = bytes(range(64, 192))  # bytes above 127 too: the sign matters
    assert to_bytes(raw) == (raw, impls.ID_BYTES) and to_form(raw, impls.ID_BYTES) == raw
    signed = tuple(b - 256 if b > 127 else b for b in raw)  # CuPy 13 on x86: C char is signed
    assert to_bytes(signed) == (raw, impls.ID_SIGNED) and to_form(raw, impls.ID_SIGNED) == signed
    unsigned = tuple(raw)  # CuPy 13 on ARM
    assert to_bytes(unsigned) == (raw, impls.ID_UNSIGNED) and to_form(raw, impls.ID_UNSIGNED) == unsigned
    for bad in (raw[:64], tuple(range(129)), (300,) * 128):
        with pytest.raises(ValueError):
            to_bytes(bad)


class _FakeNccl:
    """A narrow fake of ``cupy.cuda.nccl``: CuPy 14 (``get_unique_id() -> bytes``, ``NcclCommunicator``
    typed ``bytes commId``, length checked) or CuPy 13 (a tuple of signed chars, ``tuple commId``,
    ``assert len(commId) == 128``)."""

    def __init__(self, cupy14: bool, version: int = 23007, fail: Exception | None = None) -> None:
        self.cupy14, self.version, self.fail = cupy14, version, fail
        self.got: list = []
        fake = self

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                want = bytes if fake.cupy14 else tuple
                if not isinstance(commId, want):
                    raise TypeError(
                        f"Argument 'commId' has incorrect type (expected {want.__name__}, got {type(commId).__name__})"
                    )
                if fake.cupy14 and len(commId) != 128:
                    raise ValueError("commId must be 128 bytes long")
                assert len(commId) == 128
                if not fake.cupy14 and any(not -128 <= v <= 127 for v in commId):
                    raise OverflowError("value too large to convert to char")
                if fake.fail is not None:
                    raise fake.fail
                fake.got.append(commId)

            def destroy(self):
                pass

        self.NcclCommunicator = NcclCommunicator

    def get_version(self) -> int:
        return self.version

    def get_unique_id(self):
        raw = bytes((7 * i + 200) % 256 for i in range(128))  # has bytes > 127: the sign matters
        return raw if self.cupy14 else tuple(b - 256 if b > 127 else b for b in raw)


@pytest.mark.parametrize("cupy14", [True, False], ids=["CuPy 14 bytes", "CuPy 13 tuple"])
def test_nccl_gets_the_id_in_the_form_of_its_cupy(cupy14):
    comm = ringcomm.Communicator(MPI.COMM_SELF, timeout=TEST_TIMEOUT)
    fake = _FakeNccl(cupy14)
    try:
        impl, why = impls.NcclImpl.create(comm, None, fake, None, 1)
        assert why == "" and impl is not None and impl.version == "2.30.7" and impl.mark == ""
        assert fake.got == [fake.get_unique_id()]
        impl.close()
    finally:
        comm.close()


def test_nccl_errors_are_a_note_with_version_and_reason():
    comm = ringcomm.Communicator(MPI.COMM_SELF, timeout=TEST_TIMEOUT)
    fake = _FakeNccl(True, version=22707, fail=RuntimeError("NCCL_ERROR_SYSTEM_ERROR: unhandled system error"))
    try:
        impl, why = impls.NcclImpl.create(comm, None, fake, None, 1)
        assert impl is None
        assert why == (
            "NCCL 2.27.7: ncclCommInitRank failed on rank 0 (RuntimeError: NCCL_ERROR_SYSTEM_ERROR: "
            "unhandled system error)"
        )
    finally:
        comm.close()


def test_time_sliced_nccl_is_marked():
    before = os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
    comm = ringcomm.Communicator(MPI.COMM_SELF, timeout=TEST_TIMEOUT)
    try:
        sliced = (
            "nccl*: 3 ranks time-slice one GPU without MPS; NCCL's kernels spin, so its times are not those "
            "of separate GPUs"
        )
        mps = (
            "nccl*: 3 ranks share one GPU through MPS (control pipe in /tmp/nvidia-mps); its times are not those "
            "of separate GPUs"
        )
        for how, text in ((None, sliced), ("control pipe in /tmp/nvidia-mps", mps)):
            impl, why = impls.NcclImpl.create(comm, None, _FakeNccl(True), None, 3, how)
            assert why == "" and impl.mark == "*" and impl.footnote == text
            assert os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] == "1"
            impl.close()
    finally:
        comm.close()
        os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
        if before is not None:
            os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = before


@emulated_gpu
def test_bench_shows_the_ring_and_every_edge_transport(gpu_env, tmp_path):
    """4 ranks as 2 simulated nodes x 2 emulated GPUs (peer access): IPC inside each node, staged
    between them; the header and the JSON name the ring and each edge's transport."""
    path = tmp_path / "bench.json"
    cmd = [
        "mpiexec",
        "-n",
        "4",
        "python",
        "-m",
        "ringcomm.bench",
        "--device",
        "cuda",
        "--impl",
        "ringcomm,mpi",
        "--timeout",
        "60",
        "-c",
        "all_reduce",
        *SWEEP,
        "--json",
        str(path),
    ]
    env = {
        **gpu_env,
        "RINGCOMM_NODES": "a,a,b,b",
        "RINGCOMM_EMULATED_DEVICES": "2",
        "RINGCOMM_EMULATED_PEER_ACCESS": "all",
    }
    run = run_emulated(env, cmd, 240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    head = _header(run.stdout)
    assert head[0].endswith("transport mixed"), head
    assert "# Ring: 0 -ipc-> 1 -staged-> 2 -ipc-> 3 -staged-> (0)  (nodes: a,a,b,b)" in head, head
    (table,) = parse_tables(run.stdout)
    assert table.status == "OK" and table.wrong == 0
    doc = json.loads(path.read_text())["environment"]
    assert doc["ring"] == [0, 1, 2, 3] and doc["node_labels"] == ["a", "a", "b", "b"]
    assert doc["transport"] == "mixed"
    assert [(e["from"], e["to"], e["transport"]) for e in doc["edges"]] == [
        (3, 0, "staged"),
        (0, 1, "ipc"),
        (1, 2, "staged"),
        (2, 3, "ipc"),
    ]
