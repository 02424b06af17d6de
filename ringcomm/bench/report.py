"""Output: nccl-tests' table (and a parser for it), the JSON file, the plot.

The table is nccl-tests' ``size count type redop root | out-of-place time algbw busbw #wrong |
in-place time algbw busbw #wrong``; with several implementations an ``impl`` column follows root
and each group gains a ``ratio`` column (ringcomm's busbw over the row's; ``-`` on ringcomm's rows).
Times in microseconds, bandwidths in GB/s (1e9 B/s), sizes in bytes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from .runner import MODES, Result, Row, average_busbw, total_wrong
from .sizes import format_size

_KEY_WIDTHS = (("size", 12, "(B)"), ("count", 12, "(elements)"), ("type", 8, ""), ("redop", 6, ""), ("root", 6, ""))
_IMPL_WIDTH = ("impl", 8, "")
_GROUP = (("time", 9, "(us)"), ("algbw", 7, "(GB/s)"), ("busbw", 7, "(GB/s)"), ("#wrong", 6, ""))
_RATIO = ("ratio", 6, "")


@dataclasses.dataclass
class Layout:
    """The columns of one table: with ``impl`` and ``ratio`` columns when several implementations ran."""

    multi: bool
    ratio: bool

    @classmethod
    def for_impls(cls, names: Sequence[str], reference: str = "ringcomm") -> Layout:
        multi = len(names) > 1
        return cls(multi, multi and reference in names)

    def keys(self) -> list[tuple[str, int, str]]:
        return list(_KEY_WIDTHS) + ([_IMPL_WIDTH] if self.multi else [])

    def group(self) -> list[tuple[str, int, str]]:
        return list(_GROUP) + ([_RATIO] if self.ratio else [])


def cells(cols: Sequence[tuple[Any, ...]], values: Sequence[str]) -> str:
    """The cells of one table line: each value right-aligned in its column's width (a column is
    ``(name, width, ...)``), each preceded by a space. Also used by benchmarks/host_allreduce.py."""
    return "".join(" " + v.rjust(col[1]) for col, v in zip(cols, values))


def column_header(layout: Layout) -> list[str]:
    """The three comment lines above the rows: group titles, column names, units."""
    keys, group = layout.keys(), layout.group()
    key_w = sum(w + 1 for _, w, _ in keys)
    group_w = sum(w + 1 for _, w, _ in group)
    titles = "#" + " " * (key_w - 1) + "".join(m.center(group_w) for m in MODES)
    names = "#" + cells(keys, [k for k, _, _ in keys])[1:] + cells(group, [g for g, _, _ in group]) * 2
    units = "#" + cells(keys, [u for _, _, u in keys])[1:] + cells(group, [u for _, _, u in group]) * 2
    return [titles.rstrip(), names, units.rstrip()]


def _time(us: float) -> str:
    return f"{us:.0f}" if us >= 1e4 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def _ratio(x: float) -> str:
    """Two decimals, or three significant digits where two decimals would hide the value."""
    return f"{x:.2f}" if x >= 0.1 else f"{x:.3g}"


def _group_cells(res: Result, layout: Layout, is_reference: bool) -> list[str]:
    if res.time_us is None:
        out = ["N/A"] * 4
    else:
        out = [
            _time(res.time_us),
            f"{res.algbw:.2f}",
            f"{res.busbw:.2f}",
            "N/A" if res.wrong is None else str(res.wrong),
        ]
    if layout.ratio:
        out.append("-" if is_reference else "N/A" if res.ratio is None else _ratio(res.ratio))
    return out


def format_row(row: Row, layout: Layout, reference: str = "ringcomm") -> str:
    """One data line of the table."""
    keys = [str(row.nbytes), str(row.count), row.type, row.redop, str(row.root)]
    if layout.multi:
        keys.append(row.impl + row.mark)
    line = cells(layout.keys(), keys)
    for mode in MODES:
        line += cells(layout.group(), _group_cells(row.results[mode], layout, row.impl == reference))
    return line


def footer(
    rows: Sequence[Row], impls: Sequence[str], check: bool, iters: int, warmup: int, reference: str = "ringcomm"
) -> list[str]:
    """nccl-tests' closing lines, then notes: what did not run (N/A), and the sizes where the time
    budget cut the iterations below ``iters`` (-n) or ``warmup`` (-w)."""
    wrong = total_wrong(rows)
    main = reference if reference in impls else impls[0]
    lines = [
        f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
        f"# Avg bus bandwidth    : {average_busbw(rows, main):.6g} ",
    ]
    if len(impls) > 1:
        marks = {row.impl: row.mark for row in rows}
        per = ", ".join(f"{name}{marks.get(name, '')} {average_busbw(rows, name):.4g}" for name in impls)
        lines.append(f"# Avg bus bandwidth by implementation (GB/s): {per}")
    if not check:
        lines.append("# Results not checked (--check 0)")
    notes: dict[str, None] = {}
    for row in rows:
        for mode, res in row.results.items():
            if res.note:
                notes[f"{row.impl}{row.mark} {mode}: {res.note}"] = None
    lines += [f"# N/A: {n}" for n in notes]
    note = budget_note(rows, iters, warmup)
    if note:
        lines.append(note)
    return lines


def budget_note(rows: Sequence[Row], iters: int, warmup: int) -> str | None:
    """The comment line listing the sizes where the time budget ran fewer than ``warmup`` (-w) or
    ``iters`` (-n) iterations, or None when it never did."""
    fewer: dict[int, list[tuple[int, int]]] = {}
    for row in rows:
        for res in row.results.values():
            if res.time_us is not None and (res.iters < iters or res.warmup < warmup):
                fewer.setdefault(row.nbytes, []).append((res.warmup, res.iters))
    if not fewer:
        return None

    def span(values: list[int]) -> str:
        return f"{min(values)}" + (f"..{max(values)}" if max(values) != min(values) else "")

    parts = [
        f"{format_size(size)} w={span([w for w, _ in v])} n={span([n for _, n in v])}" for size, v in fewer.items()
    ]
    return f"# Fewer iterations (time budget; asked w={warmup} n={iters}): " + ", ".join(parts)


# ------------------------------------------------------------------------------------- parsing


@dataclasses.dataclass
class Table:
    """A parsed table: rows as dicts (numbers as int/float, N/A and - as None) and its footer."""

    rows: list[dict[str, Any]]
    wrong: int | None = None
    status: str | None = None
    avg_busbw: float | None = None


def _value(text: str) -> Any:
    if text in ("N/A", "-"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_tables(text: str) -> list[Table]:
    """Parse every table in ``text`` (this driver's output, or nccl-tests'). Each data row becomes
    ``{"size", "count", "type", "redop", "root", ["impl"], "out-of-place": {...}, "in-place": {...}}``
    with ``time``, ``algbw``, ``busbw``, ``#wrong`` (and ``ratio``) in each group. ValueError when a
    row does not match its header."""
    tables: list[Table] = []
    cols: list[str] | None = None
    for line in text.splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            body = s[1:].split()
            if "size" in body and "count" in body and "#wrong" in body:
                cols = body
                tables.append(Table([]))
            elif s.startswith("# Out of bounds values") and tables:
                parts = s.split(":", 1)[1].split()
                tables[-1].wrong, tables[-1].status = int(parts[0]), parts[1]
            elif s.startswith("# Avg bus bandwidth") and ":" in s and "by implementation" not in s and tables:
                tables[-1].avg_busbw = float(s.split(":", 1)[1])
                cols = None
            continue
        if cols is None:
            continue
        cells = s.split()
        if len(cells) != len(cols):
            raise ValueError(f"row has {len(cells)} fields, the header {len(cols)}: {line!r}")
        split = cols.index("time")
        second = cols.index("time", split + 1)
        row: dict[str, Any] = {c: _value(v) for c, v in zip(cols[:split], cells[:split])}
        row["out-of-place"] = {c: _value(v) for c, v in zip(cols[split:second], cells[split:second])}
        row["in-place"] = {c: _value(v) for c, v in zip(cols[second:], cells[second:])}
        tables[-1].rows.append(row)
    return tables


# ---------------------------------------------------------------------------------- JSON, plot


def to_json(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Rows as plain dicts (one per table line, modes nested)."""
    out = []
    for row in rows:
        d = dataclasses.asdict(row)
        d["size"] = d.pop("nbytes")
        out.append(d)
    return out


def write_json(path: str, environment: dict[str, Any], settings: dict[str, Any], rows: Sequence[Row]) -> None:
    """Write ``{"environment", "settings", "rows"}`` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"environment": environment, "settings": settings, "rows": to_json(rows)}, f, indent=1)
        f.write("\n")


def plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Bus bandwidth against size (log-x), one panel per collective, one line per implementation and
    mode; written to ``path`` (PNG, or any format matplotlib infers from the name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    collectives = list(dict.fromkeys(r.collective for r in rows))
    fig, axes = plt.subplots(len(collectives), 1, figsize=(8, 3.6 * len(collectives)), squeeze=False)
    for ax, coll in zip(axes[:, 0], collectives):
        series: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
        for row in rows:
            if row.collective != coll or row.nbytes <= 0:
                continue
            for mode, res in row.results.items():
                if res.busbw is not None:
                    key = (row.impl, f"{row.type} {row.redop}" if row.redop != "none" else row.type, mode)
                    series.setdefault(key, []).append((row.nbytes, res.busbw))
        impls = list(dict.fromkeys(impl for impl, _, _ in series))
        whats = list(dict.fromkeys(what for _, what, _ in series))
        for (impl, what, mode), pts in series.items():
            xs, ys = zip(*sorted(pts))
            color = f"C{(impls.index(impl) + len(impls) * whats.index(what)) % 10}"  # one colour per impl
            ax.plot(
                xs,
                ys,
                marker="o",
                markersize=3,
                color=color,
                label=f"{impl} ({what}, {mode})",
                linestyle="-" if mode == "out-of-place" else "--",
            )
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v)) if v >= 1 else ""))
        ax.set_xlabel("size")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{coll} — {title}")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
