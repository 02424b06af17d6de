"""The cost model (ringcomm.model), in one process: closed forms, the slowest edge, the fit, busbw, the CLI."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from ringcomm import model
from ringcomm.model import Link, Topology, fit, host_topology, predict
from ringcomm.schedule import COLLECTIVES, chain_chunks

MiB = 1 << 20


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_two_ranks_one_node_all_reduce_is_the_closed_form():
    alpha, lat, bw, mem = 7e-6, 1.5e-6, 20e9, 60e9
    topo = Topology(nodes=1, gpus_per_node=2, intra=Link(bw, lat), overhead=alpha, mem_bw=mem)
    s = 8 * MiB
    c = s / 2  # one reduce-scatter step (receive, then reduce: 3c of memory traffic) and one all-gather step
    want = (alpha + lat + c / bw + 3 * c / mem) + (alpha + lat + c / bw)
    p = predict("all_reduce", s, topo)
    assert p.steps == 2 and rel(p.time, want) < 1e-12
    assert rel(p.algbw, s / want) < 1e-12 and rel(p.busbw, s / want) < 1e-12  # 2(N-1)/N = 1 at N = 2
    # with overlap (a GPU kernel reading the peer while it reduces) the reduction hides behind the wire
    q = predict(
        "all_reduce",
        s,
        Topology(nodes=1, gpus_per_node=2, intra=Link(bw, lat), overhead=alpha, mem_bw=mem, overlap=True),
    )
    assert rel(q.time, 2 * (alpha + lat + c / bw)) < 1e-12


def test_small_all_reduce_gathers_whole_buffers_then_folds():
    n, s, alpha, bw, mem = 4, model.SMALL_BYTES, 3e-6, 10e9, 40e9
    p = predict("all_reduce", s, Topology(gpus_per_node=n, intra=Link(bw), overhead=alpha, mem_bw=mem))
    assert p.steps == n - 1
    assert rel(p.time, (n - 1) * (alpha + s / bw) + (n - 1) * 3 * s / mem) < 1e-12
    assert predict("all_reduce", s + 1, Topology(gpus_per_node=n, intra=Link(bw))).steps == 2 * (n - 1)


class OneSlowEdge(Topology):
    """A one-node ring whose edge into rank ``slow`` is a slow link."""

    slow = 3

    def edges(self):
        e = super().edges()
        e[self.slow] = ("slow", Link(1e9, 1e-5))
        return e


class SlowIntoRank1(OneSlowEdge):
    slow = 1


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_one_slow_edge_sets_the_pace_of_every_step(collective):
    n, s = 6, 64 * MiB
    fast = Topology(gpus_per_node=n, intra=Link(400e9, 1e-6), overhead=2e-6)
    slow = OneSlowEdge(gpus_per_node=n, intra=Link(400e9, 1e-6), overhead=2e-6)
    allslow = Topology(gpus_per_node=n, intra=Link(1e9, 1e-5), overhead=2e-6)
    p, q, r = predict(collective, s, fast), predict(collective, s, slow), predict(collective, s, allslow)
    assert q.time > 50 * p.time and q.slowest == "slow"
    if collective in ("broadcast", "reduce"):  # the chain uses the slow edge in P of its N + P - 2 steps
        pieces = chain_chunks(n, s, 1, model.SLICE_BYTES)
        step_slow, step_fast = 2e-6 + 1e-5 + s / pieces / 1e9, 2e-6 + 1e-6 + s / pieces / 400e9
        assert rel(q.time, pieces * step_slow + (n - 2) * step_fast) < 1e-12
    else:  # a ring uses every edge at every step: as slow as if every edge were the slow one
        assert rel(q.time, r.time) < 1e-12


def test_chains_use_every_edge_but_one():
    # from root 0, broadcast runs 0 -> 1 -> ... -> N-1 (no edge into 0); reduce runs 1 -> 2 -> ... -> 0 (none into 1)
    n, s = 5, 16 * MiB
    fast = Topology(gpus_per_node=n, intra=Link(400e9, 1e-6), overhead=2e-6)
    slow1 = SlowIntoRank1(gpus_per_node=n, intra=Link(400e9, 1e-6), overhead=2e-6)
    assert rel(predict("reduce", s, slow1).time, predict("reduce", s, fast).time) < 1e-12
    assert predict("broadcast", s, slow1).time > 50 * predict("broadcast", s, fast).time
    assert rel(predict("broadcast", s, slow1, root=1).time, predict("broadcast", s, fast, root=1).time) < 1e-12
    assert predict("reduce", s, slow1, root=1).time > 50 * predict("reduce", s, fast, root=1).time


def test_multi_node_ring_is_bounded_by_one_nic_and_rings_in_parallel_use_all_nics():
    s = 1 << 36  # large enough that latency and overhead vanish
    one = predict("all_reduce", s, model.h200_topology(2, overhead=0.0))
    assert one.slowest == "inter" and 0.99 * 50e9 < one.busbw <= 50e9
    eight = predict("all_reduce", s, model.h200_topology(2, overhead=0.0, channels=8))
    assert 0.99 * 400e9 < eight.busbw <= 400e9  # 8 NICs x 50 GB/s, under NVLink's 450
    node = predict("all_reduce", s, model.h200_topology(1, overhead=0.0))
    assert node.slowest == "intra" and 0.99 * 450e9 < node.busbw <= 450e9
    # more rings than NICs share them: no faster than one ring per NIC
    sixteen = predict("all_reduce", s, model.h200_topology(2, overhead=0.0, channels=16))
    assert sixteen.busbw <= eight.busbw * (1 + 1e-9)
    # a ring over k nodes crosses k node boundaries
    assert [k for k, _ in Topology(nodes=3, gpus_per_node=2).edges()] == ["inter", "intra"] * 3
    assert {k for k, _ in Topology(nodes=1, gpus_per_node=8).edges()} == {"intra"}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 9])
def test_busbw_is_nccl_tests_definition_for_every_collective(n):
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "broadcast": 1.0,
        "reduce": 1.0,
    }
    topo = Topology(gpus_per_node=n, intra=Link(30e9, 1e-6), overhead=4e-6, mem_bw=90e9)
    for coll in COLLECTIVES:
        p = predict(coll, 3 * MiB, topo)
        assert rel(p.algbw, 3 * MiB / p.time) < 1e-12
        assert rel(p.busbw, p.algbw * factor[coll]) < 1e-12
    assert predict("reduce_scatter", MiB, topo).steps == n - 1
    assert predict("all_gather", MiB, topo).steps == n - 1
    assert predict("broadcast", 64 * MiB, topo).steps == n + chain_chunks(n, 64 * MiB, 1, model.SLICE_BYTES) - 2


def test_ranks_sharing_cores_slow_every_step():
    a = predict("all_reduce", 16 * MiB, host_topology(4, 20e-6, 30e9, cores=0))
    b = predict("all_reduce", 16 * MiB, host_topology(4, 20e-6, 30e9, cores=2))
    c = predict("all_reduce", 16 * MiB, host_topology(2, 20e-6, 30e9, cores=2))
    d = predict("all_reduce", 16 * MiB, host_topology(2, 20e-6, 30e9, cores=0))
    assert rel(b.time, 2 * a.time) < 1e-12 and rel(c.time, d.time) < 1e-12


def synthetic(alpha: float, beta: float, cores: int) -> list[model.Measurement]:
    out = []
    for n in (2, 3, 4):
        for coll in ("all_reduce", "reduce_scatter", "broadcast"):
            for size in (64 << 10, MiB, 8 * MiB, 64 * MiB):
                t = predict(coll, size, host_topology(n, alpha, beta, cores)).time
                out.append(model.Measurement(coll, size, n, "in-place", t))
    return out


def test_fit_recovers_alpha_and_beta_from_the_models_own_data():
    f = fit(synthetic(23e-6, 17e9, cores=2), cores=2)
    assert rel(f.alpha, 23e-6) < 1e-9 and rel(f.beta, 17e9) < 1e-9 and f.rms < 1e-9
    # a wrong core count leaves an error the fit cannot hide
    assert fit(synthetic(23e-6, 17e9, cores=2), cores=0).rms > 0.05
    with pytest.raises(ValueError):
        fit(synthetic(1e-5, 1e10, 0)[:1])


def bench_json(path: Path, n: int, alpha: float, beta: float, cores: int, nodes: int = 1) -> Path:
    """A file shaped like ``python -m ringcomm.bench --json`` (report.write_json), times from the model."""
    rows = []
    for size in (64 << 10, MiB, 16 * MiB, 64 * MiB):
        t = predict("all_reduce", size, host_topology(n, alpha, beta, cores)).time
        res = {
            "time_us": t * 1e6,
            "algbw": size / t / 1e9,
            "busbw": 0.0,
            "wrong": 0,
            "iters": 20,
            "warmup": 5,
            "ratio": None,
            "note": None,
        }
        for impl in ("ringcomm", "mpi"):
            rows.append(
                {
                    "collective": "all_reduce",
                    "count": size // 4,
                    "type": "float",
                    "redop": "sum",
                    "root": -1,
                    "impl": impl,
                    "results": {"out-of-place": res, "in-place": dict(res, time_us=None)},
                    "mark": "",
                    "size": size,
                }
            )
    env = {"ranks": n, "nodes": nodes, "ranks_per_node": n, "device": "host"}
    path.write_text(json.dumps({"environment": env, "settings": {}, "rows": rows}))
    return path


def test_load_measurements_reads_ringcomm_rows_of_bench_json(tmp_path):
    ms = model.load_measurements([bench_json(tmp_path / "a.json", 3, 2e-5, 2e10, 2)])
    assert len(ms) == 4 and {m.ranks for m in ms} == {3} and {m.mode for m in ms} == {"out-of-place"}
    with pytest.raises(ValueError, match="one node"):
        model.load_measurements([bench_json(tmp_path / "b.json", 4, 2e-5, 2e10, 2, nodes=2)])


def test_cli_predict_fit_h200_sources(tmp_path, capsys):
    assert (
        model.main(
            [
                "predict",
                "--collective",
                "all_reduce",
                "--size",
                "1M,64M",
                "--nodes",
                "2",
                "--gpus-per-node",
                "8",
                "--intra-bw",
                "450e9",
                "--intra-lat",
                "2e-6",
                "--inter-bw",
                "50e9",
                "--inter-lat",
                "5e-6",
                "--overhead",
                "5e-6",
                "--channels",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| collective | size | ranks | rings | steps | time (us) | algbw (GB/s) | busbw (GB/s) |" in out
    assert "| all_reduce | 64 MiB | 16 | 1 | 30 |" in out and "inter" in out

    files = [str(bench_json(tmp_path / f"m{n}.json", n, 19e-6, 36e9, 2)) for n in (2, 3, 4)]
    assert model.main(["fit", *files, "--cores", "2"]) == 0
    out = capsys.readouterr().out
    assert "alpha = 19.00 us per step, beta = 36.00 GB/s" in out
    assert (
        "| collective | size | N | mode | measured busbw (GB/s) | predicted busbw (GB/s) | ratio (pred/meas) |" in out
    )
    assert out.count("| 1.00 |") == 12  # 4 sizes x N = 2, 3, 4, out-of-place only (in-place has no time)
    # fitted to N = 2 alone, N = 3 and 4 shown beside it: ranks sharing 2 cores slower than the model says
    slow = str(bench_json(tmp_path / "slow4.json", 4, 2 * 19e-6, 36e9 / 2, 2))
    assert model.main(["fit", files[0], "--cores", "2", "--compare", files[1], slow]) == 0
    out = capsys.readouterr().out
    assert "alpha = 19.00 us per step" in out and "fitted to 4 rows from 1 file(s), 2 more file(s) compared" in out
    assert out.count("| 1.00 |") == 8 and "| all_reduce | 64 MiB | 4 | out-of-place |" in out

    assert model.main(["h200"]) == 0
    out = capsys.readouterr().out
    for system in ("1x8", "2x8", "16x8"):
        assert f"| {system} | 1 GiB |" in out
    assert "no published figure found" in out and "https://github.com/NVIDIA/nccl-tests/issues/212" in out

    assert model.main(["sources"]) == 0
    out = capsys.readouterr().out
    assert all(p.url in out for p in model.PUBLISHED if p.url != "-")

    assert model.main(["fit", str(tmp_path / "missing.json")]) == 2


def test_module_runs_as_a_command():
    r = subprocess.run(
        [sys.executable, "-m", "ringcomm.model", "predict", "--size", "64M"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "| all_reduce | 64 MiB | 8 | 1 | 14 |" in r.stdout


def test_published_figures_name_their_sources_and_cover_each_system():
    assert {p.config for p in model.PUBLISHED} == {"1x8", "2x8", "16x8"}
    for p in model.PUBLISHED:
        assert p.url == "-" or p.url.startswith("https://github.com/NVIDIA/"), p
        assert p.url == "-" or (p.title != "-" and p.who != "-")


def test_defaults_mirror_the_communicators():
    tree = ast.parse((Path(model.__file__).parent / "communicator.py").read_text())
    values = {
        t.id: eval(compile(ast.Expression(node.value), "communicator.py", "eval"), {})
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name) and t.id.startswith("DEFAULT_") and isinstance(node.value, (ast.Constant, ast.BinOp))
    }
    assert values["DEFAULT_SLICE_BYTES"] == model.SLICE_BYTES
    assert values["DEFAULT_SMALL_BYTES"] == model.SMALL_BYTES


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError):
        predict("all_to_all", 8, Topology())
    with pytest.raises(ValueError):
        predict("all_reduce", 8, Topology(gpus_per_node=1))
    with pytest.raises(ValueError):
        Topology(intra=Link(0.0))
    assert math.isinf(predict("all_reduce", 0, Topology()).algbw)


def test_one_gpu_transports_differ_by_their_step_cost_only(capsys):
    """On one shared GPU the bytes cost every transport alike: NCCL beats ipc by its smaller
    per-step cost, most at medium sizes, and the gap closes toward 1 GiB (within 30 %)."""
    from ringcomm.model import ONE_GPU_OVERHEAD, one_gpu_topology

    mib, gib = 1 << 20, 1 << 30
    for n in (2, 4):
        bw = {t: predict("all_reduce", mib, one_gpu_topology(n, t)).busbw for t in ONE_GPU_OVERHEAD}
        assert bw["nccl"] > bw["ipc"]
        big = {t: predict("all_reduce", gib, one_gpu_topology(n, t)).busbw for t in ONE_GPU_OVERHEAD}
        assert max(big.values()) / min(big.values()) < 1.3 < max(bw.values()) / min(bw.values())
        # 2(N-1) steps of S/N, each paced by the shared HBM, plus the step cost
        p = predict("all_reduce", gib, one_gpu_topology(n, "ipc"))
        hbm = model.H200_MEM_BW
        want = (n - 1) * (ONE_GPU_OVERHEAD["ipc"] + 3 * gib / hbm) + (n - 1) * (ONE_GPU_OVERHEAD["ipc"] + 2 * gib / hbm)
        assert rel(p.time, want) < 1e-9
    assert model.main(["one-gpu", "--ranks", "2,4", "--sizes", "64K,1G"]) == 0
    out = capsys.readouterr().out
    assert "| size | N=2 ipc | N=2 nccl | N=4 ipc | N=4 nccl |" in out
    assert "| 64 KiB |" in out and "| 1 GiB |" in out
