"""Runs a function on every rank of a job, one process per rank (as torchrun would), and
returns what each rank returned. A rank that raises, dies or hangs fails the call with the
rank's traceback; nothing is left running."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
import uuid
from typing import Any, Callable

DEFAULT_TIMEOUT = 240.0


class RankFailure(AssertionError):
    """Some rank raised, died or timed out; ``outcomes`` has every rank's (ok, value)."""

    def __init__(self, message: str, outcomes: dict[int, tuple[bool, Any]]) -> None:
        super().__init__(message)
        self.outcomes = outcomes


def _entry(fn: Callable[..., Any], rank: int, world: int, job: str, init: str, store: str, args: Any, q: Any) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        COLLSCHED_RUN_ID=job,
        COLLSCHED_TIMEOUT_SECS=os.environ.get("COLLSCHED_TIMEOUT_SECS", "60"),
        COLLSCHED_SHM_ARENA_BYTES=os.environ.get("COLLSCHED_SHM_ARENA_BYTES", "1G"),
    )
    # A rank killed by a signal (a crash in native code) prints every thread's Python stack.
    faulthandler.enable()
    try:
        import torch

        torch.set_num_threads(1)
        if init != "env":
            import torch.distributed as dist

            import collsched.torch  # noqa: F401  (registers the "collsched" backend)

            backend = "gloo" if init == "torch" else init
            dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
        value = fn(rank, world, *args)
        q.put((rank, True, value))
    except BaseException as e:  # every failure goes back to the test, with its traceback
        q.put((rank, False, f"{type(e).__module__}.{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_all(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    init: str = "env",
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[int, tuple[bool, Any]]:
    """Every rank's ``(ok, value or traceback text)``. ``init``: ``"env"`` (torchrun's
    variables only), ``"torch"`` (also ``torch.distributed`` on gloo, before ``fn``), or a
    torch.distributed backend's name (``"gloo"``, ``"collsched"``)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    job = f"pytest-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, job, init, store, args, q), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world:
                try:
                    rank, ok, value = q.get(timeout=0.2)
                    out[rank] = (ok, value)
                    continue
                except queue.Empty:
                    pass
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None:
                        # Give its last message a moment to arrive before calling it dead.
                        try:
                            rank, ok, value = q.get(timeout=1.0)
                            out[rank] = (ok, value)
                        except queue.Empty:
                            out[r] = (False, f"rank {r} died with exit code {p.exitcode}")
                if time.monotonic() > deadline:
                    for r in range(world):
                        out.setdefault(r, (False, f"rank {r} did not finish within {timeout:.0f} s"))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return out


def run(fn: Callable[..., Any], world: int, *args: Any, init: str = "env", timeout: float = DEFAULT_TIMEOUT) -> list:
    """Every rank's value, by rank; raises :class:`RankFailure` if any rank failed."""
    out = run_all(fn, world, *args, init=init, timeout=timeout)
    bad = {r: v for r, (ok, v) in out.items() if not ok}
    if bad:
        text = "\n".join(f"--- rank {r} ---\n{v}" for r, v in sorted(bad.items()))
        raise RankFailure(f"{len(bad)} of {world} ranks failed:\n{text}", out)
    return [out[r][1] for r in range(world)]
