"""Checkpoint save and load speed against plain sequential file I/O of the same bytes.

    torchrun --nproc-per-node 2 python/benchmarks/checkpoint_io.py [--gib 1 --dir /tmp]

A model of about ``--gib`` GiB of f32 parameters (square Linear layers) is sharded over the
ranks; ``save_checkpoint`` then ``load_checkpoint`` run ``--repeat`` times. In the same run
every rank writes (with fsync) and reads back a file of its own share of the bytes, as ``dd``
would: that is the bound. Every save and every plain write goes to a new directory or file.
Printed: GB/s of each (the slowest rank's time, all ranks' bytes) and the ratios. The files
stay in the page cache between write and read, for both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import collsched.torch as cst

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exchange import from_rank0  # noqa: E402


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(f) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    f()
    return slowest(time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0, help="model size in GiB of f32 parameters")
    p.add_argument("--dim", type=int, default=4096, help="side of each square layer")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the files go")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cst.init()
    layers = max(1, round(args.gib * 2**30 / (4 * args.dim * args.dim)))
    model = nn.Sequential(*(nn.Linear(args.dim, args.dim, bias=False) for _ in range(layers)))
    for layer in model:
        cst.fully_shard(layer)
    cst.fully_shard(model)
    total = layers * args.dim * args.dim * 4  # the model's bytes: what a save writes in all
    opt = None
    root = from_rank0(tempfile.mkdtemp(prefix="collsched-ckpt-bench-", dir=args.dir) if rank == 0 else None)
    # Whatever happens, nothing of the run stays on disk.
    try:
        saves, loads = [], []
        for i in range(args.repeat):
            # A fresh directory each time, as the plain writes below go to fresh files.
            path = os.path.join(root, f"ckpt-{i}")
            saves.append(timed(lambda path=path: cst.save_checkpoint(model, opt, path)))
            loads.append(timed(lambda path=path: cst.load_checkpoint(model, opt, path)))
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
        # The bound: each rank writes and reads its share, sequentially, with fsync.
        share = total // world
        block = bytes(1 << 24)
        mine = ""

        def write() -> None:
            with open(mine, "wb") as f:
                left = share
                while left > 0:
                    n = min(left, len(block))
                    f.write(block[:n])
                    left -= n
                f.flush()
                os.fsync(f.fileno())

        def read() -> None:
            with open(mine, "rb") as f:
                while f.readinto(bytearray(1 << 24)):
                    pass

        writes, reads = [], []
        for i in range(args.repeat):
            mine = os.path.join(root, f"plain-{rank}-{i}")
            writes.append(timed(write))
            reads.append(timed(read))
            os.remove(mine)
        if rank == 0:
            gb = total / 1e9
            sv, ld, wr, rd = (statistics.median(x) for x in (saves, loads, writes, reads))
            print(f"{world} ranks, {layers} layers of {args.dim}x{args.dim} f32: {gb:.2f} GB in all, in {args.dir}")
            print(
                f"save_checkpoint {gb / sv:6.2f} GB/s   sequential write+fsync {gb / wr:6.2f} GB/s   "
                f"ratio {wr / sv:.2f}x"
            )
            print(
                f"load_checkpoint {gb / ld:6.2f} GB/s   sequential read        {gb / rd:6.2f} GB/s   "
                f"ratio {rd / ld:.2f}x"
            )
        # Every rank is done with its files before rank 0 removes the directory.
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
