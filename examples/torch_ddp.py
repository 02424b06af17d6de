"""Train a small model with PyTorch's DistributedDataParallel on the "ringcomm" backend.

    mpiexec -n 2 python examples/torch_ddp.py                    # losses on ringcomm
    mpiexec -n 2 python examples/torch_ddp.py --compare gloo     # and the same run on Gloo, side by side

``import ringcomm.torch`` registers the backend; ``dist.init_process_group("ringcomm")`` takes the
ranks from MPI and needs no MASTER_ADDR/MASTER_PORT. Every rank draws the same global batch each
step and trains on its slice of it; DDP averages the gradients (all-reduces of its buckets, on
ringcomm). With ``--compare gloo`` a second model, initialised alike, trains on a Gloo group made in
the same processes (``dist.new_group(backend="gloo")``, on the store the ranks agreed through MPI);
the losses of the two agree to float32 rounding (the sums' order differs), and ringcomm's parameters
are bitwise the same on every rank. Rank 0 prints the table; the exit status is 1 when the losses
differ by more than ``--rtol`` or ringcomm's parameters differ between ranks.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ringcomm.torch  # noqa: F401 - registers the "ringcomm" backend


def make_model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))


def batch(step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: the same on every rank (inputs and a noisy smooth target)."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(size, 16, generator=g)
    y = torch.sin(x[:, :1] * 2) + 0.5 * x[:, 1:2] * x[:, 2:3] + 0.05 * torch.randn(size, 1, generator=g)
    return x, y


def gather_into(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup) -> None:
    """all_gather_into_tensor (named all_gather_single from torch 2.13 on)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


def train(group: dist.ProcessGroup, args: argparse.Namespace) -> tuple[list[float], torch.Tensor, bool]:
    """``args.steps`` steps of DDP on ``group``: (the global mean loss per step, the final parameters
    flattened, whether they are bitwise the same on every rank)."""
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    model = DDP(make_model(args.width, args.seed), process_group=group, bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = batch(step, args.batch, args.seed)
        mine = slice(rank * args.batch // n, (rank + 1) * args.batch // n)
        opt.zero_grad()
        err = (model(x[mine]) - y[mine]) ** 2
        err.mean().backward()
        opt.step()
        total = err.detach().sum().reshape(1)
        dist.all_reduce(total, group=group)  # the loss of the global batch
        losses.append(total.item() / args.batch)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = torch.empty(n * flat.numel(), dtype=flat.dtype)
    gather_into(every, flat, group)
    rows = every.view(n, -1).view(torch.int32)
    return losses, flat, bool((rows == rows[0]).all())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--batch", type=int, default=96, help="global batch size (default 96)")
    p.add_argument("--width", type=int, default=64, help="hidden layer width (default 64)")
    p.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default 0.01)")
    p.add_argument("--bucket-mb", type=float, default=0.01, help="DDP's bucket size in MiB (default 0.01: buckets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=["gloo"], help="train again on this backend and compare the losses")
    p.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference taken as equal")
    p.add_argument("--timeout", type=float, help="seconds a collective may wait (default: torch's)")
    args = p.parse_args(argv)

    timeout = {} if args.timeout is None else {"timeout": datetime.timedelta(seconds=args.timeout)}
    dist.init_process_group("ringcomm", **timeout)
    try:
        rank, n = dist.get_rank(), dist.get_world_size()
        runs = {"ringcomm": train(dist.group.WORLD, args)}
        if args.compare:
            runs[args.compare] = train(dist.new_group(backend=args.compare, **timeout), args)
        names = list(runs)
        ok = runs["ringcomm"][2]
        if rank == 0:
            print(
                f"# DDP on {' and '.join(names)}: {n} ranks (MPI), MLP 16-{args.width}-{args.width}-1, "
                f"Adam lr {args.lr},"
            )
            print(f"# global batch {args.batch}, {args.steps} steps; loss = mean squared error of the global batch")
            print(
                "# step "
                + "".join(f"{'loss(' + name + ')':>18}" for name in names)
                + ("    |difference|" if args.compare else "")
            )
            for step in range(args.steps):
                values = [runs[name][0][step] for name in names]
                diff = f"{abs(values[1] - values[0]):16.3e}" if args.compare else ""
                print(f"{step + 1:6d} " + "".join(f"{v:18.9e}" for v in values) + diff)
        if args.compare:
            (a, pa, _), (b, pb, _) = runs["ringcomm"], runs[args.compare]
            worst = max((abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b)), default=0.0)
            param = float((pa - pb).abs().max()) if pa.numel() else 0.0
            ok = ok and worst <= args.rtol
            if rank == 0:
                print(
                    f"# largest relative loss difference {worst:.3e} (at most {args.rtol:g}: "
                    f"{'yes' if worst <= args.rtol else 'NO'}); largest parameter difference {param:.3e}"
                )
        if rank == 0:
            print(f"# ringcomm's parameters bitwise identical on every rank: {'yes' if runs['ringcomm'][2] else 'NO'}")
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
