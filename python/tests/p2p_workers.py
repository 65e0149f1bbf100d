"""Rank functions of test_p2p.py (importable by spawned processes). Each returns what it
received, as plain lists, for the test to compare with what the senders sent."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist


def payload(src: int, dst: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """What ``src`` sends ``dst``: distinct per pair, per message (``salt``) and per element,
    exact in every dtype used (small integers)."""
    base = (torch.arange(numel, dtype=torch.int64) * 7 + src * 1000 + dst * 100 + salt * 10) % 97
    if dtype == torch.bool:
        return base % 2 == 1
    return base.to(dtype)


def plain(t: torch.Tensor) -> tuple[str, list]:
    return (str(t.dtype).removeprefix("torch."), t.float().tolist() if t.dtype == torch.bfloat16 else t.tolist())


def crossing(rank: int, world: int, numel: int) -> dict[str, Any]:
    """Every rank isends to every other rank and then irecvs from each, as a ring and all at
    once (each pair crosses), then with batch_isend_irecv in the same shape; waits only after
    posting everything."""
    out: dict[str, Any] = {}
    peers = [r for r in range(world) if r != rank]
    reqs, got = [], {}
    for p in peers:
        reqs.append(dist.isend(payload(rank, p, numel, torch.float32), p))
    for p in peers:
        got[p] = torch.full((numel,), -1.0)
        reqs.append(dist.irecv(got[p], p))
    for r in reqs:
        r.wait()
    out["isend_irecv"] = {p: plain(t) for p, t in got.items()}
    ops, got = [], {}
    for p in peers:
        ops.append(dist.P2POp(dist.isend, payload(rank, p, numel, torch.float32, 1), p))
        got[p] = torch.full((numel,), -1.0)
        ops.append(dist.P2POp(dist.irecv, got[p], p))
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    out["batch"] = {p: plain(t) for p, t in got.items()}
    # Blocking send then recv in a ring (rank 0 receives first, so the ring is not a cycle of
    # sends waiting on receives, as with any backend).
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    t = torch.full((numel,), -1.0)
    if rank == 0:
        dist.send(payload(rank, nxt, numel, torch.float32, 2), nxt)
        dist.recv(t, prv)
    else:
        dist.recv(t, prv)
        dist.send(payload(rank, nxt, numel, torch.float32, 2), nxt)
    out["ring"] = plain(t)
    return out


def tags_and_order(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends rank 1 three messages with tags 5, 7, 5; rank 1 receives tag 7 first, then
    the two tag-5 messages (in their order)."""
    if rank == 0:
        for salt, tag in ((0, 5), (1, 7), (2, 5)):
            dist.send(payload(0, 1, 6, torch.int64, salt), 1, tag=tag)
        return {}
    if rank != 1:
        return {}
    got = {}
    for name, tag in (("tag7", 7), ("tag5_first", 5), ("tag5_second", 5)):
        t = torch.zeros(6, dtype=torch.int64)
        dist.recv(t, 0, tag=tag)
        got[name] = plain(t)
    return got


def any_source(rank: int, world: int) -> dict[str, Any]:
    """Every rank but 0 sends rank 0 two messages; rank 0 receives them from any source (recv
    with src=None, then irecv) and says who each came from."""
    if rank != 0:
        dist.send(payload(rank, 0, 10, torch.float32, 0), 0)
        dist.send(payload(rank, 0, 10, torch.float32, 1), 0)
        return {}
    got = []
    for i in range(2 * (world - 1)):
        t = torch.full((10,), -1.0)
        if i % 2 == 0:
            src = dist.recv(t)
        else:
            work = dist.irecv(t)
            work.wait()
            src = work._source_rank()
        got.append((src, plain(t)))
    return {"got": got}


def large_and_odd(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends rank 1 a tensor of 3 MiB and non-contiguous tensors of odd dtypes and
    sizes; rank 1 receives some of them into non-contiguous tensors."""
    big = 3 * (1 << 20) // 4 + 5  # f32 elements: just over 3 MiB
    dtypes = [torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.int16]
    if rank == 0:
        dist.send(payload(0, 1, big, torch.float32), 1)
        for i, dt in enumerate(dtypes):
            # Every other element of a longer tensor: non-contiguous, 17 elements.
            t = payload(0, 1, 34, torch.float32 if dt == torch.complex64 else dt, i)
            t = t.to(dt) if dt == torch.complex64 else t
            dist.send(t[::2], 1)
        dist.send(torch.empty(0), 1)
        return {}
    if rank != 1:
        return {}
    out: dict[str, Any] = {}
    t = torch.zeros(big)
    dist.recv(t, 0)
    out["big"] = plain(t)
    for i, dt in enumerate(dtypes):
        if i % 2:
            holder = torch.zeros(17, 3, dtype=dt)
            t = holder[:, 1]  # non-contiguous receiver
        else:
            t = torch.zeros(17, dtype=dt)
        dist.recv(t, 0)
        out[str(dt)] = plain(t.real if dt == torch.complex64 else t)
    e = torch.empty(0)
    dist.recv(e, 0)
    out["empty"] = e.numel()
    return out


def polled(rank: int, world: int) -> dict[str, Any]:
    """Works polled with is_completed() until they complete (what torch's holder of a Python
    backend's work does not forward): an irecv whose sender sends only after a barrier the
    receiver passes first, an isend, an async all-reduce and a recv from any source; then
    whether each says complete after wait(), and what came."""
    out: dict[str, Any] = {}
    t = torch.full((5,), -1.0)
    # A future waited for while a receive is pending and polled: a poll that started a wait
    # for the receive would block the futures' thread, and this would never return.
    x = torch.full((2,), float(rank))
    if rank == 1:
        work = dist.irecv(t, 0)
        out["early"] = work.is_completed()
        dist.all_reduce(x, async_op=True).get_future().wait()
        dist.barrier()
        while not work.is_completed():
            time.sleep(0.001)
        work.wait()
        out["irecv"] = plain(t)
    elif rank == 0:
        dist.all_reduce(x, async_op=True).get_future().wait()
        dist.barrier()
        work = dist.isend(payload(0, 1, 5, torch.float32), 1)
        while not work.is_completed():
            time.sleep(0.001)
        work.wait()
    else:
        dist.all_reduce(x, async_op=True).get_future().wait()
        dist.barrier()
    out["future"] = plain(x)
    s = torch.full((3,), float(rank))
    work = dist.all_reduce(s, async_op=True)
    while not work.is_completed():
        time.sleep(0.001)
    work.wait()
    out["all_reduce"] = plain(s)
    out["after_wait"] = work.is_completed()
    if rank == 0:
        a = torch.zeros(2)
        work = dist.irecv(a)
        # A receive from rank 1 posted while one from any source is pending is refused.
        try:
            dist.irecv(torch.zeros(2), 1)
            out["after_any"] = "no error"
        except Exception as e:
            out["after_any"] = f"{type(e).__name__}: {e}"
        while not work.is_completed():
            time.sleep(0.001)
        out["any_source"] = (work._source_rank(), plain(a))
    elif rank == 1:
        dist.send(payload(1, 0, 2, torch.float32), 0)
    dist.barrier()
    return out


def bad_peer(rank: int, world: int) -> dict[str, str]:
    """A send to a rank outside the group, a receive of the wrong size (rank 1 from rank 0), and
    a receive from a rank that never sends (on a group whose timeout is 3 s): each error's
    text."""
    import datetime

    out: dict[str, str] = {}
    short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3))
    try:
        dist.send(torch.ones(3), world + 2)
    except Exception as e:
        out["outside"] = f"{type(e).__name__}: {e}"
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        backend.send([torch.ones(3)], world + 2, 0)
    except Exception as e:
        out["backend_outside"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        dist.send(torch.ones(4), 1)
    elif rank == 1:
        try:
            dist.recv(torch.zeros(5), 0)
        except Exception as e:
            out["size"] = f"{type(e).__name__}: {e}"
    # A receive waited for with a timeout of its own before its sender sends (rank 0 sends
    # once rank 1 says its wait is over): the wait raises, the receive stays pending, a later
    # wait gets the message.
    if rank == 0:
        dist.recv(torch.zeros(1), 1, tag=12)
        dist.send(torch.full((2,), 7.0), 1, tag=11)
    elif rank == 1:
        work = dist.irecv(got := torch.zeros(2), 0, tag=11)
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.3))
            out["short_wait"] = "no error"
        except Exception as e:
            out["short_wait"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
        dist.send(torch.zeros(1), 0, tag=12)
        work.wait()
        out["after_short_wait"] = str(got.tolist())
    if rank == 1:
        t0 = time.monotonic()
        try:
            dist.recv(torch.zeros(2), 0, tag=9, group=short)
        except Exception as e:
            out["silent"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
            out["seconds"] = f"{time.monotonic() - t0:.1f}"
        # The same, polled: is_completed() turns True at the timeout, and wait() raises.
        out["silent_polled"] = _polled(dist.irecv(torch.zeros(2), 0, tag=9, group=short))
    dist.barrier()
    return out


def profiled(rank: int, world: int) -> list[tuple[str, bool, list]]:
    """Profiler events of an all_reduce, a send and a recv (ranks 0 and 1): names, whether
    async, input shapes."""
    t = torch.ones(2, 3)
    with torch.autograd.profiler.profile(record_shapes=True) as prof:
        dist.all_reduce(t)
        if rank == 0:
            dist.send(torch.ones(4, 5), 1)
        elif rank == 1:
            dist.recv(torch.zeros(4, 5), 0)
    return sorted(
        (e.name, bool(e.is_async), [list(s) for s in e.input_shapes])
        for e in prof.function_events
        if e.name.startswith("collsched:")
    )


def exited_sender(rank: int, world: int) -> dict[str, str]:
    """Rank 0 exits without sending; rank 1's receive from it fails, naming it."""
    import os

    dist.barrier()
    if rank == 0:
        os._exit(0)
    out: dict[str, str] = {}
    try:
        dist.recv(torch.zeros(2), 0)
        out["recv"] = "no error"
    except Exception as e:
        out["recv"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
    # Polled: is_completed() turns True (the sender is gone), and wait() raises why.
    out["polled"] = _polled(dist.irecv(torch.zeros(2), 0, tag=3))
    return out


def _polled(work: Any) -> str:
    """Polls ``work`` with ``is_completed()`` until it says so, then waits for it: "no error",
    or the error's ``module.Name: text``."""
    while not work.is_completed():
        time.sleep(0.01)
    try:
        work.wait()
        return "no error"
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
