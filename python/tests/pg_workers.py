"""What each rank runs in the tests of the ``"collsched"`` torch.distributed backend: every op
beside gloo's in one job, unmodified FSDP2 and DDP training loops, and a rank killed
mid-collective. Importable by the processes the tests start."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import models

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _data(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-50, 50, (numel,), generator=g).to(dtype)


def plain(t: torch.Tensor) -> tuple[str, list]:
    """A tensor as picklable plain values (a tensor sent back from a process that then exits
    cannot be received: torch shares its memory): its dtype's name and its values, exact."""
    return (str(t.dtype).removeprefix("torch."), t.flatten().tolist())


def every_op(rank: int, world: int, cases: list[tuple[str, str, str, int]]) -> list[dict[str, Any]]:
    """Each case ``(op, reduction, dtype, numel)`` on the default group ("collsched") and on a
    gloo group of the same ranks, with every rank's input gathered (through gloo) so the test
    can compute its own reference. Returns per case: the inputs of every rank, collsched's and
    gloo's outputs on this rank."""
    gloo = dist.new_group(backend="gloo")
    out = []
    for k, (op, red, dt, numel) in enumerate(cases):
        dtype = DTYPES[dt]
        x = _data(rank, numel * (world if op.startswith("reduce_scatter") else 1), dtype, k)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x, group=gloo)
        results = {}
        for name, group in (("collsched", None), ("gloo", gloo)):
            t = x.clone()
            if op == "all_reduce":
                dist.all_reduce(t, op=OPS[red], group=group)
                got = t
            elif op == "reduce_scatter":
                got = torch.empty(numel, dtype=dtype)
                # gloo's AVG reduce-scatter sums (pytorch#162338): it gets SUM, divided here.
                gloo_avg = name == "gloo" and red == "avg"
                dist.reduce_scatter_tensor(got, t, op=dist.ReduceOp.SUM if gloo_avg else OPS[red], group=group)
                if gloo_avg:
                    got = got / world
            elif op == "reduce_scatter_list":
                got = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter(got, list(t.chunk(world)), op=OPS[red], group=group)
            elif op == "all_gather":
                got = torch.empty(numel * world, dtype=dtype)
                dist.all_gather_into_tensor(got, t, group=group)
            elif op == "all_gather_in_place":
                # FSDP2's form: the input is this rank's part of the output.
                got = torch.empty(numel * world, dtype=dtype)
                mine = got.narrow(0, rank * numel, numel)
                mine.copy_(t)
                dist.all_gather_into_tensor(got, mine, group=group)
            elif op == "all_gather_list":
                parts = [torch.empty(numel, dtype=dtype) for _ in range(world)]
                dist.all_gather(parts, t, group=group)
                got = torch.cat(parts)
            elif op == "broadcast":
                dist.broadcast(t, src=world - 1, group=group)
                got = t
            elif op == "all_reduce_async":
                work = dist.all_reduce(t, op=OPS[red], group=group, async_op=True)
                assert work is not None
                work.wait()
                got = t
            else:
                raise ValueError(op)
            results[name] = plain(got)
        out.append({"inputs": [plain(e) for e in everyone], **results})
    dist.barrier()
    return out


def more_ops(rank: int, world: int) -> dict[str, Any]:
    """The ops built on the others, integer and bool reductions, PREMUL_SUM, a non-contiguous
    output, a future, and what is refused: every result as plain values."""
    out: dict[str, Any] = {}
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    t = x.clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    out["premul_sum"] = plain(t)
    t = x.clone()
    dist.reduce(t, dst=world - 1)
    out["reduce"] = plain(t)
    parts = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(x, parts, dst=0)
    out["gather"] = plain(torch.cat(parts)) if parts else None
    got = torch.empty(3)
    src = [torch.full((3,), 100.0 + q) for q in range(world)] if rank == 1 else None
    dist.scatter(got, src, src=1)
    out["scatter"] = plain(got)
    got = torch.empty(2 * world)
    dist.all_to_all_single(got, torch.arange(2.0 * world) + 100 * rank)
    out["all_to_all"] = plain(got)
    for red in ("sum", "max", "min", "product"):
        t = torch.tensor([rank + 1, -rank, 7], dtype=torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, red.upper()))
        out[f"int64_{red}"] = plain(t)
    b = torch.tensor([rank == 0, False, True])
    dist.all_reduce(b)
    out["bool_sum"] = plain(b)
    # A non-contiguous output (a transposed view) and input.
    big = torch.zeros(3, world)
    dist.all_gather_into_tensor(big.t(), torch.full((3,), float(rank)))
    out["noncontiguous"] = plain(big)
    # all_gather_coalesced: each rank's list of tensors of two shapes, every rank's lists back.
    mine = [torch.full((2,), float(rank)), torch.arange(3.0) * (rank + 1)]
    lists = [[torch.empty(2), torch.empty(3)] for _ in range(world)]
    dist.all_gather_coalesced(lists, mine)
    out["all_gather_coalesced"] = [[plain(t) for t in row] for row in lists]
    fut = dist.all_reduce(torch.full((5,), float(rank)), async_op=True).get_future()
    out["future"] = plain(fut.wait()[0])
    # Sparse all-reduce: rank r holds r + 1 entries (row r and the rows below), sums as gloo's.
    sparse = torch.zeros(world + 1, 2)
    sparse[: rank + 1] = torch.arange(2.0) + rank + 1
    s = sparse.to_sparse()
    dist.all_reduce(s)
    out["sparse_sum"] = plain(s.to_dense())
    try:
        dist.all_reduce(sparse.to_sparse(), op=dist.ReduceOp.MAX)
        out["sparse_max"] = "ran"
    except Exception as e:
        out["sparse_max"] = f"{type(e).__name__}: {e}"
    return out


def mismatched_sizes(rank: int, world: int) -> str:
    """Rank 0 gathers 4 elements, the others 8: every rank must get an error, none a hang (and,
    with ``COLLSCHED_FLIGHT_RECORDER`` set, writes its flight record)."""
    n = 4 if rank == 0 else 8
    try:
        dist.all_gather_into_tensor(torch.empty(n * world), torch.ones(n))
        return "ran"
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"


def subgroups(rank: int, world: int) -> dict[str, Any]:
    """Collectives on subgroups and a device mesh's dimensions, beside the world's."""
    from torch.distributed.device_mesh import init_device_mesh

    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=mine)
    w = torch.full((3,), float(rank))
    dist.all_reduce(w)
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = torch.full((2,), float(rank))
    dist.all_reduce(tp, group=mesh.get_group("tp"))
    dp = torch.full((2,), float(rank))
    dist.all_reduce(dp, group=mesh.get_group("dp"))
    return {"sub": t.tolist(), "world": w.tolist(), "tp": tp.tolist(), "dp": dp.tolist()}


def fsdp2_train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """An unmodified FSDP2 loop (torch's ``fully_shard`` per block and on the root, the spec's
    optimizer, optionally a gradient clip) on whatever backend the job was started with: the losses and the full
    parameters after every step."""
    from torch.distributed.fsdp import fully_shard

    name = spec["model"]
    model = models.build(name, spec.get("seed", 0))
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    losses, after = [], []
    for step in range(spec["steps"]):
        x, y = models.batch(name, spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        if spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        full = {n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()}
        after.append(full)
    return {"losses": losses, "params": after, "backend": dist.get_backend()}


def ddp_train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """An unmodified DDP loop: every rank starts from its own values (DDP broadcasts rank 0's),
    SGD with momentum; the losses and parameters after every step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    name = spec["model"]
    model = models.build(name, spec.get("seed", 0) + rank)  # DDP makes rank 0's the start
    ddp = DDP(model, bucket_cap_mb=spec.get("bucket_cap_mb", 25))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses, after = [], []
    for step in range(spec["steps"]):
        x, y = models.batch(name, spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn(name, ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after.append({n: p.detach().flatten().tolist() for n, p in model.named_parameters()})
    return {"losses": losses, "params": after}


def killed_mid_op(rank: int, world: int, numel: int) -> dict[str, Any]:
    """Every rank launches a large all-reduce; the last rank kills itself while it is in
    flight. The others return how long their wait took to fail and the error."""
    x = torch.ones(numel)
    dist.all_reduce(torch.ones(4))  # everyone is up
    work = dist.all_reduce(x, async_op=True)
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        work.wait()
        # A wait can complete when the kill came after this rank's part; the next one cannot.
        dist.all_reduce(torch.ones(4))
    except Exception as e:
        return {"seconds": time.monotonic() - t0, "error": f"{type(e).__module__}.{type(e).__name__}: {e}"}
    return {"seconds": time.monotonic() - t0, "error": None}


def one_rank_skips(rank: int, world: int, path: str) -> str:
    """Both ranks all-reduce once; then rank 0 all-reduces again, waiting 2 s, while rank 1
    launches nothing and writes its flight record to ``path`` on request. Rank 0 returns its
    error (its own record is written there by the timeout, ``COLLSCHED_FLIGHT_RECORDER``)."""
    import datetime

    import collsched.torch as cst

    dist.all_reduce(torch.ones(4))
    if rank == 1:
        cst.flight_record(path)
        time.sleep(4)  # stay up: rank 0 must time out, not see a departure
        return "skipped"
    try:
        dist.all_reduce(torch.ones(4), async_op=True).wait(timeout=datetime.timedelta(seconds=2))
        return "ran"
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"


def recorded(rank: int, world: int, path: str) -> dict:
    """A few collectives, then this rank's flight record, written to ``path``."""
    import collsched.torch as cst

    t = torch.ones(8)
    dist.all_reduce(t)
    dist.all_gather_into_tensor(torch.empty(8 * world), t)
    dist.barrier()
    return cst.flight_record(path)


def monitored(rank: int, world: int) -> dict[str, str]:
    """A monitored barrier every rank reaches, then one the last rank skips (it stays up)."""
    import datetime

    out = {}
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    out["all"] = "passed"
    if rank == world - 1:
        time.sleep(4)
        return out
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
        out["skipped_by_last"] = "passed"
    except Exception as e:
        out["skipped_by_last"] = f"{type(e).__name__}: {e}"
    return out


def detail_mode(rank: int, world: int) -> dict[str, Any]:
    """Collectives and object collectives on the default group and a subgroup, run under
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (set by the test)."""
    sub = dist.new_group(list(range(world)))
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}"}, group=sub)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t, group=sub)
    u = torch.full((2,), float(rank))
    dist.all_reduce(u)
    return {
        "debug": str(dist.get_debug_level()),
        "objects": objs,
        "sub": plain(t),
        "default": plain(u),
    }


def semantics(rank: int, world: int) -> dict[str, Any]:
    """What torch's backends do that is easy to get wrong, beside gloo: the bitwise reductions
    (torch passes a ``ReduceOp`` object), a group whose ranks are not in ascending order
    (refused by name), an all-to-all of uneven splits, an async op reduced locally that
    returns before its peer comes, and the future of an op whose peer never comes (a failed
    future, not a result). Rank 1 then stays up past the subgroup's 2 s timeout."""
    import datetime

    gloo = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for name, op in (("band", dist.ReduceOp.BAND), ("bor", dist.ReduceOp.BOR), ("bxor", dist.ReduceOp.BXOR)):
        for dtype in (torch.int8, torch.uint8, torch.int64, torch.bool):
            x = _data(rank, 9, torch.int64, 7).to(dtype) if dtype != torch.bool else _data(rank, 9, torch.int64, 7) > 0
            got = {}
            for backend, group in (("collsched", None), ("gloo", gloo)):
                t = x.clone()
                dist.all_reduce(t, op=op, group=group)
                got[backend] = plain(t)
            out[f"{name}-{dtype}"] = got
    try:
        unsorted = dist.new_group(list(reversed(range(world))), sort_ranks=False)
        dist.all_reduce(torch.ones(2), group=unsorted)
        out["unsorted"] = "ran"
    except Exception as e:
        out["unsorted"] = f"{type(e).__name__}: {e}"
    # Uneven all-to-all (world 2): rank 0 sends 2 rows to itself and 3 to rank 1, rank 1 sends
    # 1 and 3; rows of 3 elements.
    sends = [[2, 3], [1, 3]][rank]
    takes = [[2, 1], [3, 3]][rank]
    x = torch.arange(sum(sends) * 3, dtype=torch.float32).view(-1, 3) + 100 * rank
    for backend, group in (("collsched", None), ("gloo", gloo)):
        got = torch.full((sum(takes), 3), -1.0)
        dist.all_to_all_single(got, x, takes, sends, group=group)
        out.setdefault("all_to_all_uneven", {})[backend] = plain(got)
    # A member with no rows at all (a mixture of experts' idle rank), and sizes the members
    # disagree on (rank 1 takes 2 rows from rank 0, which sends it 1): every member refuses.
    empty = torch.zeros((0, 3)) if rank == 0 else torch.arange(6.0).view(2, 3)
    for backend, group in (("collsched", None), ("gloo", gloo)):
        got = torch.full(([2, 0][rank], 3), -1.0)
        dist.all_to_all_single(got, empty, [[0, 2], [0, 0]][rank], [[0, 0], [2, 0]][rank], group=group)
        out.setdefault("all_to_all_empty", {})[backend] = plain(got)
    try:
        got = torch.zeros(([2, 1][rank], 1))
        dist.all_to_all_single(got, torch.zeros((2, 1)), [[1, 1], [1, 0]][rank], [[1, 1], [2, 0]][rank])
        out["all_to_all_disagree"] = "ran"
    except Exception as e:
        out["all_to_all_disagree"] = f"{type(e).__name__}: {e}"
    # An async op reduced locally returns before its peer comes: rank 0 launches it, then
    # sends to rank 1, which receives before it launches the op (a deadlock if the launch
    # waited for the op).
    t = torch.tensor([rank + 1], dtype=torch.int64)
    if rank == 0:
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
        dist.send(torch.tensor([5.0]), 1)
        work.wait()
    else:
        got = torch.zeros(1)
        dist.recv(got, 0)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    out["async_local"] = plain(t)
    short = dist.new_group(timeout=datetime.timedelta(seconds=2))
    dist.barrier()
    if rank == 1:
        time.sleep(5)  # stays up: rank 0 times out, it does not see a departure
        out["future"] = "skipped"
        return out
    fut = dist.all_reduce(torch.ones(4), group=short, async_op=True).get_future()
    try:
        out["future"] = f"completed with {fut.wait()!r}"
    except Exception as e:
        out["future"] = f"raised {type(e).__name__}: {e}"
    return out
