"""Single-process tests of ringcomm.bench: the table's arithmetic, the test data, the output format."""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import pytest

from ringcomm import schedule
from ringcomm.bench import data, report, sizes
from ringcomm.bench.__main__ import Plan, build_parser, main
from ringcomm.bench.cli import UsageError
from ringcomm.bench.runner import Progress, Result, Row, Settings, Watchdog, add_ratios
from ringcomm.ops import ReduceOp, bfloat16

# ------------------------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("0", 0),
        ("64K", 65536),
        ("128M", 128 << 20),
        ("1G", 1 << 30),
        ("4k", 4096),
        ("2MiB", 2 << 20),
        (" 3 KB ", 3072),
        (17, 17),
    ],
)
def test_parse_size(text, expected):
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "-1", "1.5M", "12T", "M", "abc", "8 8", -3])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        sizes.parse_size(text)


def test_format_size():
    assert [sizes.format_size(n) for n in (8, 1024, 1536, 64 << 20, 3 << 30)] == [
        "8 B",
        "1 KiB",
        "1.5 KiB",
        "64 MiB",
        "3 GiB",
    ]


def test_sweep_by_factor_and_step():
    assert sizes.sweep_sizes(8, 100, factor=2) == [8, 16, 32, 64]
    assert sizes.sweep_sizes(8, 128 << 20, factor=2) == [8 << k for k in range(25)]
    assert sizes.sweep_sizes(1 << 20, 1 << 20, factor=4) == [1 << 20]
    assert sizes.sweep_sizes(0, 10, step=4) == [0, 4, 8]
    assert sizes.sweep_sizes(1024, 4096, step=1024) == [1024, 2048, 3072, 4096]


@pytest.mark.parametrize(
    "lo, hi, kw",
    [
        (8, 4, {"factor": 2}),
        (8, 64, {"factor": 1}),
        (0, 64, {"factor": 2}),
        (8, 64, {}),
        (8, 64, {"factor": 2, "step": 8}),
        (8, 64, {"step": 0}),
        (-1, 8, {"step": 1}),
    ],
)
def test_sweep_rejects(lo, hi, kw):
    with pytest.raises(ValueError):
        sizes.sweep_sizes(lo, hi, **kw)


def test_element_count_rounding():
    # whole elements only
    assert sizes.element_count(10, 4, "all_reduce", 4) == 2
    assert sizes.element_count(7, 8, "broadcast", 3) == 0
    # sharded collectives: a multiple of ALIGN * ranks, so every shard is equal
    assert sizes.count_multiple("reduce_scatter", 4) == schedule.ALIGN * 4
    assert sizes.element_count(1000, 4, "reduce_scatter", 4) == 192
    assert sizes.element_count(1024, 4, "all_gather", 4) == 256
    assert sizes.element_count(128, 4, "all_gather", 4) == 0
    for count in (48, 96, 480):
        bounds = schedule.partition(sizes.element_count(count * 4, 4, "reduce_scatter", 3), 3)
        assert len({hi - lo for lo, hi in bounds}) == 1
    # small sizes that round to one count give one row
    assert sizes.sweep_counts([8, 16, 32, 64, 128, 256, 512], 4, "reduce_scatter", 4) == [0, 64, 128]
    assert sizes.sweep_counts([8, 16], 4, "all_reduce", 4) == [2, 4]


def test_bus_factors_and_bandwidths():
    assert sizes.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert sizes.bus_factor("all_reduce", 1) == 0
    assert sizes.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert sizes.bus_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert sizes.bus_factor("broadcast", 5) == sizes.bus_factor("reduce", 5) == 1
    assert sizes.algbw(2_000_000_000, 2.0) == pytest.approx(1.0)
    assert sizes.algbw(100, 0.0) == 0.0
    assert sizes.busbw("all_reduce", 1_000_000_000, 1.0, 8) == pytest.approx(1.75)
    assert sizes.busbw("all_gather", 3_000_000, 1e-3, 3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown collective"):
        sizes.bus_factor("alltoall", 2)


# -------------------------------------------------------------------------------------- data

ALL_OPS = [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG, None]


def test_type_names():
    assert data.parse_dtype("float") == np.float32 and data.parse_dtype("fp16") == np.float16
    assert data.parse_dtype("bf16") == bfloat16 and data.parse_dtype("DOUBLE") == np.float64
    assert data.type_name(np.float32) == "float" and data.type_name(bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="accepted"):
        data.parse_dtype("complex64")


@pytest.mark.parametrize("dtype", list(data.TYPE_NAMES.values()), ids=list(data.TYPE_NAMES))
def test_value_tables_keep_every_partial_result_exact(dtype):
    for nranks in (1, 2, 3, 4, 7, 16, 64):
        for op in ALL_OPS:
            if op is ReduceOp.AVG and not data.is_float(dtype):
                continue
            tables = [data.value_table(dtype, op, nranks, r) for r in range(nranks)]
            for t in tables:
                assert t.size & (t.size - 1) == 0 and t.dtype == dtype
                assert np.unique(t.astype(np.float64)).size == t.size  # all distinct
            lo = [float(t.astype(np.float64).min()) for t in tables]
            hi = [float(t.astype(np.float64).max()) for t in tables]
            if op in (ReduceOp.SUM, ReduceOp.AVG):
                worst = max(abs(sum(lo)), abs(sum(hi)))
                assert worst <= data.exact_limit(dtype)
            elif op is ReduceOp.PROD:
                worst = np.prod([max(abs(a), abs(b)) for a, b in zip(lo, hi)])
                top = float(np.iinfo(dtype).max) if not data.is_float(dtype) else float(data._finfo(dtype).max)
                assert worst <= top
            # the poison value is never a possible result
            if not data.is_float(dtype):
                assert max(hi) < np.iinfo(dtype).max
            assert max(t.size for t in tables) >= (2 if op is not ReduceOp.PROD else 1)


def test_rank_values_are_deterministic_distinct_and_blockwise():
    table = data.value_table(np.float32, ReduceOp.SUM, 2, 0)
    whole = data.rank_values(table, 7, 1, 0, np.empty(3 * data.BLOCK + 5, np.float32))
    part = data.rank_values(table, 7, 1, data.BLOCK - 3, np.empty(10, np.float32))
    assert np.array_equal(whole[data.BLOCK - 3 : data.BLOCK + 7], part)
    other_rank = data.rank_values(table, 7, 0, 0, np.empty(whole.size, np.float32))
    other_seed = data.rank_values(table, 8, 1, 0, np.empty(whole.size, np.float32))
    assert np.mean(whole == other_rank) < 0.01 and np.mean(whole == other_seed) < 0.01
    assert np.unique(whole).size > table.size // 2  # uses the whole table
    # indices past 2^32 work and differ from the low ones
    high = data.rank_values(table, 7, 1, (1 << 32) - 2, np.empty(4, np.float32))
    assert high.shape == (4,)
    below = data.rank_values(table, 7, 1, (1 << 32) - 4, np.empty(4, np.float32))
    n = 1 << 17  # twice the table: most of its values appear
    above = data.rank_values(table, 7, 1, 1 << 32, np.empty(n, np.float32))  # the low indices + 2^32
    # a call across the 2^32 boundary gives what calls on either side give
    assert np.array_equal(high[:2], below[2:]) and np.array_equal(high[2:], above[:2])
    assert np.mean(above == whole[:n]) < 0.01  # index i + 2^32 is not index i again
    assert np.unique(above).size > table.size // 2


def _naive_expected(case: data.Case, seed: int) -> np.ndarray:
    """Every rank's input from the public function, reduced with numpy in float64."""
    inputs = []
    for r in range(case.nranks):
        other = data.Case(case.collective, case.count, case.dtype, case.op, case.root, case.nranks, r, case.bounds)
        inputs.append(data.input_data(other, seed).astype(np.float64))
    c = case.collective
    if c == "all_gather":
        return np.concatenate(inputs)
    if c == "broadcast":
        return inputs[case.root]
    if c == "reduce" and case.rank != case.root:
        return inputs[case.rank]
    fn = {
        ReduceOp.SUM: np.sum,
        ReduceOp.AVG: np.mean,
        ReduceOp.PROD: np.prod,
        ReduceOp.MIN: np.min,
        ReduceOp.MAX: np.max,
    }[case.op]
    full = fn(np.stack(inputs), axis=0)
    if c == "reduce_scatter":
        lo, hi = case.shard
        return full[lo:hi]
    return full


@pytest.mark.parametrize("collective", schedule.COLLECTIVES)
def test_expected_result_matches_a_naive_reference(collective):
    nranks, count = 3, 2 * 16 * 3 + (0 if collective in sizes.SHARDED else 7)
    bounds = tuple(schedule.partition(count, nranks))
    ops = [None] if collective in ("all_gather", "broadcast") else list(ReduceOp)
    for dtype in (np.dtype(np.float32), np.dtype(np.int8), bfloat16, np.dtype(np.float16)):
        for op in ops:
            if op is ReduceOp.AVG and not data.is_float(dtype):
                continue
            for rank in range(nranks):
                case = data.Case(
                    collective,
                    count,
                    dtype,
                    op,
                    1 if collective in ("broadcast", "reduce") else -1,
                    nranks,
                    rank,
                    bounds,
                )
                got = data.expected_result(case, 11)
                assert got.dtype == data.expected_dtype(case)
                np.testing.assert_array_equal(got.astype(np.float64), _naive_expected(case, 11))


def test_count_wrong():
    exp = np.arange(10, dtype=np.float32)
    got = exp.copy()
    assert data.count_wrong(got, exp, np.float32, ReduceOp.SUM) == 0
    got[[1, 5]] = data.poison_value(np.float32)
    got[7] += 1
    assert data.count_wrong(got, exp, np.float32, ReduceOp.SUM) == 3
    ints = np.arange(5, dtype=np.int32)
    assert data.count_wrong(np.full(5, data.poison_value(np.int32)), ints, np.int32, ReduceOp.MAX) == 5
    # avg: one unit in the last place is accepted, more is not
    e64 = np.array([1 / 3, 2 / 3, 5.0, 0.0])
    g = e64.astype(np.float32)
    assert data.count_wrong(g, e64, np.float32, ReduceOp.AVG) == 0
    g[2] = np.nextafter(g[2], np.float32(6))  # 1 ulp above 5
    assert data.count_wrong(g, e64, np.float32, ReduceOp.AVG) == 0
    g[2] = np.nextafter(g[2], np.float32(6))  # 2 ulps
    g[3] = 1e-30
    assert data.count_wrong(g, e64, np.float32, ReduceOp.AVG) == 2
    with pytest.raises(ValueError):
        data.count_wrong(np.zeros(3), np.zeros(4), np.float64, ReduceOp.SUM)


def test_plant_indices():
    for size, n in ((10, 3), (5, 5), (5, 9), (1000, 7), (0, 3)):
        idx = data.plant_indices(size, n)
        assert idx.size == min(size, n) == np.unique(idx).size
        assert idx.size == 0 or (idx.min() >= 0 and idx.max() < size)


# ------------------------------------------------------------------------------------ output


def _row(impl: str, t_oop: float | None, t_ip: float, wrong: int = 0) -> Row:
    def res(t: float | None) -> Result:
        if t is None:
            return Result(note="in place only")
        return Result(t * 1e6, sizes.algbw(4096, t), sizes.busbw("all_reduce", 4096, t, 4), wrong, 20, 5)

    return Row("all_reduce", 4096, 1024, "float", "sum", -1, impl, {"out-of-place": res(t_oop), "in-place": res(t_ip)})


def test_table_round_trip_and_footer():
    rows = [_row("ringcomm", 1e-4, 2e-4, wrong=3), _row("mpi", 2e-4, None)]
    add_ratios(rows)
    assert rows[1].results["out-of-place"].ratio == pytest.approx(2.0)
    layout = report.Layout.for_impls(["ringcomm", "mpi"])
    text = "\n".join(
        report.column_header(layout)
        + [report.format_row(r, layout) for r in rows]
        + report.footer(rows, ["ringcomm", "mpi"], True, 20, 5)
    )
    (table,) = report.parse_tables(text)
    assert table.wrong == 6 and table.status == "FAILED"  # 3 in each mode
    assert table.avg_busbw == pytest.approx(np.mean([rows[0].results[m].busbw for m in report.MODES]), rel=1e-4)
    a, b = table.rows
    keys = (a["size"], a["count"], a["type"], a["redop"], a["root"], a["impl"])
    assert keys == (4096, 1024, "float", "sum", -1, "ringcomm")
    assert a["out-of-place"]["time"] == pytest.approx(100.0) and a["in-place"]["#wrong"] == 3
    assert a["out-of-place"]["ratio"] is None  # "-" on the reference's own rows
    assert b["out-of-place"]["ratio"] == pytest.approx(2.0) and b["in-place"]["time"] is None
    assert "# N/A: mpi in-place: in place only" in text


def test_single_implementation_table_has_nccl_tests_columns():
    layout = report.Layout.for_impls(["ringcomm"])
    names = report.column_header(layout)[1].lstrip("#").split()
    assert names == [
        "size",
        "count",
        "type",
        "redop",
        "root",
        "time",
        "algbw",
        "busbw",
        "#wrong",
        "time",
        "algbw",
        "busbw",
        "#wrong",
    ]
    # and the parser reads nccl-tests' own output
    nccl_tests = """#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    18.39    0.00    0.00      0    17.96    0.00    0.00      0
    33554432       8388608     float     sum      -1    402.1   83.45  146.04      0    401.5   83.57  146.25      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 73.0733
"""
    (t,) = report.parse_tables(nccl_tests)
    assert len(t.rows) == 2 and t.status == "OK" and t.avg_busbw == pytest.approx(73.0733)
    assert t.rows[1]["in-place"]["busbw"] == pytest.approx(146.25)


def test_json_rows(tmp_path):
    rows = [_row("ringcomm", 1e-4, 2e-4)]
    path = tmp_path / "out.json"
    report.write_json(str(path), {"ranks": 4}, {"iters": 20}, rows)
    doc = json.loads(path.read_text())
    assert doc["environment"]["ranks"] == 4 and doc["rows"][0]["size"] == 4096
    assert doc["rows"][0]["results"]["in-place"]["time_us"] == pytest.approx(200.0)


def test_plot_writes_png(tmp_path):
    rows = [_row("ringcomm", 1e-4, 2e-4), _row("mpi", 2e-4, None)]
    path = tmp_path / "bw.png"
    report.plot(str(path), rows, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- command line


def _plan(*argv: str) -> Plan:
    return Plan.from_args(build_parser(quiet=True).parse_args(list(argv)))


def test_plan_defaults_and_all():
    plan = _plan()
    plan.resolve("host", build_parser(quiet=True).parse_args([]))
    assert plan.collectives == ["all_reduce"] and plan.impls == ["ringcomm", "mpi"]
    assert plan.sizes[0] == 8 and plan.sizes[-1] <= 64 << 20 and plan.settings.check
    plan = _plan("-c", "all", "-d", "all", "-o", "all", "-b", "1K", "-e", "1M", "-i", "256K")
    assert plan.collectives == list(schedule.COLLECTIVES)
    assert (np.dtype(np.int32), ReduceOp.AVG) not in plan.combos
    assert any(s.startswith("int32 avg") for s in plan.skipped)
    assert plan.step == "262144(bytes)"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["-f", "2", "-i", "1K"], "not both"),
        (["-b", "8x"], "minbytes"),
        (["-b", "1M", "-e", "1K"], "larger"),
        (["-d", "int32", "-o", "avg"], "floor"),
        (["--impl", "ringcomm,gloo"], "impl"),
        (["-n", "0"], "iterations"),
        (["-o", "mean"], "unsupported op"),
        (["-d", "complex"], "data type"),
        (["-f", "1"], "factor"),
        (["--min-time", "-1"], "shortest timed loop"),
    ],
)
def test_plan_rejects(argv, match):
    with pytest.raises((UsageError, ValueError), match=match):
        _plan(*argv)


def test_main_usage_errors_and_help(capsys):
    assert main(["-c", "alltoall"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert main(["-e", "banana"]) == 2
    assert "maxbytes" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "--collective" in capsys.readouterr().out
    assert "--corrupt-for-tests" not in build_parser().format_help()


def test_settings_validation():
    with pytest.raises(ValueError):
        Settings(stat="mean")
    with pytest.raises(ValueError):
        Settings(warmup=-1)
    with pytest.raises(ValueError, match="shortest timed loop"):
        Settings(min_time=-0.1)
    assert "median" in Settings(stat="median").describe()
    assert "last at least 0.02 s" in Settings(min_time=0.02).describe() and "last at" not in Settings().describe()
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        Settings(rounds=0)
    assert "fastest of 3 rounds" in Settings(rounds=3).describe() and "rounds" not in Settings().describe()


def test_progress_bar_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        bar = Progress(4, enabled=True, delay=0.0, stream=stream)
        bar.step("all_reduce 8 B")
        bar.close()
    assert "1/4" in tty.getvalue() and pipe.getvalue() == ""
    quiet = Tty()
    Progress(4, enabled=False, delay=0.0, stream=quiet).step("x")  # ranks other than 0
    assert quiet.getvalue() == ""


def test_watchdog_aborts_when_no_progress(capsys):
    called = threading.Event()
    dog = Watchdog(0.2, rank=5, abort=lambda code: called.set())
    try:
        assert called.wait(5.0)
    finally:
        dog.stop()
    assert "rank 5: no progress for 0.2 s in start-up" in capsys.readouterr().err
    calm = threading.Event()
    dog = Watchdog(0.5, rank=0, abort=lambda code: calm.set())
    for _ in range(8):
        dog.beat("working")
        time.sleep(0.1)
    dog.stop()
    assert not calm.is_set()
