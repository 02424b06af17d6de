"""Sharded checkpoints of a ZeroShardManager, loadable at any world size and any stage.

A checkpoint is a directory::

    meta.json                              written last, atomically (rename), by rank 0
    shard-00000-of-00004-<token>.bin       one file per saving rank
    ...

Shard file r holds the saving rank's part ``[start, stop)`` of the *unpadded* flat parameter
vector (the layout of :mod:`ringcomm.zero.layout`; the padding is not saved): the master copy,
then exp_avg, then exp_avg_sq, each ``stop - start`` little-endian elements of the master dtype
(float32, or float64 for float64 parameters). ``meta.json`` records the format version, the
parameter shapes, dtypes, Adam's step count, the loss-scaler state and, per file, its range, byte
count and CRC-32. The working-precision parameters are not stored: they are the master cast to
the working precision, as after every step.

Saving writes new files under a fresh token and replaces ``meta.json`` only when every rank has
written its file, so an interrupted save leaves the previous checkpoint intact; superseded shard
files are removed afterwards. Loading checks everything it reads (meta, coverage of the ranges,
file sizes, checksums) on every rank, agrees on the outcome, and only then changes the manager:
a truncated, corrupt or mismatched checkpoint raises :class:`CheckpointError` on every rank and
leaves the manager as it was.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..records import exchange

FORMAT = "ringcomm.zero"
VERSION = 1
META = "meta.json"
_SHARD_RE = re.compile(r"shard-\d{5}-of-\d{5}-[0-9a-f]{12}\.bin")
_IO_BLOCK = 1 << 24  # bytes per read/write while checksumming


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, truncated, corrupt, or does not fit the manager.

    Raised on every rank of a collective load or save; nothing has been changed when it is.
    """


def _host_chunks(a: Any) -> Iterable[np.ndarray]:
    """The 1-D array ``a`` (numpy or CuPy) as host arrays of at most _IO_BLOCK bytes."""
    step = max(1, _IO_BLOCK // a.itemsize)
    for i in range(0, a.size, step):
        part = a[i : i + step]
        yield part if isinstance(part, np.ndarray) else part.get()


def write_shard(path: str, arrays: Iterable[Any]) -> tuple[int, int]:
    """Write the 1-D ``arrays`` one after the other, little-endian, to ``path`` (via a temporary
    file and a rename); return (bytes written, CRC-32)."""
    tmp = path + ".tmp"
    crc, nbytes = 0, 0
    with open(tmp, "wb") as f:
        for a in arrays:
            for part in _host_chunks(a):
                part = np.ascontiguousarray(part, part.dtype.newbyteorder("<"))
                view = memoryview(part).cast("B")
                f.write(view)
                crc = zlib.crc32(view, crc)
                nbytes += view.nbytes
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return nbytes, crc


def _file_crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_IO_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def read_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """The checked contents of ``directory``/meta.json; CheckpointError when absent or malformed."""
    directory = os.fspath(directory)
    path = os.path.join(directory, META)
    if not os.path.isfile(path):
        if os.path.isdir(directory):
            what = "no meta.json (the save did not complete?)"
        else:
            what = "the directory does not exist"
        raise CheckpointError(f"{directory}: not a ringcomm.zero checkpoint: {what}")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: not a ringcomm.zero checkpoint (format {fmt!r})")
    if meta.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {meta.get('version')!r}; this ringcomm reads version {VERSION}"
        )
    try:
        shapes = [_shape(s, f"shapes[{i}]") for i, s in enumerate(_list(meta, "shapes"))]
        count = _int(_key(meta, "count"), "count")
        master_dtype = _master_dtype(_key(meta, "master_dtype"))
        step = _int(_key(meta, "step"), "step")
        skipped = _int(meta.get("skipped_steps", 0), "skipped_steps")
        scaler = _scaler_state(meta.get("loss_scaler"))
        shards = sorted(
            (_shard(s, i) for i, s in enumerate(_list(meta, "shards"))), key=lambda s: (s["start"], s["stop"])
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed checkpoint metadata ({e})") from None
    if sum(int(np.prod(s, dtype=np.int64)) for s in shapes) != count:
        raise CheckpointError(f"{path}: the parameter shapes do not add up to count={count}")
    at = 0
    for s in shards:
        start, stop = s["start"], s["stop"]
        if start != at or stop < start:
            raise CheckpointError(f"{path}: the shard ranges do not tile [0, {count}) (gap or overlap at element {at})")
        want = 3 * (stop - start) * master_dtype.itemsize
        if s["nbytes"] != want:
            raise CheckpointError(f"{path}: shard {s['file']} records {s['nbytes']} bytes, expected {want}")
        at = stop
    if at != count:
        raise CheckpointError(f"{path}: the shard ranges end at {at}, not at count={count}")
    meta.update(
        shapes=shapes,
        count=count,
        master_dtype=master_dtype,
        step=step,
        skipped_steps=skipped,
        loss_scaler=scaler,
        shards=shards,
    )
    return meta


# Field checks of read_meta: each raises ValueError (or TypeError) saying which field is wrong;
# read_meta turns that into CheckpointError. Nothing downstream reads meta.json's raw values.
def _key(d: dict[str, Any], key: str, where: str = "meta.json") -> Any:
    if key not in d:
        raise ValueError(f"{where} has no {key!r}")
    return d[key]


def _list(d: dict[str, Any], key: str) -> list[Any]:
    value = _key(d, key)
    if not isinstance(value, list):
        raise ValueError(f"{key!r} must be a list; got {type(value).__name__}")
    return value


def _int(value: Any, what: str, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (high is not None and value >= high):
        bound = "" if high is None else f" and < {high}"
        raise ValueError(f"{what} must be an integer >= 0{bound}; got {value!r}")
    return value


def _shape(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of dimensions; got {value!r}")
    return tuple(_int(d, f"{what}[{j}]") for j, d in enumerate(value))


def _master_dtype(value: Any) -> np.dtype:
    dt = np.dtype(value) if isinstance(value, str) else None
    if dt is None or dt.kind != "f" or dt.itemsize not in (4, 8):
        raise ValueError(f"master_dtype must be '<f4' or '<f8' (float32 or float64); got {value!r}")
    return np.dtype(f"f{dt.itemsize}")  # the data are little-endian; this is the native type they load into


def _scaler_state(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"loss_scaler must be an object; got {value!r}")
    if value.get("mode") != "dynamic":
        return {"mode": value.get("mode")}
    scale = _key(value, "scale", "loss_scaler")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"loss_scaler.scale must be a finite number > 0; got {scale!r}")
    return {
        "mode": "dynamic",
        "scale": float(scale),
        "good_steps": _int(_key(value, "good_steps", "loss_scaler"), "loss_scaler.good_steps"),
    }


def _shard(value: Any, i: int) -> dict[str, Any]:
    where = f"shards[{i}]"
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object; got {value!r}")
    name = _key(value, "file", where)
    if not isinstance(name, str) or not _SHARD_RE.fullmatch(name):
        raise ValueError(f"{where}: bad shard file name {name!r}")
    out = {"file": name}
    for key in ("start", "stop", "nbytes"):
        out[key] = _int(_key(value, key, where), f"{where}.{key}")
    out["crc32"] = _int(_key(value, "crc32", where), f"{where}.crc32", high=1 << 32)
    return out


def read_range(
    directory: str | os.PathLike, meta: dict[str, Any], lo: int, hi: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(master, exp_avg, exp_avg_sq) for unpadded flat elements [lo, hi), as new host arrays.

    Every file that contributes is checked (size, CRC-32) before its data is used.
    """
    directory = os.fspath(directory)
    dt = meta["master_dtype"].newbyteorder("<")
    out = [np.empty(hi - lo, meta["master_dtype"]) for _ in range(3)]
    for s in meta["shards"]:
        start, stop = s["start"], s["stop"]
        a, b = max(lo, start), min(hi, stop)
        if a >= b:
            continue
        path = os.path.join(directory, s["file"])
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard file missing (elements [{start}, {stop}))")
        size = os.path.getsize(path)
        if size != s["nbytes"]:
            raise CheckpointError(f"{path}: truncated or overwritten: {size} bytes, expected {s['nbytes']}")
        if _file_crc(path) != s["crc32"]:
            raise CheckpointError(f"{path}: corrupt: CRC-32 does not match meta.json")
        length = stop - start
        for k in range(3):
            offset = (k * length + a - start) * dt.itemsize
            out[k][a - lo : b - lo] = np.fromfile(path, dt, b - a, offset=offset)
    return out[0], out[1], out[2]


def consolidate(directory: str | os.PathLike) -> dict[str, Any]:
    """Read a whole checkpoint in one process (no MPI needed).

    Returns ``{'params': [...], 'exp_avg': [...], 'exp_avg_sq': [...], 'step': int}``: one numpy
    array per parameter in its original shape, in the master precision (float32, or float64 for
    float64 parameters); ``params`` is the master copy. The result does not depend on the world
    size or stage that saved the checkpoint. Raises CheckpointError for a missing, truncated,
    corrupt or inconsistent checkpoint.
    """
    meta = read_meta(directory)
    arrays = read_range(directory, meta, 0, meta["count"])
    out: dict[str, Any] = {}
    for key, flat in zip(("params", "exp_avg", "exp_avg_sq"), arrays):
        parts, at = [], 0
        for shape in meta["shapes"]:
            n = int(np.prod(shape, dtype=np.int64))
            parts.append(flat[at : at + n].reshape(shape).copy())
            at += n
        out[key] = parts
    out["step"] = meta["step"]
    return out


def save(mgr: Any, directory: str | os.PathLike) -> None:
    """Collective: write ``mgr``'s sharded state to ``directory`` (see the module docstring)."""
    comm, layout = mgr.comm, mgr.layout
    directory = os.fspath(directory)
    token = np.frombuffer(os.urandom(8), np.int64) & 0xFFFFFFFFFFFF if comm.rank == 0 else np.zeros(1, np.int64)
    token = np.ascontiguousarray(token)
    comm.broadcast(token, root=0)
    name = f"shard-{comm.rank:05d}-of-{comm.size:05d}-{int(token[0]):012x}.bin"
    start, stop, arrays = mgr._checkpoint_shard()
    err, nbytes, crc = "", 0, 0
    try:
        os.makedirs(directory, exist_ok=True)
        nbytes, crc = write_shard(os.path.join(directory, name), arrays)
    except OSError as e:
        err = f"cannot write {os.path.join(directory, name)}: {e}"
    table = exchange(comm, [0 if err else 1, start, stop, nbytes, crc], err)
    failed = [f"rank {r}: {m}" for r, ((ok, *_), m) in enumerate(table) if not ok]
    if not failed and comm.rank == 0:
        shards = [
            {
                "file": f"shard-{r:05d}-of-{comm.size:05d}-{int(token[0]):012x}.bin",
                "start": v[1],
                "stop": v[2],
                "nbytes": v[3],
                "crc32": v[4],
            }
            for r, (v, _) in enumerate(table)
        ]
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": comm.size,
            "stage": mgr.stage,
            "count": layout.count,
            "shapes": [list(s) for s in layout.shapes],
            "param_dtype": str(mgr.dtype),
            "master_dtype": np.dtype(mgr.master_dtype).str.replace(">", "<"),
            "step": mgr.step_count,
            "skipped_steps": mgr.skipped_steps,
            "loss_scaler": mgr.scaler.state_dict(),
            "hyperparameters": {
                "lr": mgr.lr,
                "betas": list(mgr.betas),
                "eps": mgr.eps,
                "weight_decay": mgr.weight_decay,
                "max_grad_norm": mgr.max_grad_norm,
            },
            "shards": shards,
        }
        try:
            tmp = os.path.join(directory, META + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, os.path.join(directory, META))
        except OSError as e:
            failed.append(f"rank 0: cannot write {META}: {e}")
        else:  # the new checkpoint is complete: drop the files of earlier saves (best effort)
            keep = {s["file"] for s in shards}
            for old in os.listdir(directory):
                if _SHARD_RE.fullmatch(old) and old not in keep:
                    try:
                        os.remove(os.path.join(directory, old))
                    except OSError:
                        pass
    (ok0, *_), msg0 = exchange(comm, [0 if failed else 1], "; ".join(failed))[0]
    if not ok0:
        try:  # leave no file of this failed save behind
            os.remove(os.path.join(directory, name))
        except OSError:
            pass
        raise CheckpointError(f"saving checkpoint {directory} failed, the previous one (if any) is kept: {msg0}")


def load(mgr: Any, directory: str | os.PathLike) -> None:
    """Collective: replace ``mgr``'s state by the checkpoint in ``directory`` (any saving world
    size or stage). All-or-nothing: see the module docstring."""
    comm = mgr.comm
    err, staged, meta = "", None, None
    try:
        meta = read_meta(directory)
        mgr._check_checkpoint(meta)
        lo, hi = mgr._checkpoint_range()
        staged = read_range(directory, meta, lo, hi)
    except CheckpointError as e:
        err = str(e)
    except Exception as e:  # any other local failure is agreed on too: no peer waits for this rank
        err = f"{type(e).__name__}: {e}"
    table = exchange(comm, [0 if err else 1], err)
    failed = [f"rank {r}: {m}" for r, ((ok, *_), m) in enumerate(table) if not ok]
    if failed:
        raise CheckpointError(
            f"checkpoint {os.fspath(directory)} not loaded (nothing was changed): " + "; ".join(failed)
        )
    mgr._commit_checkpoint(meta, staged)
