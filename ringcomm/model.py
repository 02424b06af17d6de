"""A cost model of ringcomm's collectives: plan for scale on paper.

The ring: N = nodes x gpus_per_node ranks, the ranks of a node adjacent, so a ring over k > 1 nodes
has k edges on the inter-node link and N - k on intra-node links (one node: all intra). Edge r is
the link from rank r-1 into rank r. ringcomm runs ONE ring (one channel); ``channels`` models C
rings in parallel, as NCCL runs them (each ring moves 1/C of the data, NVLink and memory are shared
by the rings, and each ring crosses nodes on its own NIC while C <= nics_per_node).

Time of one step on edge r, chunk c bytes (per ring: c / C), all in seconds::

    t_r = f * (alpha + latency_r + wire + mem)      wire = c / bandwidth_r,  mem = 3c / mem_bw if the step reduces
    (with ``overlap``: wire + mem becomes max(wire, mem): a GPU kernel reads the peer while it reduces)

where alpha is the per-step overhead (host and software), the reduce reads two inputs and writes one,
and f = max(1, N / cores) when ranks share ``cores`` CPU cores (f = 1 when cores = 0). Every rank waits
for its left neighbour, so the slowest edge sets each step's pace: T = sum over steps of max over
the edges in use of t_r. Steps (schedule.py): all_reduce 2(N-1) steps of S/N (N-1 reducing), or for
S <= small_bytes N-1 steps of S then a local fold of N-1 reductions of S; reduce_scatter N-1 reducing
steps of S/N; all_gather N-1 steps of S/N; broadcast and reduce a pipelined chain of N + P - 2 steps of
S/P (P = schedule.chain_chunks), edge r busy in P of them. algbw = S / T; busbw = algbw x bus_factor
(nccl-tests: 2(N-1)/N all_reduce, (N-1)/N reduce_scatter and all_gather, 1 broadcast and reduce).

The host path (numpy, MPI over shared memory) is the same model with two parameters, fitted by
:func:`fit` from bench JSON files: alpha, and beta, the host's memory bandwidth in bytes moved (read
plus written) per second per rank. An MPI message of c bytes costs 4c of it (copied into shared
memory by the sender and out by the receiver, each copy reading and writing c), a reduction 3c more.

CLI (``python -m ringcomm.model``; tables in markdown, bandwidths in GB/s = 1e9 B/s):

- ``predict --collective all_reduce --size 64M --nodes 2 --gpus-per-node 8 --intra-bw 450e9 --intra-lat 2e-6
  --inter-bw 50e9 --inter-lat 5e-6 --overhead 5e-6 [--channels 1]``: time and busbw;
- ``fit run2.json run3.json run4.json``: alpha and beta by least squares over all N and sizes (relative
  error), then prediction against measurement per row;
- ``h200``: 1x8, 2x8 and 16x8 H200 (NVLink 4 within a node, 400 Gb/s per GPU between nodes): ringcomm's one
  ring, the same model with 8 rings (NCCL's scheme), and NCCL's published all-reduce busbw (:data:`PUBLISHED`);
- ``sources``: the published figures and their sources, as markdown for the README;
- ``one-gpu``: ipc and NCCL on one H200 shared by 2 and 4 ranks (per-step costs:
  :data:`ONE_GPU_OVERHEAD`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from .bench.sizes import bus_factor, format_size, parse_size
from .schedule import COLLECTIVES, chain_chunks

#: ringcomm's defaults (ringcomm.communicator.DEFAULT_SLICE_BYTES / DEFAULT_SMALL_BYTES; not imported,
#: since the communicator loads MPI): the broadcast/reduce piece size and the small all-reduce limit, bytes.
SLICE_BYTES = 4 << 20
SMALL_BYTES = 1 << 16

#: Bytes of memory traffic per byte reduced: two inputs read, one output written.
REDUCE_TRAFFIC = 3
#: Bytes of host memory traffic per byte an MPI message carries through shared memory (two copies).
MPI_TRAFFIC = 4

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Link:
    """One direction of a link: ``bandwidth`` in bytes/s, ``latency`` in seconds."""

    bandwidth: float
    latency: float = 0.0


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the ring runs.

    ``nodes`` x ``gpus_per_node`` ranks (a rank per GPU, or per host process); ``intra``/``inter``: the
    link between neighbours of one node / of two nodes (per GPU, one direction); ``overhead``: alpha,
    seconds per step (host and software: launch, handshake, Python); ``mem_bw``: local memory bandwidth
    for reductions, bytes/s (inf: free); ``overlap``: the reduction's memory traffic overlaps the
    transfer (True on GPUs) or follows it (False: the host receives, then reduces); ``channels``: rings
    in parallel (ringcomm: 1); ``nics_per_node``: inter-node NICs per node (None: one per GPU);
    ``cores``: CPU cores the ranks share (0: a core each; steps slow by N / cores when N > cores);
    ``small_bytes``, ``slice_bytes``: ringcomm's small all-reduce limit and chain piece size, bytes.
    """

    nodes: int = 1
    gpus_per_node: int = 2
    intra: Link = Link(math.inf)
    inter: Link = Link(math.inf)
    overhead: float = 0.0
    mem_bw: float = math.inf
    overlap: bool = False
    channels: int = 1
    nics_per_node: int | None = None
    cores: int = 0
    small_bytes: int = SMALL_BYTES
    slice_bytes: int = SLICE_BYTES

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.channels < 1 or self.cores < 0:
            raise ValueError(f"nodes, gpus_per_node, channels must be >= 1 and cores >= 0; got {self}")
        for link in (self.intra, self.inter):
            if not link.bandwidth > 0 or link.latency < 0:
                raise ValueError(f"a link needs bandwidth > 0 B/s and latency >= 0 s; got {link}")
        if not self.mem_bw > 0 or self.overhead < 0:
            raise ValueError(f"mem_bw must be > 0 B/s and overhead >= 0 s; got {self.mem_bw}, {self.overhead}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def slowdown(self) -> float:
        """f: how much slower each step runs because ranks share cores (1 when they do not)."""
        return max(1.0, self.ranks / self.cores) if self.cores else 1.0

    def edges(self) -> list[tuple[str, Link]]:
        """Edge r (from rank r-1 into rank r), for r = 0..N-1: its kind ("intra"/"inter") and the link
        one ring sees: NVLink shared by the rings, a NIC of its own while channels <= NICs per node."""
        c = self.channels
        nics = self.nics_per_node or self.gpus_per_node
        intra = Link(self.intra.bandwidth / c, self.intra.latency)
        inter = Link(self.inter.bandwidth * min(1.0, nics / c), self.inter.latency)
        cross = self.nodes > 1
        return [
            ("inter", inter) if cross and r % self.gpus_per_node == 0 else ("intra", intra) for r in range(self.ranks)
        ]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The model's answer: ``time`` in seconds, ``algbw`` and ``busbw`` in bytes/s, the number of
    steps, and the kind of edge that set the pace of the most time ("intra", "inter", or "fold")."""

    collective: str
    size: int
    ranks: int
    channels: int
    steps: int
    time: float
    algbw: float
    busbw: float
    slowest: str


def host_topology(ranks: int, alpha: float, beta: float, cores: int = 0) -> Topology:
    """The host path on one machine: ``ranks`` processes, per-step overhead ``alpha`` (s), memory
    bandwidth ``beta`` (bytes read + written per second per rank); an MPI message costs 4 bytes of
    traffic per byte, a reduction 3."""
    return Topology(
        nodes=1,
        gpus_per_node=ranks,
        intra=Link(beta / MPI_TRAFFIC),
        overhead=alpha,
        mem_bw=beta,
        overlap=False,
        cores=cores,
    )


def _step_times(topo: Topology, chunk: float, reduce: bool) -> tuple[np.ndarray, list[str]]:
    """Seconds of one step on every edge (per ring: chunk / channels bytes)."""
    c = chunk / topo.channels
    mem = REDUCE_TRAFFIC * c / (topo.mem_bw / topo.channels) if reduce else 0.0
    kinds, times = [], []
    for kind, link in topo.edges():
        wire = c / link.bandwidth
        body = max(wire, mem) if topo.overlap else wire + mem
        times.append(topo.slowdown * (topo.overhead + link.latency + body))
        kinds.append(kind)
    return np.array(times), kinds


def predict(collective: str, size: int, topo: Topology, root: int = 0) -> Prediction:
    """Predicted time and bandwidths of one ``collective`` of ``size`` bytes (the full buffer, as
    nccl-tests counts it) on ``topo``; ``root`` for broadcast and reduce. Needs N >= 2."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}; got {collective!r}")
    n = topo.ranks
    if n < 2:
        raise ValueError(f"the model needs at least 2 ranks; got {n}")
    if size < 0:
        raise ValueError(f"size must be >= 0 bytes; got {size}")
    spent: dict[str, float] = {}

    def ring(steps: int, chunk: float, reduce: bool) -> float:
        t, kinds = _step_times(topo, chunk, reduce)
        k = int(np.argmax(t))
        spent[kinds[k]] = spent.get(kinds[k], 0.0) + steps * t[k]
        return steps * float(t[k])

    if collective == "all_reduce" and size <= topo.small_bytes:
        steps = n - 1
        fold = topo.slowdown * (n - 1) * REDUCE_TRAFFIC * size / topo.mem_bw
        total = ring(steps, size, False) + fold
        spent["fold"] = fold
    elif collective == "all_reduce":
        steps = 2 * (n - 1)
        total = ring(n - 1, size / n, True) + ring(n - 1, size / n, False)
    elif collective in ("reduce_scatter", "all_gather"):
        steps = n - 1
        total = ring(steps, size / n, collective == "reduce_scatter")
    else:  # a pipelined chain over P pieces: edge at chain position p (1..N-1) busy at steps p-1 .. p+P-2
        pieces = chain_chunks(n, size, 1, topo.slice_bytes)
        steps = n + pieces - 2
        t, kinds = _step_times(topo, size / pieces, collective == "reduce")
        first = (root + 1) % n if collective == "broadcast" else (root + 2) % n  # rank at chain position 1
        order = [(first + p - 1) % n for p in range(1, n)]
        per_pos, pos_kind = t[order], [kinds[r] for r in order]
        total = 0.0
        for s in range(steps):
            lo, hi = max(1, s - pieces + 2), min(n - 1, s + 1)
            k = lo - 1 + int(np.argmax(per_pos[lo - 1 : hi]))
            total += float(per_pos[k])
            spent[pos_kind[k]] = spent.get(pos_kind[k], 0.0) + float(per_pos[k])
    algbw = size / total if total > 0 else math.inf
    return Prediction(
        collective,
        size,
        n,
        topo.channels,
        steps,
        total,
        algbw,
        algbw * bus_factor(collective, n),
        max(spent, key=spent.get) if spent else "-",
    )


# ------------------------------------------------------------------------------------------- fitting


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured row of a bench JSON file: ringcomm's ``time`` in seconds on ``ranks`` host ranks."""

    collective: str
    size: int
    ranks: int
    mode: str
    time: float

    @property
    def busbw(self) -> float:
        """bytes/s, as nccl-tests defines it."""
        return self.size / self.time * bus_factor(self.collective, self.ranks)


MODES = ("out-of-place", "in-place")


def load_measurements(paths: Iterable[str], modes: Sequence[str] = MODES, impl: str = "ringcomm") -> list[Measurement]:
    """The rows of ``impl`` in bench JSON files (``python -m ringcomm.bench --json FILE``: ``environment.ranks``,
    ``rows[].results[mode].time_us``), in the given modes. Host runs on one node only (ValueError otherwise)."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        env = doc.get("environment", {})
        if env.get("nodes", 1) != 1 or env.get("device", "host") != "host":
            raise ValueError(
                f"{path}: the fit models the host path on one node; this run is "
                f"{env.get('nodes')} node(s), device {env.get('device')}"
            )
        ranks = int(env["ranks"])
        for row in doc["rows"]:
            if row["impl"] != impl or row["size"] <= 0:
                continue
            for mode in modes:
                res = row["results"].get(mode) or {}
                if res.get("time_us"):
                    out.append(Measurement(row["collective"], int(row["size"]), ranks, mode, res["time_us"] * 1e-6))
    return out


@dataclasses.dataclass(frozen=True)
class Fit:
    """Fitted host parameters: ``alpha`` seconds per step, ``beta`` bytes/s of memory traffic per rank;
    ``cores`` as assumed; ``rms`` the root mean square of the relative time error."""

    alpha: float
    beta: float
    cores: int
    rms: float


def _basis(m: Measurement, cores: int) -> tuple[float, float]:
    """(a, b) with time = a * alpha + b / beta: the host model is linear in alpha and 1/beta."""
    a = predict(m.collective, m.size, host_topology(m.ranks, 1.0, math.inf, cores)).time
    b = predict(m.collective, m.size, host_topology(m.ranks, 0.0, 1.0, cores)).time
    return a, b


def fit(measurements: Sequence[Measurement], cores: int = 0) -> Fit:
    """Least squares of the relative time error over all rows (every size counts alike), alpha and
    1/beta >= 0."""
    if len(measurements) < 2:
        raise ValueError(f"fitting two parameters needs at least 2 measurements; got {len(measurements)}")
    basis = np.array([_basis(m, cores) for m in measurements])
    t = np.array([m.time for m in measurements])
    a = basis / t[:, None]  # relative: (a_i alpha + b_i gamma) / t_i ~ 1
    ones = np.ones(len(t))
    x, *_ = np.linalg.lstsq(a, ones, rcond=None)
    if x[0] < 0 or x[1] < 0:  # the best with one parameter at its bound
        cands = [
            np.array([ones @ a[:, 0] / (a[:, 0] @ a[:, 0]), 0.0]),
            np.array([0.0, ones @ a[:, 1] / (a[:, 1] @ a[:, 1])]),
        ]
        x = min(cands, key=lambda v: float(np.sum((a @ v - 1) ** 2)))
    rms = float(np.sqrt(np.mean((a @ x - 1) ** 2)))
    return Fit(float(x[0]), 1.0 / x[1] if x[1] > 0 else math.inf, cores, rms)


# ----------------------------------------------------------------------------- H200 and published NCCL


@dataclasses.dataclass(frozen=True)
class Published:
    """A published NCCL all-reduce busbw (GB/s, large messages) for a system like ``config``."""

    config: str  # "1x8", "2x8", "16x8": the row of the h200 table it belongs beside
    busbw: str  # GB/s as published (a value or a range)
    algorithm: str
    system: str
    who: str
    title: str
    url: str


#: NCCL all-reduce busbw figures found in public sources (none made up; where the exact configuration
#: was not found the table says so). "NVIDIA" marks statements by NCCL's maintainers.
PUBLISHED: tuple[Published, ...] = (
    Published(
        "1x8",
        "~370",
        "ring (NCCL_ALGO=RING; also the busbw of non-allreduce collectives)",
        "8x H100 SXM, NVLink 4 (450 GB/s line rate per direction, ~20% protocol overhead)",
        "NVIDIA (S. Jeaugey), 2024-05-06",
        "H100 all reduce performance is poor (NVIDIA/nccl-tests#212)",
        "https://github.com/NVIDIA/nccl-tests/issues/212",
    ),
    Published(
        "1x8",
        "~480",
        "NVLS (NVLink SHARP, the default for all_reduce), sizes > 256 MiB",
        "8x H100 SXM",
        "NVIDIA (S. Jeaugey), 2024-05-06",
        "H100 all reduce performance is poor (NVIDIA/nccl-tests#212)",
        "https://github.com/NVIDIA/nccl-tests/issues/212",
    ),
    Published(
        "1x8",
        "370 (NVLS off) / 480 (NVLS on)",
        "ring vs NVLS",
        "8x H100, NCCL 2.30.4",
        "user report, 2026",
        "NVLS: Bandwidth utilization appears to drop vs theoretical NVLink bandwidth (NVIDIA/nccl#2140)",
        "https://github.com/NVIDIA/nccl/issues/2140",
    ),
    Published(
        "1x8",
        "475 (peak)",
        "default (NVLS on this system), 64 KiB..4 GiB sweep",
        "8x H200, NVLink 4, NCCL 2.20.3",
        "user report, 2024-11-27",
        "[H200] NCCL's All-reduce Performance Exceed 4th Gen NVLINK Spec. (NVIDIA/nccl-tests#272)",
        "https://github.com/NVIDIA/nccl-tests/issues/272",
    ),
    Published(
        "2x8",
        "46-48 per 400G NIC (x8 NICs: 368-384)",
        "ring (NCCL_ALGO=RING advised for 2 nodes)",
        "H100 nodes, NDR 400 Gb/s InfiniBand, ConnectX-7",
        "NVIDIA (D. Addison), 2025-03-03",
        "Single-node and multi-node performance of H100 nodes (NVIDIA/nccl-tests#290)",
        "https://github.com/NVIDIA/nccl-tests/issues/290",
    ),
    Published(
        "2x8",
        "330 (NVLS off) / 430 (NVLS on); 320 on 4 nodes",
        "ring/tree vs NVLSTree, 4-8 GiB",
        "8x H100 + 8x 400G RoCE per node, NCCL 2.19.3",
        "user report, 2024-03-13",
        "NVLS don not work in systems with more than four nodes (NVIDIA/nccl#1221)",
        "https://github.com/NVIDIA/nccl/issues/1221",
    ),
    Published(
        "2x8",
        "470; 365.84 on 4 nodes",
        "default (NVLSTree on 2 nodes)",
        "HGX H100, 8 GPU-NIC pairs per node",
        "user report, 2025",
        "Acceptable performance of nccl-test on 2 HGX hosts? (NVIDIA/nccl-tests#309)",
        "https://github.com/NVIDIA/nccl-tests/issues/309",
    ),
    Published("16x8", "no published figure found for 16 nodes", "-", "-", "-", "-", "-"),
    Published(
        "16x8",
        "~380 (multi-node, node count not stated)",
        "without SHARP (GTC 2024 NCCL talk slide)",
        "H100, 8x 400G per node",
        "slide quoted in a question; NVIDIA (S. Jeaugey): rings degrade at scale",
        "Where does the superiority of the NVLS + Tree algorithm lie ...? (NVIDIA/nccl#1649)",
        "https://github.com/NVIDIA/nccl/issues/1649",
    ),
    Published(
        "16x8",
        "~350, at times < 300 (512 MiB)",
        "default",
        "248 nodes x 8 H200, 8x 400G per node",
        "user report, 2025-01-18",
        "NCCL Test Multi-node Bus Bandwidth Tuning issue (NVIDIA/nccl-tests#283)",
        "https://github.com/NVIDIA/nccl-tests/issues/283",
    ),
)

#: H200 (HGX/DGX H200): NVLink 4, 18 links, 900 GB/s bidirectional = 450 GB/s per direction per GPU;
#: one 400 Gb/s ConnectX-7 NIC per GPU = 50 GB/s; HBM3e 4.8 TB/s. Latencies: assumptions.
H200_INTRA = Link(450e9, 2e-6)
H200_INTER = Link(50e9, 5e-6)
H200_MEM_BW = 4.8e12
H200_SYSTEMS = ((1, 8), (2, 8), (16, 8))


def h200_topology(nodes: int, overhead: float, channels: int = 1) -> Topology:
    """``nodes`` x 8 H200 with ringcomm's per-step ``overhead`` (s) and ``channels`` rings."""
    return Topology(
        nodes=nodes,
        gpus_per_node=8,
        intra=H200_INTRA,
        inter=H200_INTER,
        overhead=overhead,
        mem_bw=H200_MEM_BW,
        overlap=True,
        channels=channels,
    )


# ------------------------------------------------------------------------------------------------ CLI

#: one H200 shared by the ranks (tests on one GPU): seconds of overhead per ring step, by transport.
#: ipc: measured on an H200 under MPS (benchmarks/gpu_check.sh, 2026-12-04: all_reduce at N = 2 takes
#: 300-330 us per call from 1 to 16 MiB, two ring steps whose bytes take a few us: the host's Python,
#: kernel launches and the handshake's host waits; 30 us was assumed before; the removed ipc-stream
#: transport, its handshake on the GPU's streams, took 210-255 us). NCCL: one kernel per call, steps synchronised on the
#: GPU (about 1 us), kernels concurrent only under MPS (NCCL's kernels spin: time-sliced without MPS,
#: NCCL's numbers are not these); still an assumption (NCCL 2.28 refuses ranks sharing a GPU).
ONE_GPU_OVERHEAD = {"ipc": 150e-6, "nccl": 1e-6}


def one_gpu_topology(ranks: int, transport: str, hbm: float = H200_MEM_BW) -> Topology:
    """``ranks`` processes on one GPU: their kernels take turns (time-sliced contexts, or MPS), so
    each rank's steps get 1/ranks of the memory bandwidth; a copy step reads and writes its chunk,
    a reduce step reads two and writes one (overlapped, on the GPU). NCCL has no gather-fold path."""
    return Topology(
        nodes=1,
        gpus_per_node=ranks,
        intra=Link(hbm / (2 * ranks)),
        overhead=ONE_GPU_OVERHEAD[transport],
        mem_bw=hbm / ranks,
        overlap=True,
        small_bytes=0 if transport == "nccl" else SMALL_BYTES,
    )


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _gbs(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x / GB:.3g}" if x < 10 * GB else f"{x / GB:.1f}"


def _us(t: float) -> str:
    return f"{t * 1e6:.1f}" if t < 1e-2 else f"{t * 1e6:.0f}"


def _sizes(text: str) -> list[int]:
    return [parse_size(s) for s in text.split(",") if s.strip()]


def _cmd_predict(args: argparse.Namespace) -> str:
    topo = Topology(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        intra=Link(args.intra_bw, args.intra_lat),
        inter=Link(args.inter_bw, args.inter_lat),
        overhead=args.overhead,
        mem_bw=args.mem_bw,
        overlap=args.overlap,
        channels=args.channels,
        nics_per_node=args.nics_per_node,
        cores=args.cores,
    )
    rows = []
    for size in _sizes(args.size):
        p = predict(args.collective, size, topo, args.root)
        rows.append(
            [
                p.collective,
                format_size(size),
                str(p.ranks),
                str(p.channels),
                str(p.steps),
                _us(p.time),
                _gbs(p.algbw),
                _gbs(p.busbw),
                p.slowest,
            ]
        )
    head = (
        f"{args.nodes} node(s) x {args.gpus_per_node}, intra {args.intra_bw / GB:g} GB/s + {args.intra_lat:g} s, "
        f"inter {args.inter_bw / GB:g} GB/s + {args.inter_lat:g} s, overhead {args.overhead:g} s/step, "
        f"{args.channels} ring(s)"
    )
    return (
        head
        + "\n\n"
        + _table(
            [
                "collective",
                "size",
                "ranks",
                "rings",
                "steps",
                "time (us)",
                "algbw (GB/s)",
                "busbw (GB/s)",
                "slowest edge",
            ],
            rows,
        )
    )


def _cmd_fit(args: argparse.Namespace) -> str:
    modes = MODES if args.mode == "both" else (args.mode,)
    fitted = load_measurements(args.files, modes)
    f = fit(fitted, args.cores)
    ms = fitted + load_measurements(args.compare, modes)  # shown against the prediction, not fitted
    rows: list[list[str]] = []
    ratios: dict[int, list[float]] = {}
    for m in sorted(ms, key=lambda m: (m.collective, m.ranks, m.size, m.mode)):
        p = predict(m.collective, m.size, host_topology(m.ranks, f.alpha, f.beta, args.cores))
        rows.append(
            [
                m.collective,
                format_size(m.size),
                str(m.ranks),
                m.mode,
                _gbs(m.busbw),
                _gbs(p.busbw),
                f"{p.busbw / m.busbw:.2f}",
            ]
        )
        ratios.setdefault(m.ranks, []).append(p.busbw / m.busbw)
    per_n = ", ".join(
        f"N={n}: {min(r):.2f}..{max(r):.2f} (geomean {math.exp(np.mean(np.log(r))):.2f})"
        for n, r in sorted(ratios.items())
    )
    head = [
        (
            f"alpha = {f.alpha * 1e6:.2f} us per step, beta = {f.beta / GB:.2f} GB/s of memory traffic per rank "
            f"(an MPI message costs {MPI_TRAFFIC} bytes of it per byte, a reduction {REDUCE_TRAFFIC} more); "
            f"cores = {args.cores or 'not limiting'}; rms relative time error {f.rms:.2f}; fitted to {len(fitted)} "
            f"rows from {len(args.files)} file(s)"
            + (f", {len(args.compare)} more file(s) compared" if args.compare else "")
        ),
        f"predicted/measured busbw: {per_n}",
        "",
    ]
    return "\n".join(head) + _table(
        ["collective", "size", "N", "mode", "measured busbw (GB/s)", "predicted busbw (GB/s)", "ratio (pred/meas)"],
        rows,
    )


def _cmd_h200(args: argparse.Namespace) -> str:
    sizes = _sizes(args.sizes)
    rows = []
    for nodes, g in H200_SYSTEMS:
        one, many = h200_topology(nodes, args.overhead), h200_topology(nodes, args.overhead, args.channels)
        for size in sizes:
            p, q = predict(args.collective, size, one), predict(args.collective, size, many)
            rows.append(
                [f"{nodes}x{g}", format_size(size), _us(p.time), _gbs(p.busbw), p.slowest, _us(q.time), _gbs(q.busbw)]
            )
    big = max(sizes)
    summary = []
    for nodes, g in H200_SYSTEMS:
        p = predict(args.collective, big, h200_topology(nodes, args.overhead))
        q = predict(args.collective, big, h200_topology(nodes, args.overhead, args.channels))
        for i, pub in enumerate(x for x in PUBLISHED if x.config == f"{nodes}x{g}"):
            first = i == 0
            summary.append(
                [
                    f"{nodes}x{g}" if first else "",
                    _gbs(p.busbw) if first else "",
                    _gbs(q.busbw) if first else "",
                    pub.busbw,
                    pub.algorithm,
                    pub.system,
                    pub.url if pub.url != "-" else "-",
                ]
            )
    head = (
        f"{args.collective}: H200 nodes of 8 GPUs; NVLink {H200_INTRA.bandwidth / GB:g} GB/s per direction + "
        f"{H200_INTRA.latency:g} s, inter-node {H200_INTER.bandwidth / GB:g} GB/s per GPU (400 Gb/s) + "
        f"{H200_INTER.latency:g} s, HBM {H200_MEM_BW / 1e12:g} TB/s, overhead {args.overhead:g} s per step (line "
        f"rates: NCCL's effective NVLink is ~370 GB/s). ringcomm runs one ring: its slowest edge, one NIC "
        f"(50 GB/s), paces every step, so its multi-node busbw is bounded by one NIC; NCCL runs a ring per NIC "
        f'("{args.channels} rings" below: the same model with {args.channels} channels).'
    )
    return (
        head
        + "\n\n"
        + _table(
            [
                "system",
                "size",
                "1 ring: time (us)",
                "1 ring: busbw (GB/s)",
                "slowest edge",
                f"{args.channels} rings: time (us)",
                f"{args.channels} rings: busbw (GB/s)",
            ],
            rows,
        )
        + f"\n\nAt {format_size(big)} beside NCCL's published all_reduce busbw (large messages):\n\n"
        + _table(
            [
                "system",
                "ringcomm, 1 ring (model)",
                f"{args.channels} rings (model)",
                "NCCL published (GB/s)",
                "algorithm",
                "measured on",
                "source",
            ],
            summary,
        )
    )


def _cmd_one_gpu(args: argparse.Namespace) -> str:
    sizes = _sizes(args.sizes)
    ranks = [int(r) for r in args.ranks.split(",")]
    names = tuple(ONE_GPU_OVERHEAD)
    rows = []
    for size in sizes:
        cells = [format_size(size)]
        for n in ranks:
            cells += [_gbs(predict(args.collective, size, one_gpu_topology(n, t)).busbw) for t in names]
        rows.append(cells)
    head = [
        f"{args.collective} busbw (GB/s) predicted on one H200 (HBM {H200_MEM_BW / 1e12:g} TB/s) shared by the "
        "ranks; per-step overheads "
        + ", ".join(f"{t} {ONE_GPU_OVERHEAD[t] * 1e6:g} us" for t in names)
        + " (ringcomm.model.ONE_GPU_OVERHEAD: ipc's measured on an H200 under MPS, NCCL's assumed)",
        "",
    ]
    return "\n".join(head) + _table(["size"] + [f"N={n} {t}" for n in ranks for t in names], rows)


def _cmd_sources(args: argparse.Namespace) -> str:
    lines = []
    for p in PUBLISHED:
        if p.url == "-":
            lines.append(f"- {p.config}: {p.busbw}.")
        else:
            lines.append(
                f"- {p.config}: busbw (GB/s) {p.busbw}; {p.algorithm}; {p.system}; {p.who}. [{p.title}]({p.url})"
            )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ringcomm.model", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("predict", help="time and busbw of a collective on a topology")
    p.add_argument("--collective", "-c", default="all_reduce", choices=COLLECTIVES)
    p.add_argument("--size", "-s", default="64M", help="bytes (K/M/G suffixes), comma-separated for several")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node")
    p.add_argument("--intra-bw", type=float, default=450e9, help="bytes/s per direction within a node")
    p.add_argument("--intra-lat", type=float, default=2e-6, help="seconds")
    p.add_argument("--inter-bw", type=float, default=50e9, help="bytes/s per direction per GPU between nodes")
    p.add_argument("--inter-lat", type=float, default=5e-6, help="seconds")
    p.add_argument("--overhead", type=float, default=5e-6, help="alpha: seconds per step (host and software)")
    p.add_argument("--mem-bw", type=float, default=math.inf, help="bytes/s of local memory for reductions")
    p.add_argument("--overlap", action="store_true", help="reductions overlap the transfer (GPU kernels)")
    p.add_argument("--channels", type=int, default=1, help="rings in parallel (ringcomm: 1)")
    p.add_argument("--nics-per-node", type=int, default=None, help="default: one per GPU")
    p.add_argument("--cores", type=int, default=0, help="CPU cores the ranks share (0: not limiting)")
    p.add_argument("--root", type=int, default=0)
    f = sub.add_parser("fit", help="fit alpha and beta of the host path to bench JSON files")
    f.add_argument("files", nargs="+", help="python -m ringcomm.bench --json FILE outputs (one per N)")
    f.add_argument("--mode", choices=("both",) + MODES, default="both")
    f.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="FILE",
        help="more bench JSON files to show against the fitted model without fitting to them",
    )
    f.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 0,
        help="CPU cores the ranks shared (default: this machine's, %(default)s; 0: not limiting)",
    )
    h = sub.add_parser("h200", help="1x8, 2x8, 16x8 H200 predictions beside NCCL's published busbw")
    h.add_argument("--collective", "-c", default="all_reduce", choices=COLLECTIVES)
    h.add_argument("--sizes", default="64K,1M,16M,64M,256M,1G")
    h.add_argument("--overhead", type=float, default=5e-6, help="ringcomm's seconds per step on a GPU")
    h.add_argument("--channels", type=int, default=8, help="rings of NCCL's scheme (one per NIC)")
    sub.add_parser("sources", help="the published NCCL figures and their sources, as markdown")
    g = sub.add_parser("one-gpu", help="ipc and NCCL on one H200 shared by the ranks")
    g.add_argument("--collective", "-c", default="all_reduce", choices=COLLECTIVES)
    g.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    g.add_argument("--sizes", default="64K,256K,1M,4M,16M,64M,256M,1G")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {
        "predict": _cmd_predict,
        "fit": _cmd_fit,
        "h200": _cmd_h200,
        "sources": _cmd_sources,
        "one-gpu": _cmd_one_gpu,
    }[args.command]
    try:
        print(run(args))
    except (ValueError, KeyError, FileNotFoundError) as e:  # bad arguments or files
        print(f"python -m ringcomm.model {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
