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

The NCCL library a user names (issue 33, item 11: ``--nccl-lib PATH`` or RINGCOMM_NCCL_LIB) is a
stand-in built here: a shared library whose SONAME is libnccl.so.2 and whose only export,
``ncclGetVersion``, returns a chosen version. The bench loads it, reads that version, and compares
it with what the emulated ``cupy.cuda.nccl`` reports (RINGCOMM_EMULATED_NCCL_VERSION): equal, as
when CuPy's bindings bound to the named library, the header names it; different, as when CuPy kept
its own, the run stops with an error before any NCCL call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import CXX, TEST_TIMEOUT, run_emulated, why_not_emulated
from mpi4py import MPI

import ringcomm
from ringcomm import schedule
from ringcomm.bench import env as bench_env
from ringcomm.bench import impls
from ringcomm.bench.__main__ import Plan, build_parser
from ringcomm.bench.cli import UsageError
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
        "RINGCOMM_NCCL_LIB",
    ):
        env.pop(name, None)
    return env


#: a stand-in NCCL library: ncclGetVersion (NCCL's signature) returns NCCL_CODE, or STATUS when it is not 0
_FAKE_NCCL = r"""
extern "C" int ncclGetVersion(int *version) {
    if (!version) return 4; /* ncclInvalidArgument */
    if (STATUS) return STATUS;
    *version = NCCL_CODE;
    return 0;
}
"""


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory) -> dict[str, str]:
    """Stand-in libraries, by name: "2.30.7" (ncclGetVersion gives 23007, SONAME libnccl.so.2), "failing" (it
    returns ncclInvalidUsage), "not nccl" (no ncclGetVersion), "text" (not a shared library)."""
    if CXX is None:
        pytest.skip("no C++ compiler")
    root = tmp_path_factory.mktemp("nccl")
    source = root / "fake_nccl.cpp"
    source.write_text(_FAKE_NCCL)
    other = root / "other.cpp"
    other.write_text('extern "C" int ncclSomethingElse(void) { return 0; }\n')
    libs = {}
    for name, folder, src, flags in (
        ("2.30.7", "v23007", source, ["-DNCCL_CODE=23007", "-DSTATUS=0"]),
        ("failing", "failing", source, ["-DNCCL_CODE=23007", "-DSTATUS=5"]),
        ("not nccl", "other", other, []),
    ):
        (root / folder).mkdir()
        lib = root / folder / "libnccl.so.2"
        cmd = [CXX, "-shared", "-fPIC", *flags, "-Wl,-soname,libnccl.so.2", str(src), "-o", str(lib)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        libs[name] = str(lib)
    libs["text"] = str(root / "libnccl-text.so.2")
    (root / "libnccl-text.so.2").write_text("not an ELF file\n")
    return libs


def _bench(env: dict, args: list[str], impl: str = "ringcomm,nccl,mpi", **extra: str) -> tuple[int, str, str]:
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
        impl,
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
    assert "# NCCL library: CuPy's own, 2.30.7 (--nccl-lib PATH or RINGCOMM_NCCL_LIB=PATH loads another)" in head
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
    assert doc["environment"]["nccl_library"]["path"] is None and doc["settings"]["nccl_lib"] is None
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


# ------------------------------------------------------------------------------ the NCCL named


@pytest.mark.parametrize("how", ["RINGCOMM_NCCL_LIB", "--nccl-lib"])
@emulated_gpu
def test_named_nccl_library_is_loaded_checked_and_shown(gpu_env, fake_nccl, tmp_path, how):
    """The library named is loaded, its ncclGetVersion read and compared with cupy.cuda.nccl's, and the
    header and the JSON name it. --nccl-lib wins over RINGCOMM_NCCL_LIB (which here names no file)."""
    lib, path = fake_nccl["2.30.7"], tmp_path / "bench.json"
    args = ["-c", "all_reduce", "-b", "1K", "-e", "4K", "-f", "4", "-n", "1", "-w", "0", "--json", str(path)]
    if how == "--nccl-lib":
        rc, out, err = _bench(gpu_env, ["--nccl-lib", lib, *args], RINGCOMM_NCCL_LIB=str(tmp_path / "absent.so"))
    else:
        rc, out, err = _bench(gpu_env, args, RINGCOMM_NCCL_LIB=lib)
    assert rc == 0, out[-3000:] + err[-3000:]
    head = _header(out)
    line = f"# NCCL library: {lib} ({how}), ncclGetVersion 2.30.7; cupy.cuda.nccl uses it (reports 2.30.7)"
    assert line in head, head
    assert head.index(line) == next(i for i, h in enumerate(head) if h.startswith("# MPI library:")) + 1
    (table,) = parse_tables(out)
    assert table.status == "OK" and table.wrong == 0
    nccl = [r for r in table.rows if r["impl"] == "nccl*"]
    assert len(nccl) == 2 and all(len(_measured(r)) == 2 for r in nccl), table.rows
    doc = json.loads(path.read_text())
    assert doc["environment"]["nccl_library"] == {
        "path": lib,
        "named_by": how,
        "version": "2.30.7",
        "line": line[len("# NCCL library: ") :],
    }
    assert doc["settings"]["nccl_lib"] == lib


@emulated_gpu
def test_nccl_other_than_the_one_named_is_an_error_before_any_nccl_call(gpu_env, fake_nccl):
    """CuPy's nccl reports 2.28.9 while the library named is 2.30.7 (as when CuPy's bindings were bound to
    its own NCCL): every rank stops with exit status 2 and one clear error, before the header and before
    any NCCL communicator exists."""
    lib = fake_nccl["2.30.7"]
    rc, out, err = _bench(
        gpu_env,
        ["-c", "all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"],
        RINGCOMM_NCCL_LIB=lib,
        RINGCOMM_EMULATED_NCCL_VERSION="2.28.9",
        NCCL_DEBUG="INFO",
    )
    assert rc == 2, out[-3000:] + err[-3000:]
    assert out.strip() == "", out
    errors = [line for line in err.splitlines() if line.startswith("ringcomm-bench: error:")]
    assert errors == [
        f"ringcomm-bench: error: RINGCOMM_NCCL_LIB {lib} is NCCL 2.30.7 (its ncclGetVersion), but cupy.cuda.nccl "
        "reports NCCL 2.28.9: CuPy's NCCL bindings use another library (they bind to the first library loaded "
        "whose SONAME is libnccl.so.2: see this one's with readelf -d); no NCCL row runs on an NCCL other than "
        "the one named (and 1 other rank)"
    ], err
    assert "emulated NCCL WARN" not in err and "Traceback" not in err, err


@emulated_gpu
def test_a_named_nccl_that_cannot_be_loaded_is_an_error_naming_it(gpu_env, fake_nccl, tmp_path):
    missing = tmp_path / "nowhere" / "libnccl.so.2"
    for extra, want in (
        ({"RINGCOMM_NCCL_LIB": str(missing)}, f"RINGCOMM_NCCL_LIB {missing}: no such file (and 1 other rank)"),
        ({"RINGCOMM_NCCL_LIB": fake_nccl["not nccl"]}, "(it exports no ncclGetVersion)"),
    ):
        rc, out, err = _bench(gpu_env, ["-c", "all_reduce", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0"], **extra)
        assert rc == 2 and out.strip() == "", out[-3000:] + err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("ringcomm-bench: error:")]
        assert len(errors) == 1 and want in errors[0], err


#: loads each library of argv[1] (JSON: [path, named by, "late" or ""]) as the bench does, in order; prints
#: each outcome (JSON), and the libnccl files then mapped
_LOAD = """
import json, sys
from ringcomm.bench import env

out = []
for path, named_by, late in json.loads(sys.argv[1]):
    if late:  # as if CuPy's NCCL bindings had been imported first
        sys.modules["cupy.cuda.nccl"] = object()
    try:
        lib = env.load_nccl_library(path, named_by)
        out.append({"path": lib.path, "named_by": lib.named_by, "code": lib.code, "late": lib.late})
    except env.NcclLibraryError as e:
        out.append({"error": str(e)})
print(json.dumps({"outcomes": out, "mapped": env.mapped_nccl_paths()}))
"""


def test_loading_a_named_nccl_library(fake_nccl, tmp_path):
    """load_nccl_library, in a process of its own (what it loads stays loaded, RTLD_GLOBAL): the version the
    library's own ncclGetVersion gives, the path made absolute, and an error naming the path for everything that
    is not a working NCCL."""
    good = fake_nccl["2.30.7"]
    cases = [
        ([good, "--nccl-lib", ""], {"path": good, "named_by": "--nccl-lib", "code": 23007, "late": False}),
        ([os.path.relpath(good, tmp_path), "RINGCOMM_NCCL_LIB", ""], {"path": good, "named_by": "RINGCOMM_NCCL_LIB"}),
        ([str(tmp_path / "absent.so"), "--nccl-lib", ""], f"--nccl-lib {tmp_path / 'absent.so'}: no such file"),
        ([str(tmp_path), "--nccl-lib", ""], f"--nccl-lib {tmp_path}: not a file"),
        ([fake_nccl["text"], "--nccl-lib", ""], f"--nccl-lib {fake_nccl['text']}: cannot be loaded ("),
        (
            [fake_nccl["not nccl"], "--nccl-lib", ""],
            f"--nccl-lib {fake_nccl['not nccl']}: not an NCCL library (it exports no ncclGetVersion)",
        ),
        (
            [fake_nccl["failing"], "--nccl-lib", ""],
            f"--nccl-lib {fake_nccl['failing']}: ncclGetVersion failed (ncclResult_t 5, version 0)",
        ),
        ([good, "--nccl-lib", "late"], {"path": good, "code": 23007, "late": True}),  # after CuPy's bindings
    ]
    run = subprocess.run(
        [sys.executable, "-c", _LOAD, json.dumps([args for args, _ in cases])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    for (args, want), got in zip(cases, result["outcomes"], strict=True):
        if isinstance(want, str):
            assert got.get("error", "").startswith(want), (args, got)
        else:
            assert want.items() <= got.items(), (args, got)
    assert good in result["mapped"]


def test_a_library_other_than_cupys_nccl_is_a_mismatch():
    lib = bench_env.NcclLibrary("/opt/nccl/libnccl.so.2", "--nccl-lib", 23007)
    assert lib.version == "2.30.7" and lib.mismatch(_FakeNccl(True, version=23007)) == ""
    assert lib.mismatch(_FakeNccl(True, version=22809)) == (
        "--nccl-lib /opt/nccl/libnccl.so.2 is NCCL 2.30.7 (its ncclGetVersion), but cupy.cuda.nccl reports NCCL "
        "2.28.9: CuPy's NCCL bindings use another library (they bind to the first library loaded whose SONAME is "
        "libnccl.so.2: see this one's with readelf -d); no NCCL row runs on an NCCL other than the one named"
    )
    late = bench_env.NcclLibrary("/opt/nccl/libnccl.so.2", "RINGCOMM_NCCL_LIB", 23007, late=True)
    assert "(they were imported before it was loaded)" in late.mismatch(_FakeNccl(True, version=22809))
    broken = _FakeNccl(True)

    def get_version() -> int:
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR")

    broken.get_version = get_version
    assert lib.mismatch(broken) == "cupy.cuda.nccl.get_version() failed (RuntimeError: NCCL_ERROR_SYSTEM_ERROR)"


def test_nccl_lib_option_wins_over_the_environment(monkeypatch):
    def named(*argv: str):
        return Plan.from_args(build_parser().parse_args(list(argv))).nccl_lib

    monkeypatch.delenv("RINGCOMM_NCCL_LIB", raising=False)
    assert named() is None
    monkeypatch.setenv("RINGCOMM_NCCL_LIB", "  ")
    assert named() is None  # blank: CuPy's own
    monkeypatch.setenv("RINGCOMM_NCCL_LIB", "/env/libnccl.so.2")
    assert named() == ("/env/libnccl.so.2", "RINGCOMM_NCCL_LIB")
    assert named("--nccl-lib", "/opt/libnccl.so.2") == ("/opt/libnccl.so.2", "--nccl-lib")
    with pytest.raises(UsageError, match="--nccl-lib needs the path of an NCCL library"):
        named("--nccl-lib", "")


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


@emulated_gpu
def test_ring_kernel_is_a_header_line_saying_its_one_shot_crossover_or_why_not(gpu_env):
    """RINGCOMM_TRANSPORT=kernel: the header names the kernel's blocks and up to where all-reduces run
    one-shot; with two ranks sharing an emulated GPU that is not under MPS, the ring stays host-driven
    (ipc) and the header says why."""
    cases = [
        (
            {"RINGCOMM_ONESHOT_BYTES": "1000"},
            "kernel",
            "# Ring kernel: 2 block(s) per rank, each a FIFO of 4 x 64 KiB; all-reduces up to 1024 B one-shot (every "
            "rank's buffer to every other rank, folded in the ring's order; RINGCOMM_ONESHOT_BYTES), larger ones by "
            "the ring's steps",
        ),
        (
            {"RINGCOMM_EMULATED_MPS": "0"},
            "ipc",
            "# Ring kernel: RINGCOMM_TRANSPORT=kernel, but the ring stays host-driven (ipc): ranks 0, 1 share GPU "
            "0000:00:00.0 of node 0, rank(s) 0, 1 not under MPS, so their kernels would take turns instead of "
            "running at once: start MPS (nvidia-cuda-mps-control -d) before the job",
        ),
    ]
    for extra, transport, line in cases:
        env = {**gpu_env, "RINGCOMM_TRANSPORT": "kernel", **extra}
        rc, out, err = _bench(env, ["-c", "all_reduce", *SWEEP], impl="ringcomm")
        assert rc == 0, out[-3000:] + err[-3000:]
        head = _header(out)
        assert any(h.endswith(f"transport {transport}") for h in head), head
        assert line in head, head
        algorithm = {"kernel": "every collective one kernel launch", "ipc": "every collective up to"}[transport]
        assert any(h.startswith(f"# Algorithm: {algorithm}") for h in head), head
        (table,) = parse_tables(out)
        assert table.status == "OK" and table.wrong == 0


@emulated_gpu
def test_gpu_host_cost_measures_every_transport_and_ringcomms_python_on_a_kernel_ring(gpu_env, tmp_path):
    """benchmarks/gpu_host_cost.py at N = 2: a row per transport, size and collective, every result
    checked (wrong 0), and on the kernel ring the time of ringcomm's Python alone (the launch a no-op)."""
    path = tmp_path / "cost.json"
    cmd = ["mpiexec", "-n", "2", "python", "benchmarks/gpu_host_cost.py", "--transports", "ipc", "kernel"]
    cmd += ["--sizes", "8", "64K", "--iters", "5", "--json", str(path)]
    cmd += ["--collectives", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
    run = run_emulated(gpu_env, cmd, 240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    collectives = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
    assert [(r["transport"], r["ran"], r["bytes"], r["collective"]) for r in rows] == [
        (t, t, size, c) for t in ("ipc", "kernel") for size in (8, 65536) for c in collectives
    ]
    assert all(r["wrong"] == 0 and r["us_per_call"] > 0 and r["host_us_per_call"] > 0 for r in rows), rows
    assert [r["algorithm"] for r in rows] == ["via host"] * 10 + ["one kernel"] * 10
    assert all(r["python_us_per_call"] > 0 for r in rows[10:]) and all(r["python_us_per_call"] == 0 for r in rows[:10])
    assert "python" in run.stdout.splitlines()[1], run.stdout


@emulated_gpu
def test_gpu_host_cost_on_pytorch_tensors(gpu_env, tmp_path):
    """benchmarks/gpu_host_cost.py --arrays torch at N = 2 (the fake torch of tests/emulated_torch_streams.py):
    every collective on PyTorch CUDA tensors over the checked CuPy arrays, every result right (wrong 0),
    ringcomm's Python measured on the kernel ring (the tensors' kernel lanes)."""
    path = tmp_path / "cost.json"
    fake = "import emulated_torch_streams, runpy, sys; sys.argv[0] = 'gpu_host_cost.py'; "
    fake += "runpy.run_path('benchmarks/gpu_host_cost.py', run_name='__main__')"
    cmd = ["mpiexec", "-n", "2", "python", "-c", fake, "--transports", "kernel", "--arrays", "torch"]
    cmd += ["--sizes", "8", "--iters", "5", "--json", str(path)]
    cmd += ["--collectives", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]
    run = run_emulated(gpu_env, cmd, 240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert [(r["arrays"], r["collective"], r["wrong"]) for r in rows] == [
        ("torch", c, 0) for c in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
    ]
    assert all(r["python_us_per_call"] > 0 for r in rows), rows
    assert "float32 torch arrays" in run.stdout.splitlines()[0], run.stdout


@emulated_gpu
def test_graph_replay_times_eager_and_replayed_calls_and_checks_every_result(gpu_env, tmp_path):
    """benchmarks/graph_replay.py at N = 2: ringcomm's ring kernel eagerly and replayed from a CUDA graph,
    every result checked (#wrong 0); NCCL eagerly, and its capture refused with the emulated GPU's reason
    (it captures kernels only), a row on every rank alike; and on a ring that stays host-driven (no MPS),
    ringcomm's capture is refused with ringcomm's reason."""
    path = tmp_path / "graph.json"
    cmd = ["mpiexec", "-n", "2", "python", "benchmarks/graph_replay.py", "--sizes", "8", "64K"]
    cmd += ["--calls", "3", "--replays", "4", "--json", str(path)]
    run = run_emulated({**gpu_env, "RINGCOMM_TRANSPORT": "kernel"}, cmd, 240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert [(r["impl"], r["bytes"]) for r in rows] == [  # (ringcomm's rows first: NCCL is set up after them)
        ("ringcomm", 8),
        ("ringcomm", 65536),
        ("nccl", 8),
        ("nccl", 65536),
    ]
    assert all(r["wrong"] == 0 and r["eager_us"] > 0 for r in rows), rows
    assert all(r["graph_us"] > 0 and r["note"] == "" for r in rows if r["impl"] == "ringcomm"), rows
    assert all(r["graph_us"] is None and r["note"].startswith("capture refused: ") for r in rows if r["impl"] == "nccl")
    assert "# CUDA graph replay: all_reduce float32 sum out of place, 2 ranks, 3 calls per graph" in run.stdout
    cmd[-1] = str(tmp_path / "host-driven.json")
    run = run_emulated(
        {**gpu_env, "RINGCOMM_TRANSPORT": "kernel", "RINGCOMM_EMULATED_MPS": "0"}, cmd + ["--impl", "ringcomm"], 240
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads((tmp_path / "host-driven.json").read_text())["rows"]
    assert all(r["graph_us"] is None and r["wrong"] == 0 for r in rows), rows
    assert all("only a ring kernel's calls can be captured" in r["note"] and "not under MPS" in r["note"] for r in rows)
