"""Bandwidth of ringcomm's reduce and copy kernels beside cudaMemcpy (device to device) and CuPy's add.

    python benchmarks/kernel_bench.py [--sizes-mib 256 512 1024] [--dtypes float16 bfloat16 float32]
                                      [--iters 20] [--json out.json]

For each size (bytes of one operand) and dtype, every variant is timed with CUDA events over
``--iters`` runs after warm-up, and the median is reported. Bandwidth counts the bytes each variant
must move through device memory: reduce ``c = a + b`` and ``cupy.add(a, b, out=c)`` read two
operands and write one (3x the size), the in-place reduce ``a = a + b`` the same, copy and memcpy
read one and write one (2x). Ratios compare variants measured in the same run:
reduce/memcpy and copy/memcpy in bandwidth, and the reduce's speed-up over cupy.add in time
(issue 3's targets: >= 0.9 and >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np


def _bf16_bits(cp, x):
    """float32 CuPy array -> uint16 array of the bfloat16 bits (round to nearest even)."""
    u = x.view(cp.uint32)
    return ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)


def _time(cp, fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (queued on the current stream) over ``iters`` CUDA-event timings."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(iters):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def run(sizes_mib: list[int], dtypes: list[str], iters: int) -> list[dict]:
    import cupy as cp

    from ringcomm.devices import cuda

    dev_id = cp.cuda.runtime.getDevice()
    props = cp.cuda.runtime.getDeviceProperties(dev_id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    print(f"# device {dev_id}: {name}, {cuda.sm_count(dev_id)} SMs; CuPy {cp.__version__}", flush=True)
    stream = cp.cuda.get_current_stream()
    d2d = getattr(cp.cuda.runtime, "memcpyDeviceToDevice", 3)  # cudaMemcpyDeviceToDevice
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        for dname in dtypes:
            itemsize = 2 if dname in ("float16", "bfloat16") else np.dtype(dname).itemsize
            n = nbytes // itemsize
            rng = cp.random.default_rng(mib)
            fa = rng.standard_normal(n, dtype=cp.float32)
            fb = rng.standard_normal(n, dtype=cp.float32)
            if dname == "bfloat16":  # raw bits: works whether or not this CuPy has a bfloat16 dtype
                a, b = _bf16_bits(cp, fa), _bf16_bits(cp, fb)
            else:
                a, b = fa.astype(dname), fb.astype(dname)
            del fa, fb
            c = cp.empty_like(a)
            suffix = cuda.SUFFIX[np.dtype(dname) if dname != "bfloat16" else cuda.bfloat16]
            rname = f"ringcomm_reduce_sum_{suffix}"
            rk, ck = cuda.kernel("reduce.cu", rname), cuda.kernel("copy.cu", "ringcomm_copy")
            rgrid = cuda._grid(rk, rname, dev_id, -(-nbytes // (16 * cuda.UNROLL)))
            cgrid = cuda._grid(ck, "ringcomm_copy", dev_id, -(-nbytes // (16 * cuda.UNROLL)))
            pa, pb, pc = (np.uint64(x.data.ptr) for x in (a, b, c))
            zero, one = np.int32(0), np.float64(1.0)

            def reduce_out():
                rk((rgrid,), (cuda.BLOCK,), (pc, pa, pb, np.uint64(n), zero, one), stream=stream)

            def reduce_inplace():
                rk((rgrid,), (cuda.BLOCK,), (pc, pc, pb, np.uint64(n), zero, one), stream=stream)

            def copy_kernel():
                ck((cgrid,), (cuda.BLOCK,), (pc, pa, np.uint64(nbytes)), stream=stream)

            def memcpy():
                cp.cuda.runtime.memcpyAsync(c.data.ptr, a.data.ptr, nbytes, d2d, stream.ptr)

            def cupy_add():
                cp.add(a, b, out=c)

            # what is timed computes the right thing: the reduce bit for bit (one rounding from float32)
            reduce_out()
            if dname == "bfloat16":
                wide = (a.astype(cp.uint32) << 16).view(cp.float32) + (b.astype(cp.uint32) << 16).view(cp.float32)
                ok = bool((c == _bf16_bits(cp, wide)).all())
            else:
                ok = bool((c == (a.astype(cp.float32) + b.astype(cp.float32)).astype(dname)).all())
            copy_kernel()
            ok = ok and bool((c == a).all())
            t = {
                "reduce": _time(cp, reduce_out, iters),
                "reduce_inplace": _time(cp, reduce_inplace, iters),
                "copy": _time(cp, copy_kernel, iters),
                "memcpy": _time(cp, memcpy, iters),
                "cupy_add": None,
            }
            try:
                if dname == "bfloat16":  # only where this CuPy has bfloat16 arrays
                    a, b, c = (x.view(cuda.bfloat16) for x in (a, b, c))
                t["cupy_add"] = _time(cp, cupy_add, iters)
            except Exception as e:  # noqa: BLE001
                print(f"# cupy.add on {dname} unavailable: {type(e).__name__}: {e}", flush=True)
            gbs = {
                k: (
                    None
                    if v is None
                    else (3 if k in ("reduce", "reduce_inplace", "cupy_add") else 2) * nbytes / v / 1e6
                )
                for k, v in t.items()
            }
            row = {
                "size_mib": mib,
                "dtype": dname,
                "elements": n,
                "checked": ok,
                "ms": t,
                "GBps": gbs,
                "reduce_vs_memcpy": gbs["reduce"] / gbs["memcpy"],
                "reduce_inplace_vs_memcpy": gbs["reduce_inplace"] / gbs["memcpy"],
                "copy_vs_memcpy": gbs["copy"] / gbs["memcpy"],
                "reduce_speedup_vs_cupy_add": (t["cupy_add"] / t["reduce"]) if t["cupy_add"] else None,
                "grid": {"reduce": rgrid, "copy": cgrid, "block": cuda.BLOCK},
            }
            rows.append(row)
            print(format_row(row), flush=True)
            a = b = c = None  # free this size's arrays before the next size's
            cp.get_default_memory_pool().free_all_blocks()
    return rows


HEADER = (
    f"{'size':>8} {'dtype':>9} | {'reduce GB/s':>11} {'in-place':>9} {'copy':>8} {'memcpy':>8} {'cupy.add':>9} | "
    f"{'red/memcpy':>10} {'copy/memcpy':>11} {'red vs add':>10} ok"
)


def format_row(r: dict) -> str:
    g = r["GBps"]
    add = f"{g['cupy_add']:9.0f}" if g["cupy_add"] else f"{'n/a':>9}"
    speed = f"{r['reduce_speedup_vs_cupy_add']:9.2f}x" if r["reduce_speedup_vs_cupy_add"] else f"{'n/a':>10}"
    return (
        f"{r['size_mib']:>5}MiB {r['dtype']:>9} | {g['reduce']:11.0f} {g['reduce_inplace']:9.0f} {g['copy']:8.0f} "
        f"{g['memcpy']:8.0f} {add} | {r['reduce_vs_memcpy']:10.3f} {r['copy_vs_memcpy']:11.3f} {speed} "
        f"{'yes' if r['checked'] else 'NO'}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument(
        "--dtypes",
        nargs="+",
        default=["float16", "bfloat16", "float32"],
        choices=["float16", "bfloat16", "float32", "float64"],
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    print(HEADER)
    rows = run(args.sizes_mib, args.dtypes, args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "kernel_bench", "rows": rows}, f, indent=1)
    return 0 if all(r["checked"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
