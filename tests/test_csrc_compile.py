"""Every kernel file in csrc/ compiles with nvcc for sm_80 and sm_90 (CI has nvcc but no GPU).

The kernels are compiled at run time by NVRTC through CuPy; this test compiles the same text
with nvcc so that a kernel that does not compile fails CI. Skipped when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_beside

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))
ARCHS = ("sm_80", "sm_90")


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = _nvcc()


def test_sources_present():
    names = {p.name for p in SOURCES}
    assert {"reduce.cu", "copy.cu", "optimizer.cu", "accumulate.cu", "ring.cu"} <= names
    assert (CSRC / "common.cuh").is_file()


def _ring_entries() -> list[str]:
    """The ring.cu kernels compiled for sm_90. ring.cu's 48 kernels take nvcc 40 s per arch; the loader
    compiles them one at a time (NVRTC, RC_RING_ONE_ENTRY), and their code differs only by the element
    type and the op functor (reduce.cu compiles every pair): every dtype with sum, and every op with f32.
    (sm_80's code differs from sm_90's by the architecture, not by the entry: there, sum f32 alone.)"""
    from ringcomm.devices import cuda

    names = {f"ringcomm_ring_sum_{s}" for s in cuda.SUFFIX.values()}
    return sorted(names | {f"ringcomm_ring_{op}_f32" for op in ("prod", "min", "max")})


def compile_commands(source: Path, arch: str, out: Path) -> list[list[str]]:
    """test_compiles's nvcc commands for ``source``: one, or for ring.cu at sm_90 two, each compiling
    half of its entries (in files written to ``out``), so that they run side by side."""
    from ringcomm.devices import cuda

    out = out / f"{source.stem}.{arch}"
    out.mkdir()
    sources, defines = [source], []
    if source.name == "ring.cu":
        names = _ring_entries() if arch == "sm_90" else ["ringcomm_ring_sum_f32"]
        mid = (len(names) + 1) // 2
        halves = [half for half in (names[:mid], names[mid:]) if half]
        sources = [out / f"ring_entries{k}.cu" for k in range(len(halves))]
        for path, half in zip(sources, halves):
            path.write_text('#include "ring.cu"\n' + "".join(cuda.ring_entry(name) for name in half))
        defines = ["-DRC_RING_ONE_ENTRY"]
    flags = ["-std=c++17", f"-arch={arch}", "-I", str(CSRC), *defines, "-Werror", "all-warnings"]
    return [[NVCC, *flags, "-c", str(src), "-o", str(out / f"{src.stem}.o")] for src in sources]


def ptx_command(name: str, arch: str, out: Path) -> list[str]:
    """test_ptx_keeps_ieee_under_cupy_options's nvcc command: ``name`` to PTX with the loader's NVRTC
    options and CuPy's, into ``out``."""
    from ringcomm.devices import cuda

    ptx = out / f"{name}.{arch}.ptx"
    return [
        NVCC,
        *cuda.NVRTC_OPTIONS,
        *CUPY_APPENDS,
        f"-arch={arch}",
        "-I",
        str(CSRC),
        "--ptx",
        str(CSRC / name),
        "-o",
        str(ptx),
    ]


@pytest.fixture(scope="module")
def nvcc_runs(request, tmp_path_factory):
    """Every nvcc command of this module's tests that the session runs, started at once, one per core
    (each keeps one core busy for 1-15 s: in turn they took 51 s of the 2-core CI machine, side by side
    half that), the longest first: by test node id, the commands and their futures (CompletedProcess)."""
    out = tmp_path_factory.mktemp("nvcc")
    jobs = []  # (node id, command)
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module or not hasattr(item, "callspec"):
            continue
        params = item.callspec.params
        if item.originalname == "test_compiles":
            jobs += [(item.nodeid, cmd) for cmd in compile_commands(params["source"], params["arch"], out)]
        elif item.originalname == "test_ptx_keeps_ieee_under_cupy_options":
            jobs.append((item.nodeid, ptx_command(params["name"], params["arch"], out)))
    pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    runs: dict[str, list] = {}
    for nodeid, cmd in sorted(jobs, key=lambda job: "-DRC_RING_ONE_ENTRY" not in job[1]):  # (ring.cu's first)
        runs.setdefault(nodeid, []).append((cmd, pool.submit(run_beside, cmd, timeout=600)))
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile the kernels)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles(source: Path, arch: str, nvcc_runs, request):
    for cmd, future in nvcc_runs[request.node.nodeid]:
        done = future.result()
        assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
        assert Path(cmd[-1]).stat().st_size > 0


# What CuPy appends to the caller's NVRTC options for every RawModule (cupy/cuda/compiler.py,
# _compile_with_cache_cuda: ``options += ('-ftz=true',)``); NVRTC's defaults stand for the rest:
# -fmad=true, -prec-div=true, -prec-sqrt=true (nvcc has the same defaults and the same meaning).
CUPY_APPENDS = ("-ftz=true",)
# Kernel files whose floating-point results must not depend on those flags (bitwise equal to the host).
IEEE_SOURCES = ("optimizer.cu", "accumulate.cu")
_FP_INSN = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z]+(?:\.[a-z0-9]+)*\.f(?:32|64))\b", re.MULTILINE)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (install the CUDA toolkit to compile the kernels)")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", IEEE_SOURCES)
def test_ptx_keeps_ieee_under_cupy_options(name: str, arch: str, nvcc_runs, request):
    """Compiled with the loader's options plus CuPy's -ftz=true, the PTX has no flush-to-zero and
    nothing the code generator may fuse: no .ftz, no fma/mad, and every f32/f64 add, sub and mul
    carries .rn (ptxas may contract a mul and an add only when neither has a rounding modifier)."""
    from ringcomm.devices import cuda

    [(cmd, future)] = nvcc_runs[request.node.nodeid]
    done = future.result()
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout}\n{done.stderr}"
    ptx = Path(cmd[-1])
    insns = _FP_INSN.findall(ptx.read_text())
    assert insns, "no floating-point instruction found: the PTX pattern is wrong"
    bad: dict[str, int] = {}
    for insn in insns:
        parts = insn.split(".")
        if "ftz" in parts or parts[0] in ("fma", "mad") or (parts[0] in ("add", "sub", "mul") and "rn" not in parts):
            bad[insn] = bad.get(insn, 0) + 1
    assert not bad, f"{name} ({arch}, {' '.join(CUPY_APPENDS)}): instructions that flush or may fuse: {bad}"
    names = {"optimizer.cu": cuda.adam_kernel_names, "accumulate.cu": cuda.accumulate_kernel_names}[name]()
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    assert set(names) <= entries, f"kernels the loader asks for that {name} lacks: {sorted(set(names) - entries)}"


def test_entry_points_match_the_loader():
    """The kernel names the Python launcher asks for are the ones the sources define."""
    from ringcomm.devices import cuda

    text = {p.name: p.read_text() for p in SOURCES}
    for name in cuda.reduce_kernel_names():
        op, suffix = name.split("_")[2:4]
        assert f"RC_REDUCE_OPS({suffix}," in text["reduce.cu"], name
        assert f"RC_REDUCE_ENTRY({op}," in text["reduce.cu"], name
    assert "ringcomm_copy(" in text["copy.cu"]
    for suffix in cuda.SUFFIX.values():  # ring.cu: one kernel per op and dtype, compiled one at a time
        assert f"RC_RING_OPS({suffix}," in text["ring.cu"], suffix
        assert cuda.ring_entry(f"ringcomm_ring_sum_{suffix}").startswith(f"RC_RING_ENTRY(sum, rc::OpSum, {suffix}, ")
    for op in ("sum", "prod", "min", "max"):
        assert f"RC_RING_ENTRY({op}, rc::Op{op.capitalize()}, SUFFIX, T)" in text["ring.cu"], op
    acc = text["accumulate.cu"]
    for name in cuda.accumulate_kernel_names():
        parts = name.split("_")
        if parts[1] == "widen":
            assert f"RC_WIDEN_ENTRY({parts[2]}," in acc, name
            continue
        assert f"RC_ACC_OPS({parts[-1]}," in acc and f"RC_ACC_ENTRIES({parts[-2]}," in acc, name
        assert ("ringcomm_reduce_acc_final_##OPNAME" if parts[3] == "final" else "ringcomm_reduce_acc_##OPNAME") in acc
    assert len(set(cuda.accumulate_kernel_names())) == 2 * (4 + 4 + 1)
    for name in cuda.adam_kernel_names():
        p, g, o = name.split("_")[2:5]
        assert f"RC_ADAM_GRADS({p}," in text["optimizer.cu"], name
        assert f"RC_ADAM_OUTS(PS, P, {g}," in text["optimizer.cu"], name
        assert f"RC_ADAM_ENTRY(PS, P, GS, G, {o}," in text["optimizer.cu"], name
    assert f"#define RC_BLOCK {cuda.BLOCK}\n" in (CSRC / "common.cuh").read_text()


def test_loader_inlines_the_header():
    """What NVRTC gets: the kernel file with common.cuh (and ring.cu's other files) pasted in, no
    #include "..." left."""
    from ringcomm.devices import cuda

    for source in SOURCES:
        code = cuda.kernel_source(source.name)
        assert not re.search(r'^\s*#\s*include\s*"', code, re.M), source.name  # (<atomic>: host emulation only)
        assert "RINGCOMM_COMMON_CUH" in code
