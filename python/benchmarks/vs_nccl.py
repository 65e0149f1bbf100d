"""collsched's collectives on its cuda backend beside torch's NCCL and a device copy, in one run.

    python python/benchmarks/vs_nccl.py [--ranks 1] [--min-kb 4 --max-mb 256 --factor 4] [--inflight 2]

For each size (bytes of the whole, gathered buffer, as nccl-tests and ``collsched bench``
count them) and each of all-gather and reduce-scatter (f32), three columns measured here, one
after the other on the same GPUs:
- ``collsched``: ``collsched.bench(op, ranks, backend="cuda", check=True)`` (a thread per GPU,
  NCCL on collsched's own streams, every element checked);
- ``torch``: torch's NCCL (``all_gather_into_tensor`` / ``reduce_scatter_tensor``, a process per
  GPU spawned here), every element checked against the expected values;
- ``copy``: a device-to-device copy of the whole buffer on one GPU (``Tensor.copy_``, a
  ``cudaMemcpyAsync``): what one GPU's memory moves, the ceiling of a one-GPU "collective".
Times are the median of ``--iters`` after ``--warmup``, each closed by a synchronize (with
``--inflight K``, K collectives queued at once in each and the time divided by K: collsched's
in flight, torch's ``async_op``); the
busbw columns use nccl-tests' factor (n-1)/n, so at one rank they are 0 and algbw is what
compares. The run fails (exit 1) on a wrong element, a NaN time, or a size missing from any
column.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = ("all_gather", "reduce_scatter")


def sizes(args: argparse.Namespace) -> list[int]:
    out, b = [], args.min_kb << 10
    while b <= args.max_mb << 20:
        out.append(b)
        b *= args.factor
    return out


def timed(fn: Any, iters: int, warmup: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``, each synchronized."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def torch_rank(rank: int, world: int, store: str, args: argparse.Namespace, q: Any) -> None:
    """One process of torch's NCCL run: every size of every op, checked; rank 0 reports."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    rows: dict[str, dict[int, tuple[float, int]]] = {op: {} for op in OPS}
    try:
        for whole in sizes(args):
            n = whole // 4 // world  # f32 elements per rank
            k = args.inflight
            for op in OPS:
                # k input/output pairs: each iteration queues k collectives (async_op) and
                # waits for them all; the time per collective is the iteration's / k.
                if op == "all_gather":
                    ins = [torch.full((n,), float(rank + 1), device="cuda") for _ in range(k)]
                    outs = [torch.empty(n * world, device="cuda") for _ in range(k)]
                    call = dist.all_gather_into_tensor
                    want = torch.arange(1, world + 1, device="cuda", dtype=torch.float32).repeat_interleave(n)
                else:
                    ins = [torch.full((n * world,), float(rank + 1), device="cuda") for _ in range(k)]
                    outs = [torch.empty(n, device="cuda") for _ in range(k)]
                    call = dist.reduce_scatter_tensor
                    want = torch.full((n,), float(world * (world + 1) // 2), device="cuda")

                def run(ins: list = ins, outs: list = outs, call: Any = call) -> None:
                    works = [call(o, i, async_op=True) for o, i in zip(outs, ins)]
                    for w in works:
                        w.wait()

                t = timed(run, args.iters, args.warmup) / k
                wrong = sum(int((o != want).sum().item()) for o in outs)
                rows[op][whole] = (t, wrong)
        q.put((rank, True, rows))
    except BaseException as e:  # reported to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def torch_columns(world: int, args: argparse.Namespace) -> dict[str, dict[int, tuple[float, int]]]:
    """torch's NCCL over ``world`` processes: the slowest rank's time and every rank's wrong count."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="collsched-vs-nccl-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=torch_rank, args=(r, world, store, args, q)) for r in range(world)]
        for p in procs:
            p.start()
        got = [q.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    failed = [f"rank {r}: {v}" for r, ok, v in got if not ok]
    if failed:
        raise SystemExit("torch's NCCL run failed: " + "; ".join(failed))
    out: dict[str, dict[int, tuple[float, int]]] = {op: {} for op in OPS}
    for op in OPS:
        for whole in sizes(args):
            per = [v[op][whole] for _, _, v in got]
            out[op][whole] = (max(t for t, _ in per), sum(w for _, w in per))
    return out


def copy_column(args: argparse.Namespace) -> dict[int, float]:
    """A device-to-device copy of the whole buffer on GPU 0."""
    out = {}
    for whole in sizes(args):
        src = torch.ones(whole // 4, device="cuda:0")
        dst = torch.empty_like(src)
        out[whole] = timed(lambda src=src, dst=dst: dst.copy_(src), args.iters, args.warmup)
        if not torch.equal(src, dst):
            raise SystemExit(f"the device copy of {whole} bytes is wrong")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="GPUs (default: every visible one, at most 8)")
    p.add_argument("--min-kb", type=int, default=4)
    p.add_argument("--max-mb", type=int, default=256)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--inflight",
        type=int,
        default=1,
        help="collectives queued at once (collsched.bench's inflight; torch's async_op), time per collective",
    )
    args = p.parse_args()
    if args.inflight < 1:
        raise SystemExit(f"vs_nccl: --inflight {args.inflight}; give 1 or more")
    if not torch.cuda.is_available():
        raise SystemExit("vs_nccl: no CUDA device here (torch.cuda.is_available() is False)")
    world = args.ranks or min(8, torch.cuda.device_count())
    import collsched

    ours = {
        op: collsched.bench(
            op,
            world,
            min_bytes=args.min_kb << 10,
            max_bytes=args.max_mb << 20,
            factor=args.factor,
            iters=args.iters,
            warmup=args.warmup,
            check=True,
            backend="cuda",
            inflight=args.inflight,
        )
        for op in OPS
    }
    theirs = torch_columns(world, args)
    copy = copy_column(args)
    bus = (world - 1) / world
    print(
        f"{torch.cuda.get_device_name(0)}, {world} rank(s); torch {torch.__version__} (CUDA {torch.version.cuda}, "
        f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}); f32; median of {args.iters} after {args.warmup}; "
        f"{args.inflight} in flight"
    )
    problems = []
    for op in OPS:
        print(f"\n{op}")
        print(
            f"{'bytes':>12} {'collsched us':>13} {'algbw':>7} {'busbw':>7} {'torch us':>10} {'algbw':>7} "
            f"{'busbw':>7} {'copy us':>9} {'GB/s':>7} {'ours/torch':>10} {'#wrong':>7}"
        )
        rows = {r["bytes"]: r for r in ours[op]}
        for whole in sizes(args):
            r = rows.get(whole)
            if r is None or whole not in theirs[op] or whole not in copy:
                problems.append(f"{op} {whole} bytes: missing from a column")
                continue
            t_ours, t_torch, t_copy = r["time_us"] * 1e-6, theirs[op][whole][0], copy[whole]
            wrong = (r["wrong"] or 0) + theirs[op][whole][1]
            if not all(math.isfinite(t) and t > 0 for t in (t_ours, t_torch, t_copy)):
                problems.append(f"{op} {whole} bytes: a time is not a positive number")
            if wrong or r["wrong"] is None:
                problems.append(f"{op} {whole} bytes: {wrong} wrong elements (or collsched did not check)")
            a_ours, a_torch = whole / t_ours / 1e9, whole / t_torch / 1e9
            print(
                f"{whole:>12} {t_ours * 1e6:>13.1f} {a_ours:>7.1f} {a_ours * bus:>7.1f} {t_torch * 1e6:>10.1f} "
                f"{a_torch:>7.1f} {a_torch * bus:>7.1f} {t_copy * 1e6:>9.1f} {whole / t_copy / 1e9:>7.1f} "
                f"{t_ours / t_torch:>10.2f} {wrong:>7}"
            )
    for p_ in problems:
        print(f"FAILED: {p_}")
    if problems:
        sys.exit(1)


if __name__ == "__main__":
    main()
