#!/usr/bin/env bash
# The prepared GPU check (issue 3): on a machine with one GPU and no internet, in about 6 minutes.
#
#   bash benchmarks/gpu_check.sh            # from the repository root; writes JSON/logs under $OUT if set
#
# 1. installs carried wheels if any (.whl/ or wheels/ in the repo root, or $WHEELS: e.g. mpich and
#    mpi-pytest, which the GPU image lacks), then ringcomm itself (editable, no dependencies);
# 2. compiles the kernels once (NVRTC through CuPy; CuPy's disk cache keeps them for the ranks);
# 3. runs the GPU tests (tests/gpu) at N = 1 (the kernel tests too) and N = 2 ranks on the GPU;
# 4. the kernel benchmark (benchmarks/kernel_bench.py: reduce/copy vs cudaMemcpy and cupy.add);
# 5. all-reduce of 1 GiB with 2 ranks on the one GPU, IPC against staged (benchmarks/allreduce_transports.py);
# 6. the GPU tests at N = 4, and tests/test_zero_gpu.py (last: a hang there cannot starve 4 and 5).
# Every step has its own timeout, all within GPU_CHECK_BUDGET seconds (default 340); a failed step
# does not stop the others. The summary table is printed last; the exit status is 0 only when every
# step ran and passed. GPU_CHECK_NO_INSTALL=1 skips the pip installs (the source tree is used).
# Multi-rank waits use RINGCOMM_TEST_TIMEOUT (default here 20 s), well inside each step's timeout,
# so a hang ends as a ringcomm TimeoutError naming the collective, step and peer, not as a kill.
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
BUDGET=${GPU_CHECK_BUDGET:-340}  # seconds for everything; a step gets at most what is left of it
declare -a NAMES=() RCS=() SECS=()

say() { echo "[gpu_check +$(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# step NAME TIMEOUT_S CMD...: run with a timeout (capped by what is left of BUDGET), output to the log
step() {
    local name=$1 limit=$2
    shift 2
    local t=$(date +%s) left=$((BUDGET - ($(date +%s) - T0)))
    if [ "$left" -lt 15 ]; then
        NAMES+=("$name") RCS+=("skipped") SECS+=(0)
        say "== $name: skipped, the ${BUDGET}s budget is spent"
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    say "== $name (timeout ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    NAMES+=("$name") RCS+=("$rc") SECS+=("$(($(date +%s) - t))")
    [ "$rc" = 124 ] && say "   $name: TIMED OUT after ${limit}s"
    say "   $name: rc=$rc in $(($(date +%s) - t))s"
    return 0
}

# ---------------------------------------------------------------------------------------- 1. set-up
say "python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG" || true
# the MPI from the mpich wheel lands beside the interpreter: bin/ and lib/ of its prefix (not --target:
# pip drops a wheel's data lib/ there, and libmpi.so.12 with it); if that prefix is read-only,
# a --prefix of our own, reached through PYTHONPATH, PATH and LD_LIBRARY_PATH
PREFIX=$($PY -c 'import sys; print(sys.prefix)')
for dir in ${WHEELS:-} .whl wheels; do
    if [ -d "$dir" ] && ls "$dir"/*.whl >/dev/null 2>&1; then
        say "installing carried wheels from $dir: $(cd "$dir" && ls *.whl | tr '\n' ' ')"
        if ! $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$dir"/*.whl >>"$LOG" 2>&1; then
            PREFIX=/tmp/ringcomm_prefix
            SITE=$($PY -c "import sysconfig; print(sysconfig.get_path('purelib', 'posix_prefix', {'base': '$PREFIX', 'platbase': '$PREFIX'}))")
            if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$PREFIX" "$dir"/*.whl \
                >>"$LOG" 2>&1; then
                export PYTHONPATH=$SITE:${PYTHONPATH:-}
                say "   installed under $PREFIX (the interpreter's prefix is not writable)"
            else
                say "   (the wheels did not install; see the log)"
            fi
        fi
        break
    fi
done
export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib:${LD_LIBRARY_PATH:-}
if [ -n "${GPU_CHECK_NO_INSTALL:-}" ]; then
    export PYTHONPATH=$ROOT:${PYTHONPATH:-}
elif ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$LOG" 2>&1; then
    say "pip install -e . failed; using the source tree through PYTHONPATH"
    export PYTHONPATH=$ROOT:${PYTHONPATH:-}
fi
$PY - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib
for name in ("cupy", "mpi4py.MPI", "pytest", "pytest_mpi", "ml_dtypes", "ringcomm"):
    try:
        m = importlib.import_module(name)
        print(f"  {name:12s} {getattr(m, '__version__', '')} {getattr(m, '__file__', '')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name:12s} MISSING: {type(e).__name__}: {e}")
try:
    from mpi4py import MPI
    print("  MPI library:", MPI.Get_library_version().splitlines()[0])
    from ringcomm.transports.staged import cuda_aware_mpi
    print("  CUDA-aware MPI:", cuda_aware_mpi())
except Exception as e:  # noqa: BLE001
    print("  MPI: unavailable:", e)
EOF
HAVE_MPIEXEC=0
command -v mpiexec >/dev/null 2>&1 && $PY -c "import pytest_mpi, mpi4py.MPI" >/dev/null 2>&1 && HAVE_MPIEXEC=1
[ $HAVE_MPIEXEC = 1 ] || say "no mpiexec or mpi-pytest: multi-rank steps are skipped (carry the mpich and mpi-pytest wheels)"
$PY -c "import mpi4py.MPI" >/dev/null 2>&1 || say "mpi4py.MPI does not import (no libmpi): ringcomm cannot import, every step below fails"
no_mpi() { NAMES+=("$1") RCS+=("no-mpiexec") SECS+=(0); }

# ----------------------------------------------------------------------------------- 2. compile once
step compile 60 $PY -c "
import time; t = time.perf_counter()
from ringcomm.devices import cuda; cuda.warm_up()
print(f'kernels compiled (or loaded from the cache) in {time.perf_counter() - t:.1f} s')"

# ------------------------------------------------------------------------------------- 3. GPU tests
TESTLOG=$OUTDIR/gpu_tests.log
: >"$TESTLOG"
run_tests() {  # N timeout MARKEXPR: mpi-pytest marks a test parallel[n] for each of its nprocs
    local n=$1 limit=$2 expr=$3
    step "tests N=$n" "$limit" bash -o pipefail -c \
        "$PY -m pytest tests/gpu -q -rs -p no:cacheprovider -m '$expr' 2>&1 | tee -a '$TESTLOG'"
}
# N=1: the unmarked kernel tests (tests/gpu/test_cuda_kernels.py) and the parallel[1] ones; without
# mpi-pytest there are no parallel[n] marks, so only the kernel tests
if [ $HAVE_MPIEXEC = 1 ]; then
    run_tests 1 90 "not parallel or parallel[1]"
    run_tests 2 60 "parallel[2]"
else
    run_tests 1 90 "not parallel"
    no_mpi "tests N=2"
fi

# ------------------------------------------------------------------------------- 4. kernel benchmark
step "kernel bench" 45 $PY benchmarks/kernel_bench.py --json "$OUTDIR/kernel_bench.json"

# ----------------------------------------------------------------- 5. all-reduce 1 GiB, IPC vs staged
if [ $HAVE_MPIEXEC = 1 ]; then
    step "allreduce ipc vs staged" 45 mpiexec -n 2 $PY benchmarks/allreduce_transports.py --mib 1024 \
        --transports ipc staged --iters 5 --json "$OUTDIR/allreduce_transports.json"
else
    no_mpi "allreduce ipc vs staged"
fi

# ------------------------------------------------------------------- 6. N = 4, and ZeRO on the GPU
if [ $HAVE_MPIEXEC = 1 ]; then
    run_tests 4 75 "parallel[4]"
else
    no_mpi "tests N=4"
fi
if [ -f tests/test_zero_gpu.py ]; then
    step "zero GPU tests" 45 bash -o pipefail -c \
        "$PY -m pytest tests/test_zero_gpu.py -q -rs -p no:cacheprovider 2>&1 | tee -a '$TESTLOG'"
fi

# ------------------------------------------------------------------------------------------ summary
{
    echo
    echo "================================ ringcomm GPU check summary ================================"
    printf '%-26s %6s %7s\n' step rc seconds
    for i in "${!NAMES[@]}"; do printf '%-26s %6s %7s\n' "${NAMES[$i]}" "${RCS[$i]}" "${SECS[$i]}"; done
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
EOF
    echo "logs and JSON: $OUTDIR"
} 2>&1 | tee -a "$LOG" | tee "$OUTDIR/summary.txt"

for rc in "${RCS[@]}"; do [ "$rc" = 0 ] || exit 1; done
exit 0
