"""torch.distributed on the "collsched" backend against "gloo", in one run.

    torchrun --nproc-per-node 2 python/benchmarks/vs_gloo.py [--min-size 4K --max-size 64M --min-ms 200]

The default group is "collsched"; a gloo group of the same ranks runs the same calls beside
it. Part 1: ``all_gather_into_tensor`` (out of place, and in place as ``all_gather_ip``: the
input is the rank's own part of the output, as in FSDP2), ``reduce_scatter_tensor`` and
``all_reduce`` (sum, f32) at per-rank sizes from ``--min-size`` to ``--max-size`` (factor
``--factor``), each timed as calls back to back after a warm-up, at least ``--iters`` of them
and ``--min-ms`` in all (the slowest rank's time per call), beside the same on tensors from
the backend's ``allocate_tensor`` (in the shared arena: nothing is copied in), in nccl-tests'
columns: ``size`` is the whole buffer (the gathered output, the reduce-scatter input),
``busbw`` is ``algbw x (n-1)/n`` (``x 2(n-1)/n`` for all-reduce); then collsched's busbw over
gloo's.
Part 2: the training step of ``vs_fsdp2.py`` (torch's FSDP2, the same GPT-like model) on a
device mesh of each group (on "collsched" also with FSDP2's
``set_allocate_memory_from_process_group_for_comm(True)``), and on torch's "fake" backend,
whose collectives move nothing: the floor a backend cannot go below. Median step time,
losses, ratios.
Part 3: the same model and loop under torch's DistributedDataParallel on each group (its
gradient buckets all-reduced during the backward); ``--no-ddp`` leaves it out.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import collsched.torch  # noqa: F401  (registers "collsched")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_fsdp2  # noqa: E402
from exchange import all_gather_json  # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    text = text.strip().upper()
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def slowest(seconds: float, gloo: Any) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
    return float(t.item())


def time_op(op: str, per_rank: int, group: Any, gloo: Any, args: argparse.Namespace, alloc: bool = False) -> float:
    """Seconds per call of ``op`` on ``group``: calls back to back after a barrier (as
    nccl-tests time them; at least ``--iters`` of them and ``--min-ms`` in all), the slowest
    rank's. ``alloc``: the tensors come from the
    group's backend (``allocate_tensor``, what FSDP2 uses after
    ``set_allocate_memory_from_process_group_for_comm(True)``) instead of ``torch.empty``.
    ``all_gather_ip``: an all-gather in place, its input the rank's own part of the output (as
    FSDP2's all-gather input is)."""
    n = dist.get_world_size()
    elems = per_rank // 4
    if alloc:
        backend = (group or dist.group.WORLD)._get_backend(torch.device("cpu"))
        small = backend.allocate_tensor(elems, dtype=torch.float32, device="cpu").fill_(1.0)
        big = backend.allocate_tensor(elems * n, dtype=torch.float32, device="cpu").fill_(1.0)
    else:
        small, big = torch.ones(elems), torch.ones(elems * n)
    if op == "all_gather_ip":
        small = big.narrow(0, dist.get_rank() * elems, elems)

    def call() -> None:
        if op in ("all_gather", "all_gather_ip"):
            dist.all_gather_into_tensor(big, small, group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(small, big, group=group)
        else:
            dist.all_reduce(small, group=group)

    for _ in range(args.warmup):
        call()
    # Enough calls for --min-ms (a few calls of a small size are the machine's noise), as many
    # on every rank (the slowest rank's estimate).
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    call()
    one = slowest(time.perf_counter() - t0, gloo)
    iters = max(args.iters, min(args.max_iters, math.ceil(args.min_ms / 1e3 / max(one, 1e-7))))
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return slowest((time.perf_counter() - t0) / iters, gloo)


def collectives(args: argparse.Namespace, gloo: Any) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    sizes = []
    s = args.min_size
    while s <= args.max_size:
        sizes.append(s)
        s *= args.factor
    if rank == 0:
        print(
            f"# {n} ranks, f32 sum, calls back to back after {args.warmup} warm-up (at least {args.iters} and "
            f"{args.min_ms:g} ms per size), the slowest rank's time per call; torch {torch.__version__}; "
            f"memcpy {memcpy_gbs():.1f} GB/s (one thread, 64 MiB)"
        )
        print(
            "# collsched: tensors from torch.empty (copied into the shared arena); +alloc: tensors from the "
            "backend's allocate_tensor (in the arena: nothing copied in)"
        )
        print(
            f"# {'op':15} {'size':>11} {'count':>10} {'collsched us':>13} {'busbw':>7} {'+alloc us':>10} "
            f"{'busbw':>7} {'gloo us':>11} {'busbw':>7} {'x gloo':>7} {'+alloc x':>8}"
        )
    for op in ("all_gather", "all_gather_ip", "reduce_scatter", "all_reduce"):
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        for per_rank in sizes:
            whole = per_rank if op == "all_reduce" else per_rank * n
            mine = time_op(op, per_rank, None, gloo, args)
            arena = time_op(op, per_rank, None, gloo, args, alloc=True)
            theirs = time_op(op, per_rank, gloo, gloo, args)
            if rank == 0:
                bus = [whole / t / 1e9 * factor for t in (mine, arena, theirs)]
                print(
                    f"  {op:15} {whole:11d} {whole // 4:10d} {mine * 1e6:13.1f} {bus[0]:7.2f} {arena * 1e6:10.1f} "
                    f"{bus[1]:7.2f} {theirs * 1e6:11.1f} {bus[2]:7.2f} {bus[0] / bus[2]:6.1f}x {bus[1] / bus[2]:7.1f}x",
                    flush=True,
                )


def memcpy_gbs() -> float:
    a, b = torch.ones(16 << 20), torch.empty(16 << 20)
    b.copy_(a)
    t0 = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    return 5 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9


def fsdp2_step(args: argparse.Namespace, group: Any, gloo: Any, alloc: bool = False) -> dict[str, Any]:
    """vs_fsdp2.py's FSDP2 model and loop on a device mesh of ``group``; ``alloc``: FSDP2 takes
    its communication buffers from the group's backend."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(args.seed)
    model = vs_fsdp2.Gpt(args.vocab, args.dim, args.heads, args.blocks, args.seq)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if group is gloo:
        # gloo's AVG reduce-scatter can silently sum (pytorch#162338): vs_fsdp2.py's workaround.
        model.set_force_sum_reduction_for_comms(True)
    if alloc:
        model.set_allocate_memory_from_process_group_for_comm(True)
    out = vs_fsdp2.train(args, model, dist.get_rank())
    out["median_s"] = slowest(out["median_s"], gloo)
    return out


def fake_group() -> Any:
    """torch's "fake" backend (collectives that move nothing), for the step's floor: the same
    FSDP2 step with communication free. ``None`` where this torch does not ship it."""
    try:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

        return dist.new_group(backend="fake")
    except Exception:
        return None


def ddp_step(args: argparse.Namespace, group: Any, gloo: Any, free: bool = False) -> dict[str, Any]:
    """The same model and loop under torch's DistributedDataParallel on ``group`` (its
    gradient buckets all-reduced during the backward); ``free``: buckets are not
    communicated (the step's floor)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(args.seed)
    model = DistributedDataParallel(
        vs_fsdp2.Gpt(args.vocab, args.dim, args.heads, args.blocks, args.seq), process_group=group
    )
    if free:

        def keep(_state, bucket):  # noqa: ANN001, ANN202 (torch checks the annotations it finds)
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        model.register_comm_hook(None, keep)
    out = vs_fsdp2.train(args, model, dist.get_rank())
    out["median_s"] = slowest(out["median_s"], gloo)
    return out


def fsdp2(args: argparse.Namespace, gloo: Any) -> None:
    args.warmup = 2
    results = {
        "gloo": fsdp2_step(args, gloo, gloo),
        "collsched": fsdp2_step(args, dist.group.WORLD, gloo),
        "collsched+alloc": fsdp2_step(args, dist.group.WORLD, gloo, alloc=True),
    }
    fake = fake_group()
    if fake is not None:
        results["no comm (fake)"] = fsdp2_step(args, fake, gloo)
    report(args, "FSDP2", results, gloo)


def ddp(args: argparse.Namespace, gloo: Any) -> None:
    args.warmup = 2
    results = {
        "gloo": ddp_step(args, gloo, gloo),
        "collsched": ddp_step(args, dist.group.WORLD, gloo),
        # torch's "fake" group does not carry DDP: a communication hook that hands each
        # bucket back as it is does the same.
        "no comm (hook)": ddp_step(args, gloo, gloo, free=True),
    }
    report(args, "DDP", results, gloo)


PROBLEMS: list[str] = []


def report(args: argparse.Namespace, kind: str, results: dict[str, dict[str, Any]], gloo: Any) -> None:
    """Rank 0 prints each implementation's median step and losses, and the ratios to gloo's.
    Every rank's losses of every step are compared with gloo's (collective, over ``gloo``): a
    NaN, a missing step or a difference beyond ``--loss-rtol`` goes to ``PROBLEMS``, which fail
    the run at its end."""
    every = all_gather_json({name: r["losses"] for name, r in results.items()}, group=gloo)
    for name in ("collsched", "collsched+alloc"):
        if name in results:
            PROBLEMS.extend(
                f"{kind} {p}"
                for p in vs_fsdp2.compare_losses(
                    "gloo", [e["gloo"] for e in every], name, [e[name] for e in every], args.loss_rtol
                )
            )
    if dist.get_rank() != 0:
        return
    n = sum(p.numel() for p in vs_fsdp2.Gpt(args.vocab, args.dim, args.heads, args.blocks, args.seq).parameters())
    print(f"# {kind} step: {n / 1e6:.1f}M parameters, {args.blocks} blocks, batch {args.batch}x{args.seq}, AdamW")
    for name, r in results.items():
        losses = " ".join(f"{x:.5f}" for x in r["losses"])
        print(f"  {name:16} median step {r['median_s'] * 1e3:8.1f} ms  losses {losses}")
    base = results["gloo"]
    for name in ("collsched", "collsched+alloc"):
        if name not in results:
            continue
        r = results[name]
        pairs = [(a, b) for e in every for a, b in zip(e["gloo"], e[name])]
        diff = max((abs(a - b) for a, b in pairs), default=float("nan"))
        ratio = r["median_s"] / base["median_s"]
        print(
            f"  ratio {name}/gloo: {kind} step time {ratio:.2f}x; largest loss difference {diff:.2e} "
            f"over {len(pairs)} losses (every rank's every step)"
        )
    for name in ("no comm (fake)", "no comm (hook)"):
        if name in results:
            floor = results[name]["median_s"] / base["median_s"]
            print(f"  floor (communication free) / gloo: {floor:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-size", type=size, default=size("4K"), help="smallest per-rank size (default 4K)")
    p.add_argument("--max-size", type=size, default=size("64M"), help="largest per-rank size (default 64M)")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=10, help="fewest timed calls per size (default 10)")
    p.add_argument("--min-ms", type=float, default=200.0, help="timed calls per size last this long at least")
    p.add_argument("--max-iters", type=int, default=10000, help="most timed calls per size")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--no-fsdp2", action="store_true", help="no FSDP2 step")
    p.add_argument("--no-ddp", action="store_true", help="no DDP step")
    # vs_fsdp2.py's model and loop.
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, default=1e-5, help="largest relative loss difference from gloo's")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("collsched")
    gloo = dist.new_group(backend="gloo")
    collectives(args, gloo)
    if not args.no_fsdp2:
        fsdp2(args, gloo)
    if not args.no_ddp:
        ddp(args, gloo)
    dist.destroy_process_group()
    # The gloo group must go before the interpreter shuts down: its worker thread frees the
    # last tensor it reduced, which needs the interpreter (torch 2.15 aborts the process, at
    # times, when it is gone by then).
    del gloo
    gc.collect()
    for problem in PROBLEMS:
        print(f"LOSS MISMATCH: {problem}")
    if PROBLEMS:
        sys.exit(1)


if __name__ == "__main__":
    main()
