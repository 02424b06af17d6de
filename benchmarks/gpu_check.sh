#!/usr/bin/env bash
# The prepared GPU check (issues 3 and 8): on a machine with one GPU and no internet, in at most
# GPU_CHECK_BUDGET seconds (default 420: one 10-minute device call with room to rerun it).
#
#   bash benchmarks/gpu_check.sh            # from anywhere; writes logs and JSON under $OUT (or /tmp/ringcomm_gpu_check)
#
# The GPU image lacks some of what the check needs. Carry these wheels in wheels/ (git-ignored), made on any
# machine with internet by one command (the Python version is the image's: the first line this script prints):
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 -d wheels mpich==5.0.2 mpi4py==4.1.2 mpi-pytest==2026.0
#
# (3 wheels, 15 MB: MPICH with its mpiexec, the mpi4py built for it, mpi-pytest. The H200 image of 2026-12-04 has
# the rest: numpy, CuPy, NCCL, cuda-bindings, ml_dtypes, pytest. On another image the set-up's last line names
# what is missing; add those to the command: ml_dtypes==0.7.0 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1
# pytest==9.2.0 iniconfig==2.3.1 packaging==26.4 pluggy==1.7.0 pygments==2.21.0.)
#
# 1. set-up: installs the carried wheels (.whl/, wheels/ or $WHEELS), prints what the results depend on (GPU,
#    compute mode, MIG, MPS, /dev/shm, driver, CUDA, CuPy, NCCL and MPI versions, whether mpiexec is the MPI
#    that mpi4py loaded), and stops at once, with one line, when something the steps need is missing; unpacks
#    the NCCL 2.30 carried in .nccl/ (below) and reads its ncclGetVersion;
# 2. NCCL 2.30's smoke test (.nccl/gpu_smoke_test.py: ctypes only, 1 rank, then 2 ranks on the one GPU), where
#    it was carried; its output in $OUT/nccl_smoke.txt;
# 3. compiles every kernel once (NVRTC through CuPy, the 48 ring kernels too, a thread per CPU; CuPy's disk
#    cache keeps them for the ranks, so that no test or bench compiles);
# 4. the GPU tests (tests/gpu) at N = 1 (the kernel tests too) and N = 2 ranks on the GPU;
# 5. the kernel benchmark (benchmarks/kernel_bench.py: reduce/copy against cudaMemcpy and cupy.add);
# 6. all-reduce of 1 GiB with 2 ranks on the one GPU, IPC against staged (benchmarks/allreduce_transports.py),
#    and where a small GPU all-reduce's host time goes, per transport (benchmarks/gpu_host_cost.py);
# 7. ringcomm-bench, 2 ranks: every collective on kernel, NCCL and MPI side by side, 16 B to 16 MiB (JSON and the
#    table under $OUT);
#    then all_reduce of ipc, kernel (each collective one kernel; RINGCOMM_TRANSPORT) and NCCL at 2 and 4 ranks
#    on the one GPU, 8 B to 1 GiB (bench_<transport>_n<N>.json). NCCL is the carried 2.30 when its smoke test passed;
# 8. the GPU tests at N = 3 and 4, and tests/test_zero_gpu.py (last: a hang there cannot starve the others).
# Each step has a limit (PLAN below); the limits and the set-up's add up to at most the budget, so no step is
# cut short or skipped for time; a failed step does not stop the others. The summary table comes last; the exit
# status is 0 only when every step ran and passed, 2 when the set-up found something missing.
#
# NCCL 2.30 for the NCCL rows (issue 33, item 11). The image's NCCL 2.28.9 refuses ranks that share one GPU, so
# the bench measures NCCL only with the NCCL 2.30.7 of /work/shared/nccl (sm_90 code only: H100, H200; see its
# README.md). The session copies it into the git-ignored .nccl/ of its checkout, and names that folder in the
# device call's carry list (29 MiB of the 64 that travel; the wheels are 15 more):
#
#   mkdir -p .nccl && cp /work/shared/nccl/libnccl-2.30.7-sm90.so.xz /work/shared/nccl/gpu_smoke_test.py .nccl/
#   carry: [".nccl", "wheels"]
#
# The set-up unpacks it (xz -dc) into a temporary folder as libnccl.so.2 (195 MiB) and reads its ncclGetVersion;
# step 2 runs the smoke test on it; when that passes, the bench steps (7) run with RINGCOMM_NCCL_LIB naming it,
# NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_DEBUG=WARN, under the MPS daemon of the set-up: the bench loads it before
# CuPy's NCCL bindings and stops if cupy.cuda.nccl reports another version. Without .nccl/ (GPU_CHECK_NCCL_DIR:
# another folder), or when the smoke test fails, the bench uses CuPy's NCCL, and the set-up or step 2 says so.
#
# GPU_CHECK_NO_INSTALL=1: install nothing (use what is importable). GPU_CHECK_SETUP_ONLY=1: stop after the
# set-up (a dry run; on a CPU with tests/emulated on PYTHONPATH it checks this script). The source tree is used
# through PYTHONPATH (no pip install of ringcomm). Multi-rank waits use RINGCOMM_TEST_TIMEOUT (default here
# 20 s), well inside each step's limit, so a hang ends as a ringcomm TimeoutError naming the collective, step
# and peer, not as a kill.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUTDIR=${OUT:-/tmp/ringcomm_gpu_check}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu_check.log
: >"$LOG"
export PYTHONUNBUFFERED=1 RINGCOMM_TEST_TIMEOUT=${RINGCOMM_TEST_TIMEOUT:-20} PIP_DISABLE_PIP_VERSION_CHECK=1
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET:-420}  # seconds for everything

# Every step's limit in seconds (a command gets 5 s less): the times of the first runs on an H200 (2026-12-04:
# set-up 6, compile 8 on a fresh machine, tests N=1 23, kernel bench 8, all-reduce 7, host cost 4, bench 11) with
# room; then the multi-rank tests had an mpiexec per test (3.5-10 s each: N=2 15 tests, N=3,4 10), now one per
# rank count (tests/mpi_batches.py). The set-up's own
# commands have their limits inside it (nvidia-smi 8, wheels 2 x 10, MPS 10 + 20, probe 15, NCCL unpack 30 + 10).
# NCCL 2.30 (not yet run on a GPU, so estimates): its smoke test (about 3 s of Python on this CPU, plus CUDA's
# and two NCCL communicators' start) and the NCCL rows the two bench steps now measure (an NCCL start per run, and
# each row's check of up to 1 GiB) took their seconds from the steps with the most room. The graph replay (2 ranks:
# Python, CuPy and NCCL's start, then 8 rows of 1000 eager and 1000 replayed calls, each under 0.1 s on a GPU) took
# 25 s from the one-kernel bench and the N = 2 tests, an estimate too; the host cost's five collectives at N = 2
# (30 rows of about 220 calls) 8 s more, from the one-kernel bench and the N = 3, 4 tests. The compile step
# compiles the ring kernels too (NVRTC: about 2.3 s each on this 2-core CPU, 48 of them, compiled in parallel
# threads since 2026-12-07: about 12 s on 16 CPUs); before, each test process compiled the ones it used at their
# first call, about 110 s in the N = 1 tests alone: 5 s more for it, from the N = 2 and N = 3, 4 tests, which no
# longer compile. The ZeRO GPU tests (a fresh pytest, CUDA under MPS, CuPy's float64 kernels compiled at first use)
# 8 s more, and ringcomm-bench (5 collectives x 11 sizes x 3 implementations x 2 modes) 2 s more, from the compile.
PLAN=(
    "setup 15"
    "nccl smoke 20"
    "compile 20"
    "tests N=1 35"
    "tests N=2 70"
    "kernel bench 13"
    "allreduce ipc vs staged 13"
    "gpu host cost 20"
    "ringcomm-bench 32"
    "one-kernel bench 81"
    "graph replay 25"
    "tests N=3,4 58"
    "zero GPU tests 18"
)
declare -A LIMIT=()
TOTAL=0
for entry in "${PLAN[@]}"; do
    LIMIT[${entry% *}]=${entry##* }
    TOTAL=$((TOTAL + ${entry##* }))
done
declare -a NAMES=() RCS=() SECS=()

say() { echo "[gpu_check +$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# at exit: stop the MPS daemon this script started, remove the unpacked NCCL
MPS_OWN="" NCCL_TMP=""
cleanup() {
    [ -n "$MPS_OWN" ] && echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
    [ -n "$NCCL_TMP" ] && rm -rf "$NCCL_TMP"
    return 0
}
trap cleanup EXIT

if [ "$TOTAL" -gt "$BUDGET" ]; then
    say "gpu_check: the steps' limits add up to ${TOTAL}s, more than the budget of ${BUDGET}s (GPU_CHECK_BUDGET); nothing run"
    exit 2
fi
say "budget ${BUDGET}s; the steps' limits add up to ${TOTAL}s"

# step NAME CMD...: run CMD within NAME's limit (SIGTERM 5 s before it, SIGKILL at it), output to the log
step() {
    local name=$1 limit=${LIMIT[$1]}
    shift
    local t=$(date +%s) left=$((BUDGET - ($(date +%s) - T0)))
    if [ "$left" -lt 10 ]; then  # cannot happen while the set-up keeps its limit; kept as a guard
        NAMES+=("$name") RCS+=("skipped") SECS+=(0)
        say "== $name: SKIPPED, the ${BUDGET}s budget is spent"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name (limit ${limit}s): $*"
    timeout -k 5 "$((limit - 5))" "$@" >>"$LOG" 2>&1
    local rc=$?
    NAMES+=("$name") RCS+=("$rc") SECS+=("$(($(date +%s) - t))")
    [ "$rc" = 124 ] && say "   $name: TIMED OUT after $((limit - 5))s"
    say "   $name: rc=$rc in $(($(date +%s) - t))s"
    return 0
}

# ---------------------------------------------------------------------------------------- 1. set-up
say "python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS=$(timeout 8 nvidia-smi --format=csv,noheader \
        --query-gpu=index,name,memory.total,driver_version,compute_mode,mig.mode.current,persistence_mode 2>&1)
    say "GPU (index, name, memory, driver, compute mode, MIG, persistence):"
    echo "$GPUS" | tee -a "$LOG"
    echo "$GPUS" | grep -qi "exclusive" &&
        say "WARNING: compute mode Exclusive_Process: one process per GPU, so ranks 2+ cannot use it (every multi-rank step fails)"
    echo "$GPUS" | grep -qi "prohibited" && say "WARNING: compute mode Prohibited: no process can use the GPU"
else
    say "GPU: nvidia-smi not found (compute mode and driver unknown)"
fi
# Several ranks on one GPU: without MPS the GPU time-slices their contexts, and a step that waits on another
# rank's GPU work waits out time slices (the first run on an H200, 2026-12-04: ipc 3.5 ms per all-reduce at
# N = 4 from 64 KiB to 4 MiB, the since removed ipc-stream 3-4 ms per step). With MPS their kernels share the GPU at once, as
# ranks on GPUs of their own would. So the check starts an MPS daemon of its own (GPU_CHECK_MPS=0: it does
# not), keeps it only if a CUDA client runs under it, and stops it at the end.
MPS_PIPE=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}
MPS="time-sliced"
if [ -e "$MPS_PIPE/control" ]; then
    MPS="MPS"
    say "MPS: a control daemon runs (pipe in $MPS_PIPE): ranks on one GPU share it through MPS"
elif [ "${GPU_CHECK_MPS:-1}" != 0 ] && command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/ringcomm_mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ringcomm_mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if timeout 10 nvidia-cuda-mps-control -d >>"$LOG" 2>&1 &&
        timeout 20 $PY -c "import cupy; assert int(cupy.arange(4).sum()) == 6" >>"$LOG" 2>&1; then
        MPS="MPS" MPS_OWN=1
        say "MPS: started a control daemon (pipe in $CUDA_MPS_PIPE_DIRECTORY): ranks on one GPU share it" \
            "(GPU_CHECK_MPS=0: they time-slice it)"
    else
        echo quit | timeout 10 nvidia-cuda-mps-control >/dev/null 2>&1
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        say "MPS: a daemon of our own did not serve a CUDA client (see the log and $CUDA_MPS_LOG_DIRECTORY):" \
            "ranks on one GPU time-slice it"
    fi
else
    say "MPS: no control daemon (no $MPS_PIPE/control): ranks on one GPU time-slice it" \
        "($(command -v nvidia-cuda-mps-control >/dev/null 2>&1 && echo 'GPU_CHECK_MPS=0' || echo 'no nvidia-cuda-mps-control'))"
fi
say "/dev/shm: $(df -h /dev/shm 2>/dev/null | awk 'NR == 2 {print $2 " size, " $4 " free"}' || echo unknown)" \
    "(MPI and NCCL between ranks of one node use it; under 1 GB can make NCCL fail)"

# the MPI from the mpich wheel lands beside the interpreter: bin/ and lib/ of its prefix (not --target:
# pip drops a wheel's data lib/ there, and libmpi.so.12 with it); if that prefix is read-only,
# a --prefix of our own, reached through PYTHONPATH, PATH and LD_LIBRARY_PATH
PREFIX=$($PY -c 'import sys; print(sys.prefix)')
if [ -z "${GPU_CHECK_NO_INSTALL:-}" ]; then
    for dir in ${WHEELS:-} .whl wheels; do
        if [ -d "$dir" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
            say "installing carried wheels from $dir: $(cd "$dir" && ls *.whl | tr '\n' ' ')"
            pipi() { timeout 10 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@" "$dir"/*.whl; }
            if ! pipi >>"$LOG" 2>&1; then
                PREFIX=/tmp/ringcomm_prefix
                SITE=$($PY -c "import sysconfig; print(sysconfig.get_path('purelib', 'posix_prefix', {'base': '$PREFIX', 'platbase': '$PREFIX'}))")
                if pipi --prefix "$PREFIX" >>"$LOG" 2>&1; then
                    export PYTHONPATH=$SITE:${PYTHONPATH:-}
                    say "   installed under $PREFIX (the interpreter's prefix is not writable)"
                else
                    say "   (the wheels did not install; see the log)"
                fi
            fi
            break
        fi
    done
fi
export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib:${LD_LIBRARY_PATH:-}
export PYTHONPATH=$ROOT:${PYTHONPATH:-}

# what the results depend on, and what is missing (the last line: "missing: ..." or "missing:")
PROBE=$OUTDIR/setup_probe.txt
timeout 15 $PY - >"$PROBE" 2>&1 <<'EOF'
import importlib
import importlib.metadata
import re
import shutil
import subprocess

missing = []
# module -> its distribution (what to carry)
for name, dist in (("numpy", "numpy"), ("cupy", "cupy"), ("mpi4py.MPI", "mpi4py"), ("ml_dtypes", "ml_dtypes"),
                   ("cuda.bindings.driver", "cuda-bindings"), ("pytest", "pytest"), ("pytest_mpi", "mpi-pytest"),
                   ("ringcomm", "ringcomm")):
    try:
        m = importlib.import_module(name)
        version = getattr(importlib.import_module(name.split(".")[0]), "__version__", "")
        try:
            version = version or importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
        print(f"  {name:22s} {version} {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name:22s} MISSING: {type(e).__name__}: {e}")
        missing.append("mpi4py (or libmpi: the mpich wheel)" if dist == "mpi4py" else dist)
try:
    print(f"  mpich wheel            {importlib.metadata.version('mpich')}")
except importlib.metadata.PackageNotFoundError:
    print("  mpich wheel            not installed (the MPI is the image's own)")
try:
    import cupy

    rt = cupy.cuda.runtime
    d, r = rt.driverGetVersion(), rt.runtimeGetVersion()
    print(f"  CUDA: driver supports {d // 1000}.{d % 1000 // 10}, runtime {r // 1000}.{r % 1000 // 10}; "
          f"CuPy {cupy.__version__}; {rt.getDeviceCount()} GPU(s)")
    try:
        from cupy.cuda import nccl

        v = nccl.get_version()
        b = nccl.get_build_version() if hasattr(nccl, "get_build_version") else v
        f = lambda c: f"{c // 10000}.{c // 100 % 100}.{c % 100}"  # noqa: E731
        print(f"  NCCL: {f(v)} (CuPy built with {f(b)}); several ranks on one GPU need 2.30+ "
              f"(NCCL_MULTI_RANK_GPU_ENABLE)")
    except Exception as e:  # noqa: BLE001
        print(f"  NCCL: not available through CuPy ({type(e).__name__}: {e}); ringcomm-bench runs without it")
except Exception as e:  # noqa: BLE001
    print(f"  CUDA: unknown ({type(e).__name__}: {e})")


def ident(text):
    family = ("Intel MPI" if "Intel" in text else "Open MPI" if re.search(r"Open MPI|OpenRTE|PRRTE", text)
              else "MPICH" if re.search(r"MPICH|HYDRA", text) else "?")
    m = re.search(r"Version:?\s*v?(\d+\.\d+(?:\.\d+)?)", text) or re.search(r"\bv?(\d+\.\d+(?:\.\d+)?)\b", text)
    return family, m.group(1) if m else "?"


try:
    from mpi4py import MPI

    lib = MPI.Get_library_version()
    print("  MPI library (mpi4py):", " ".join(lib.splitlines()[0].split()))
    exe = shutil.which("mpiexec")
    if exe is None:
        missing.append("mpiexec (the mpich wheel)")
        print("  mpiexec: not found")
    else:
        run = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5)
        text = run.stdout + run.stderr
        a, b = ident(text), ident(lib)
        same = "yes" if a == b and "?" not in a else "NO: multi-rank runs would start N separate 1-rank jobs"
        print(f"  mpiexec: {exe}: {a[0]} {a[1]}; the library: {b[0]} {b[1]}; match: {same}")
    from ringcomm.transports.staged import cuda_aware_mpi

    print("  CUDA-aware MPI:", cuda_aware_mpi())
except Exception as e:  # noqa: BLE001
    print("  MPI: unavailable:", e)
print("missing:", ", ".join(dict.fromkeys(missing)))
EOF
PROBE_RC=$?
sed '$d' "$PROBE" | tee -a "$LOG"
MISSING=$(tail -n 1 "$PROBE" | sed -n 's/^missing: *//p')
[ "$PROBE_RC" = 0 ] || MISSING=${MISSING:-"the set-up probe itself (rc $PROBE_RC, see $PROBE)"}
if [ -n "$MISSING" ]; then
    say "gpu_check: MISSING $MISSING: carry the wheels (the pip download command at the top of benchmarks/gpu_check.sh) in wheels/ and rerun"
    exit 2
fi

# NCCL 2.30 carried in .nccl/ (the header): unpacked into a temporary folder, its ncclGetVersion read; the bench's
# NCCL rows use it once step 2's smoke test passed (NCCL_USE says what they use)
NCCL_DIR=${GPU_CHECK_NCCL_DIR:-$ROOT/.nccl}
NCCL_XZ=$NCCL_DIR/libnccl-2.30.7-sm90.so.xz
NCCL_SMOKE=$NCCL_DIR/gpu_smoke_test.py
NCCL_SHA256=970b6e2064d966bfe2ca7130c8ec6ca0d3163a590e117b2839b46ec00f4d519b  # unpacked (/work/shared/nccl/README.md)
NCCL_LIB="" NCCL_CODE="" NCCL_USE="CuPy's NCCL"
if [ -f "$NCCL_XZ" ] && [ -f "$NCCL_SMOKE" ]; then
    NCCL_TMP=$(mktemp -d /tmp/ringcomm_nccl.XXXXXX)
    if command -v xz >/dev/null 2>&1; then
        unpack=(xz -dc "$NCCL_XZ")
    else  # Python's lzma reads .xz too
        unpack=($PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)"
            "$NCCL_XZ")
    fi
    if timeout 30 "${unpack[@]}" >"$NCCL_TMP/libnccl.so.2" 2>>"$LOG" &&
        NCCL_CODE=$(timeout 10 $PY -c "
import ctypes, sys
v = ctypes.c_int(0)
rc = ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
sys.exit(f'ncclGetVersion returned {rc}') if rc else print(v.value)" "$NCCL_TMP/libnccl.so.2" 2>>"$LOG"); then
        NCCL_LIB=$NCCL_TMP/libnccl.so.2
        SHA=$(sha256sum "$NCCL_LIB" | cut -d ' ' -f 1)
        [ "$SHA" = "$NCCL_SHA256" ] && SHA="sha256 as in /work/shared/nccl/README.md" ||
            SHA="WARNING: sha256 $SHA, not the README's $NCCL_SHA256"
        say "NCCL carried: $NCCL_XZ unpacked to $NCCL_LIB ($(($(stat -c %s "$NCCL_LIB") >> 20)) MiB, $SHA)," \
            "ncclGetVersion $NCCL_CODE; step 2 smoke-tests it, then the bench's NCCL rows use it"
    else
        say "NCCL carried: $NCCL_XZ could not be unpacked or loaded (see the log): the bench uses CuPy's NCCL"
    fi
elif [ -e "$NCCL_DIR" ]; then
    say "NCCL carried: $NCCL_DIR lacks libnccl-2.30.7-sm90.so.xz or gpu_smoke_test.py (copy both, see the header):" \
        "the bench uses CuPy's NCCL"
else
    say "NCCL carried: none ($NCCL_DIR absent; to measure NCCL 2.30, copy it from /work/shared/nccl and carry .nccl," \
        "see the header): the bench uses CuPy's NCCL"
fi
if [ -n "${GPU_CHECK_SETUP_ONLY:-}" ]; then
    say "set-up done in $(($(date +%s) - T0))s (limit ${LIMIT[setup]}s); GPU_CHECK_SETUP_ONLY=1: no steps run"
    exit 0
fi
say "set-up done in $(($(date +%s) - T0))s (limit ${LIMIT[setup]}s)"

# --------------------------------------------------------------------------- 2. NCCL 2.30's smoke test
# the carried NCCL alone first (ctypes: all-reduce at 1 rank; all-reduce, all-gather, reduce-scatter, broadcast at
# 2 ranks on the one GPU); the bench's NCCL rows (7) use it only when this passed
NCCL_ENV=""  # what the bench steps put before mpiexec
if [ -n "$NCCL_LIB" ]; then
    step "nccl smoke" bash -o pipefail -c "NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN $PY '$NCCL_SMOKE' '$NCCL_LIB' \
        2>&1 | tee '$OUTDIR/nccl_smoke.txt'"
    if [ "${RCS[-1]}" = 0 ]; then
        NCCL_ENV="RINGCOMM_NCCL_LIB=$NCCL_LIB NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_DEBUG=WARN"
        NCCL_USE="NCCL $((NCCL_CODE / 10000)).$((NCCL_CODE / 100 % 100)).$((NCCL_CODE % 100)) carried in $NCCL_DIR"
        NCCL_USE+=" (RINGCOMM_NCCL_LIB=$NCCL_LIB; its smoke test passed)"
    else
        NCCL_USE="CuPy's NCCL (the carried NCCL failed its smoke test: $OUTDIR/nccl_smoke.txt)"
    fi
    say "   the bench's NCCL rows use $NCCL_USE"
else
    say "== nccl smoke: not run (no NCCL carried): the bench's NCCL rows use CuPy's NCCL"
fi

# ----------------------------------------------------------------------------------- 3. compile once
step compile $PY -c "
import time; t = time.perf_counter()
from ringcomm.devices import cuda; cuda.warm_up()
print(f'kernels compiled (or loaded from the cache) in {time.perf_counter() - t:.1f} s')"

# ------------------------------------------------------------------------------------- 4. GPU tests
TESTLOG=$OUTDIR/gpu_tests.log
: >"$TESTLOG"
run_tests() {  # NAME MARKEXPR [FILES]: mpi-pytest marks a test parallel[n] for each of its nprocs
    local name=$1 expr=$2 files=${3:-tests/gpu}
    step "$name" bash -o pipefail -c \
        "RINGCOMM_TEST_REPORTS='$OUTDIR/test_reports' $PY -m pytest $files -v -rs --durations=5 -p no:cacheprovider \
        ${expr:+-m '$expr'} 2>&1 | tee -a '$TESTLOG'"
}
# N=1: the unmarked kernel tests (tests/gpu/test_cuda_kernels.py) and the parallel[1] ones
run_tests "tests N=1" "not parallel or parallel[1]"
run_tests "tests N=2" "parallel[2]"

# ------------------------------------------------------------------------------- 5. kernel benchmark
step "kernel bench" $PY benchmarks/kernel_bench.py --json "$OUTDIR/kernel_bench.json"

# ----------------------------------------------------------------- 6. all-reduce 1 GiB, IPC vs staged
step "allreduce ipc vs staged" mpiexec -n 2 $PY benchmarks/allreduce_transports.py --mib 1024 \
    --transports ipc staged --iters 5 --json "$OUTDIR/allreduce_transports.json"
step "gpu host cost" bash -c "mpiexec -n 2 $PY benchmarks/gpu_host_cost.py --transports ipc kernel --iters 50 \
    --collectives all_reduce reduce_scatter all_gather broadcast reduce \
    --json '$OUTDIR/gpu_host_cost.json' && mpiexec -n 4 $PY benchmarks/gpu_host_cost.py --transports ipc kernel \
    --iters 30 --json '$OUTDIR/gpu_host_cost_n4.json'"

# ------------------------------------------------------------ 7. ringcomm against NCCL and MPI, 2 ranks
# every collective, each one ring kernel (its lane once it ran: the bench repeats each call); the table also goes
# to its own file as it is printed, so a run cut short keeps the rows it measured
step "ringcomm-bench" bash -o pipefail -c "$NCCL_ENV RINGCOMM_TRANSPORT=kernel RINGCOMM_TIMEOUT=30 mpiexec -n 2 $PY -m ringcomm.bench \
    --device cuda --impl ringcomm,nccl,mpi -c all -b 16 -e 16M -f 4 --time-budget 0.3 --timeout 40 --json '$OUTDIR/bench.json' \
    | tee '$OUTDIR/bench.txt'"

# kernel (each collective one kernel: ringcomm/executor.py), 2 and 4 ranks, 8 B..1 GiB (256 MiB at 4 ranks: the
# bench's host-side data and checks of 1 GiB take about 20 s a run there); the kernel's all-reduces without the
# one-shot (RINGCOMM_ONESHOT_BYTES=0) up to 256 KiB: where the one-shot beats the ring's steps (its crossover,
# 64 KiB by default until this has run); then ipc beside NCCL (last: a failed or hung NCCL start costs no
# ringcomm row). A run that fails does not stop the others; the step fails.
step "one-kernel bench" bash -o pipefail -c "
rc=0
for n in 2 4; do
  for t in kernel kernel-ring ipc; do
    impl=ringcomm; [ \$t = ipc ] && impl=ringcomm,nccl
    top=1G; [ \$n = 4 ] && top=256M
    export RINGCOMM_ONESHOT_BYTES=; [ \$t = kernel-ring ] && top=256K RINGCOMM_ONESHOT_BYTES=0
    $NCCL_ENV RINGCOMM_TRANSPORT=\${t%-ring} RINGCOMM_TIMEOUT=20 mpiexec -n \$n $PY -m ringcomm.bench --device cuda \\
      --impl \$impl -c all_reduce -b 8 -e \$top -f 8 -n 10 -w 2 --time-budget 0.4 --timeout 25 \\
      --json '$OUTDIR'/bench_\${t}_n\$n.json > '$OUTDIR'/bench_\${t}_n\$n.txt || rc=1
  done
done
exit \$rc"
# all-reduces replayed from a CUDA graph against the same calls made eagerly, the ring kernel beside NCCL (the
# issue's target: 8 us per call at 2 ranks up to 64 KiB, replayed)
step "graph replay" bash -o pipefail -c "$NCCL_ENV RINGCOMM_TRANSPORT=kernel RINGCOMM_TIMEOUT=10 mpiexec -n 2 \
    $PY benchmarks/graph_replay.py --json '$OUTDIR/graph_replay.json' | tee '$OUTDIR/graph_replay.txt'"

# ------------------------------------------------------------------- 8. N = 3, 4, and ZeRO on the GPU
run_tests "tests N=3,4" "parallel[3] or parallel[4]"
run_tests "zero GPU tests" "" tests/test_zero_gpu.py

# ------------------------------------------------------------------------------------------ summary
{
    echo
    echo "================================ ringcomm GPU check summary ================================"
    printf '%-26s %6s %7s %6s\n' step rc seconds limit
    for i in "${!NAMES[@]}"; do printf '%-26s %6s %7s %6s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}" "${LIMIT[${NAMES[$i]}]}"; done
    echo "total $(($(date +%s) - T0))s of the ${BUDGET}s budget; ranks on the one GPU: $MPS"
    echo "the bench's NCCL rows: $NCCL_USE"
    if [ -f "$OUTDIR/nccl_smoke.txt" ]; then
        echo "NCCL smoke test ($NCCL_SMOKE $NCCL_LIB):"
        grep -E "NCCL version|compute capability|FAIL|PASSED|failed|WARN" "$OUTDIR/nccl_smoke.txt" | head -20 |
            sed 's/^/  /'
    fi
    echo
    echo "pytest result lines (outer runs and each rank of the multi-rank ones):"
    grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$TESTLOG" | sed 's/^=* *//; s/ *=*$//' | sort | uniq -c | head -20
    echo
    $PY - "$OUTDIR" <<'EOF'
import json, os, sys
out = sys.argv[1]
kb = os.path.join(out, "kernel_bench.json")
if os.path.exists(kb):
    rows = json.load(open(kb))["rows"]
    print("kernel bench (GB/s counting bytes read + written; median of CUDA-event timings):")
    print(f"  {'size':>8} {'dtype':>9} {'reduce':>8} {'copy':>8} {'memcpy':>8} {'cupy.add':>9} "
          f"{'red/memcpy':>10} {'copy/memcpy':>11} {'red vs add':>10}")
    for r in rows:
        g = r["GBps"]
        add = f"{g['cupy_add']:9.0f}" if g.get("cupy_add") else f"{'n/a':>9}"
        sp = r.get("reduce_speedup_vs_cupy_add")
        print(f"  {r['size_mib']:>5}MiB {r['dtype']:>9} {g['reduce']:8.0f} {g['copy']:8.0f} {g['memcpy']:8.0f} {add} "
              f"{r['reduce_vs_memcpy']:10.3f} {r['copy_vs_memcpy']:11.3f} {(f'{sp:9.2f}x' if sp else 'n/a'):>10}")
    worst = min(r["reduce_vs_memcpy"] for r in rows)
    adds = [r["reduce_speedup_vs_cupy_add"] for r in rows if r.get("reduce_speedup_vs_cupy_add")]
    print(f"  targets: reduce >= 0.90 x memcpy (worst {worst:.3f}); reduce >= 1.0 x cupy.add "
          f"(worst {min(adds):.2f})" if adds else f"  targets: reduce >= 0.90 x memcpy (worst {worst:.3f})")
ar = os.path.join(out, "allreduce_transports.json")
if os.path.exists(ar):
    rows = json.load(open(ar))["rows"]
    print("all_reduce 1 GiB float32, 2 ranks on one GPU:")
    for r in rows:
        print(f"  {r['transport']:>8} (ran {r['ran']}): {r['median_s'] * 1e3:9.2f} ms  busbw {r['busbw_GBps']:8.2f} GB/s"
              f"  wrong {r['wrong']}")
    t = {r["transport"]: r["median_s"] for r in rows}
    if "ipc" in t and "staged" in t:
        print(f"  staged / ipc = {t['staged'] / t['ipc']:.1f}x (target >= 5)")
bj = os.path.join(out, "bench.json")
if os.path.exists(bj):
    doc = json.load(open(bj))
    env = doc["environment"]
    print(f"ringcomm-bench, {env['ranks']} ranks, transport {env['transport']}; out-of-place (broadcast: in place) us per call (busbw GB/s), "
          "#wrong summed:")
    if (env.get("nccl_library") or {}).get("line"):
        print(f"  NCCL library: {env['nccl_library']['line']}")
    for note in env.get("notes", []):
        print(f"  {note}")
    for text in env.get("footnotes", {}).values():
        print(f"  {text}")
    impls = list(dict.fromkeys(r["impl"] + r.get("mark", "") for r in doc["rows"]))
    by = {}
    for r in doc["rows"]:
        by.setdefault(r["collective"], {}).setdefault(r["size"], {})[r["impl"] + r.get("mark", "")] = r["results"]
    for collective, sizes in by.items():
        print(f"  {collective:<10} " + " ".join(f"{i:>17}" for i in impls))
        for size in sorted(sizes):
            cells = []
            for i in impls:  # (broadcast: ringcomm's is in place only, its row's in-place cell)
                res = sizes[size].get(i, {})
                g = res.get("out-of-place") or {}
                if g.get("time_us") is None:
                    g = res.get("in-place") or {}
                ok = g.get("time_us") is not None and g.get("busbw") is not None
                cells.append(f"{g['time_us']:8.1f} ({g['busbw']:6.1f})" if ok else "-")
            print(f"  {size:>10} " + " ".join(f"{c:>17}" for c in cells))
    wrong = sum(g.get("wrong") or 0 for r in doc["rows"] for g in r["results"].values())
    print(f"  wrong elements over every row: {wrong}")
cols, table, times, wrong = [], {}, {}, 0
for n in (2, 4):
    for t in ("ipc", "kernel", "kernel-ring"):
        path = os.path.join(out, f"bench_{t}_n{n}.json")
        if not os.path.exists(path):
            continue
        doc = json.load(open(path))
        ran = doc["environment"]["transport"]  # (kernel asked for, ipc where the ring kernel could not run)
        mine = t if ran == t.split("-")[0] else f"{t}, ran {ran}"
        if mine != t:
            print(f"WARNING: N={n} {t}: ringcomm ran on {ran} (see bench_{t}_n{n}.txt's header for why)")
        for r in doc["rows"]:
            if r["collective"] != "all_reduce":
                continue
            name = f"N={n} {mine if r['impl'] == 'ringcomm' else r['impl'] + r.get('mark', '')}"
            if name not in cols:
                cols.append(name)
            g = r["results"]["out-of-place"]
            if g.get("time_us") is not None:
                table.setdefault(r["size"], {})[name] = f"{g['time_us']:.1f} ({g.get('busbw') or 0:.1f})"
                times[name, r["size"]] = g["time_us"]
            wrong += sum(x.get("wrong") or 0 for x in r["results"].values())
if cols:
    print("all_reduce us per call out-of-place (busbw GB/s), ranks sharing the one GPU (ringcomm over ipc, as one "
          "kernel, and as one kernel without the one-shot: kernel-ring; NCCL):")
    print(f"  {'size':>10} " + " ".join(f"{c:>18}" for c in cols))
    for size in sorted(table):
        print(f"  {size:>10} " + " ".join(f"{table[size].get(c, '-'):>18}" for c in cols))
    print(f"  wrong elements over these rows: {wrong}")
    for n in (2, 4):  # the issue's target: at least 1.0x at every size
        nccl = next((c for c in cols if c.startswith(f"N={n} nccl")), None)
        ratios = [
            f"{size} {times[nccl, size] / times[f'N={n} kernel', size]:.2f}x"
            for size in sorted(table)
            if nccl and (nccl, size) in times and (f"N={n} kernel", size) in times
        ]
        if ratios:
            print(f"  N={n}, NCCL's time / the ring kernel's (target >= 1.0 at every size): " + ", ".join(ratios))
gr = os.path.join(out, "graph_replay.txt")
if os.path.exists(gr):
    print("CUDA graph replay (benchmarks/graph_replay.py), us per call:")
    for line in open(gr).read().splitlines():
        print(f"  {line}")
EOF
    echo "logs and JSON: $OUTDIR (all but gpu_check.log and summary.txt packed into results.tgz)"
} 2>&1 | tee -a "$LOG" | tee "$OUTDIR/summary.txt"

# A device call brings back at most 8 files from $OUT, and the steps write about 17: pack all but the log and
# the summary into one archive (the files stay where tar fails)
(cd "$OUTDIR" && files=$(ls | grep -vxE 'gpu_check\.log|summary\.txt|results\.tgz') && [ -n "$files" ] \
    && tar czf results.tgz $files && rm -f $files)

for rc in "${RCS[@]}"; do [ "$rc" = 0 ] || exit 1; done
exit 0
