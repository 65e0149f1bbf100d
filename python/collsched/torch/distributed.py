"""The ``"collsched"`` backend of torch.distributed: any PyTorch program (FSDP2, DDP, plain
``dist`` calls) on collsched's shared-memory collectives, by changing one string::

    import torch.distributed as dist
    import collsched.torch                      # registers "collsched" (CPU tensors)
    dist.init_process_group("collsched")        # under torchrun, as with "gloo"

What it runs, per process group (``dist.new_group`` and device meshes map to rank groups of
the job):

- ``all_gather_into_tensor``, list ``all_gather``, ``reduce_scatter_tensor``, list
  ``reduce_scatter``, ``all_reduce``, ``broadcast``, ``barrier``, their coalesced forms, and
  ``reduce``, ``gather``, ``scatter`` and ``all_to_all_single`` built on them; ``async_op=True``
  returns a work whose ``wait()`` blocks on the collective's completion, and
  ``get_future()`` a future completed in the background (DDP's gradient hooks use it).
- Sum, average (a true average: the sum divided by the group's size, in ``f32``) and
  ``PREMUL_SUM`` of ``float32``, ``float16`` and ``bfloat16`` run on the library's kernels
  (accumulated in ``f32``, rounded once). Max, min, product and the bitwise ops, and every
  reduction of other types (``float64``, integers, ``bool``), gather every member's tensor
  and reduce locally with torch: exact, at ``n`` times the tensor's memory, for the small
  tensors they are used on. All-gathers and broadcasts move any type as bytes.
- Peers can read only memory every process maps, so a launch copies inputs into the rank's
  shared arena (what peers read of them: a reduce-scatter's own chunk stays where it is) and
  an all-reduce's result is copied out at ``wait()`` (copies gloo also makes, without its
  sockets); from 256 KiB an all-reduce runs as a reduce-scatter and an all-gather straight
  into the tensor. Tensors from ``allocate_tensor`` are not copied in.
- Point to point: ``send``, ``recv``, ``isend``, ``irecv``, ``recv`` from any source
  (``src=None``) and ``batch_isend_irecv``, with tags, through memory files every process of
  the job can open, announced in the group's store, off the collectives' stream (``p2p.py``):
  crossing ``isend``/``irecv`` pairs never wait on each other; sends are eager; a receive
  whose sender never sends is a :class:`collsched.PeerError` naming the peer and the op after
  the group's timeout.
- While a profiler records, each op is an async event ``"<backend>:<op>"`` with its input
  shapes, as torch's own backends record it (``profiling.py``; ``"gloo:..."`` where this
  backend is registered as gloo, through :func:`creator`).

The backend is a Python subclass of torch's C++ ``Backend`` (not of ``ProcessGroup``): torch
puts it inside a C++ ``ProcessGroup`` for the CPU device, so the dispatcher's collectives
reach it too (functional collectives, DTensor's ``full_tensor`` and redistribution, FSDP2's
gradient clipping); no C++ code is needed.

Every group's collectives run in launch order on one stream of the rank, all groups' on the
same one: ranks must issue their collectives in the same order, across groups too (torch's
backends need the order within a group only); a disagreement is a
:class:`collsched.MismatchError` on every member, a dead or missing member a
:class:`collsched.PeerError` (for a member that never arrives, within the process group's
timeout, ``init_process_group(timeout=...)``, which ``COLLSCHED_TIMEOUT_SECS`` overrides when
set; at once for one that died). A group's ranks are in ascending order (``new_group`` sorts
them; ``sort_ranks=False`` with another order is refused by name).
"""

from __future__ import annotations

import datetime
import functools
import math
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import Work as _C10dWork

from .. import _native
from .._native import CollschedError
from . import holder, profiling
from . import world as _world
from .holder import note_source
from .p2p import Mailbox, poll_until

NAME = "collsched"

_KERNEL_TYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_R = dist.ReduceOp


def _default_timeout() -> float:
    """The backend's timeout when the group gives none: ``COLLSCHED_TIMEOUT_SECS`` (300)."""
    try:
        return float(os.environ.get("COLLSCHED_TIMEOUT_SECS", "300"))
    except ValueError:
        return 300.0


def _span(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), t.numel() * t.element_size())


def _seconds(timeout: Any) -> float | None:
    """A torch timeout (``timedelta``; negative: unset) in seconds, or ``None``."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return s if s > 0 else None


class _Work(_C10dWork):
    """One launch: the library's work, the tensors it reads and writes (held until it is
    waited for: the library copies into them by address), and what runs after the copy-out
    (a non-contiguous output filled from its contiguous stand-in, a local reduction)."""

    def __init__(
        self,
        native: Any,
        result: list[torch.Tensor],
        keep: Sequence[Any] = (),
        after: Sequence[Callable[[], None]] = (),
        ready: Callable[[], bool] | None = None,
        what: str = "collsched",
    ) -> None:
        super().__init__()
        self._native = native
        # Whether a work with no native part can complete without waiting (a receive), and
        # what it is (its errors' words: op, peer, tag, rank).
        self._ready = ready
        self._what = what
        # The profiler event of the op (profiling.recorded), ended when the work completes.
        self._profile: Any = None
        # A receive from any source: the sender's group rank.
        self._source: int | None = None
        self._result = result
        self._keep: Sequence[Any] | None = keep
        self._after = after
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def _finish(self, seconds: float | None = None) -> None:
        if seconds is not None and self._native is None and self._ready is not None:
            self._await_ready(seconds)
        with self._lock:
            if not self._done:
                try:
                    if self._native is not None:
                        self._native.wait(seconds)
                    for f in self._after:
                        f()
                except CollschedError as e:
                    if "not complete after waiting" in str(e):
                        raise  # still pending: a later wait may succeed
                    self._error = e
                except BaseException as e:
                    self._error = e
                self._done = True
                self._keep = None
                if self._profile is not None:
                    profiling.end(self._profile)
                    self._profile = None
            if self._error is not None:
                raise self._error

    def _await_ready(self, seconds: float) -> None:
        """A receive waited for with a timeout of its own: its message must come within it,
        else the work stays pending (a later wait may succeed), as a collective's does."""
        ready = self._ready
        assert ready is not None
        if not poll_until(lambda: self._done or ready(), time.monotonic() + seconds):
            raise _native.PeerError(
                f"{self._what}: not complete after waiting: Timed out waiting {seconds * 1000:.0f}ms for its "
                "message; it stays pending (a later wait may succeed)"
            )

    def wait(self, timeout: Any = None) -> bool:
        self._finish(_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._native is not None and not self._native.is_completed():
            return False
        if self._ready is not None and not self._ready():
            return False
        self._finish()
        return True

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def _source_rank(self) -> int:
        """The sender's group rank, for a completed receive from any source."""
        self._finish()
        if self._source is None:
            raise CollschedError("collsched: source rank asked of a work that is not a receive from any source")
        return self._source

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        # A failure travels as a value (_Failed) that the returned future's callback raises:
        # an exception set on a Python future is lost where torch's holder wraps the future
        # again in C++ (its waiters would see the failure object as the result).
        raw: torch.futures.Future = torch.futures.Future()
        if holder.probing():
            # is_completed() through torch's holder (holder.py): answered now, nothing waited for.
            try:
                if self.is_completed():
                    raw.set_result(self._result)
            except BaseException as e:  # complete, with its error
                raw.set_result(_Failed(e))
            return raw.then(_unwrap)
        _completer().put((self, raw))
        return raw.then(_unwrap)


class _Failed:
    """A work's failure, as the value of the future its ``get_future`` chains from."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(fut: torch.futures.Future) -> Any:
    value = fut.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


def _complete_futures(q: queue.SimpleQueue) -> None:
    """The completer's loop: works complete in launch order (one stream per rank), so one
    thread finishing them in the order their futures were asked for never waits behind a
    later one."""
    while True:
        work, fut = q.get()
        try:
            work._finish()
        except BaseException as e:
            fut.set_result(_Failed(e))
        else:
            fut.set_result(work._result)


@functools.lru_cache(maxsize=1)
def _completer() -> queue.SimpleQueue:
    q: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_complete_futures, args=(q,), name="collsched-futures", daemon=True).start()
    return q


def _done(result: list[torch.Tensor]) -> _Work:
    return _Work(None, result)


def _contiguous_out(t: torch.Tensor, after: list[Callable[[], None]]) -> torch.Tensor:
    """``t`` if it is contiguous; else a contiguous stand-in copied into ``t`` after the wait."""
    if t.is_contiguous():
        return t
    tmp = torch.empty_like(t, memory_format=torch.contiguous_format)
    after.append(lambda: t.copy_(tmp))
    return tmp


def _local_reduce(stacked: torch.Tensor, op: Any, n: int) -> torch.Tensor:
    """Reduces ``stacked`` (every member's tensor along dim 0) with ``op``, in its type."""
    # A ReduceOp object as torch passes it (``opts.reduceOp``) equals its kind only from the
    # left (``op == BAND``, not ``BAND == op``, which ``in`` and dict lookups ask): its kind.
    op = getattr(op, "op", op)
    dtype = stacked.dtype
    if op == _R.SUM:
        out = stacked.any(0) if dtype == torch.bool else stacked.sum(0, dtype=dtype)
    elif op == _R.AVG:
        if not (dtype.is_floating_point or dtype.is_complex):
            raise CollschedError(f"collsched: all_reduce with AVG on {dtype}: an average of integers is not one")
        out = stacked.sum(0, dtype=dtype) / n
    elif op == _R.MAX:
        out = stacked.amax(0)
    elif op == _R.MIN:
        out = stacked.amin(0)
    elif op == _R.PRODUCT:
        out = stacked.all(0) if dtype == torch.bool else stacked.prod(0, dtype=dtype)
    elif op in (_R.BAND, _R.BOR, _R.BXOR):
        if dtype.is_floating_point or dtype.is_complex:
            raise CollschedError(f"collsched: bitwise reduction on {dtype}; use an integer or bool tensor")
        f = {_R.BAND: torch.bitwise_and, _R.BOR: torch.bitwise_or, _R.BXOR: torch.bitwise_xor}[op]
        out = functools.reduce(f, stacked.unbind(0))
    else:
        raise CollschedError(f"collsched: reduction {op} is not supported")
    return out.to(dtype)


class _Backend(_C10dBackend):
    """One process group's backend on this rank: a :class:`collsched._native.Comm` over the
    group's ranks in the job."""

    def __init__(
        self, comm: Any, group_rank: int, group_size: int, store: Any, name: str = NAME, timeout: float | None = None
    ) -> None:
        super().__init__(group_rank, group_size)
        # The name profiler events carry ("gloo" where this backend is registered as gloo).
        self._profile_name = name
        self._comm = comm
        self._ranks: list[int] = list(comm.ranks)
        self._n = group_size
        self._me = group_rank
        # The group's store (torch's, prefixed per group) and the monitored barriers so far.
        self._store = store
        self._monitored = 0
        self._mailbox = Mailbox(store, group_rank, group_size, self._ranks, timeout or _default_timeout())

    def getBackendName(self) -> str:
        # Always this backend's own name, also where it is registered as gloo: torch's C++
        # takes a backend named "gloo" for its ProcessGroupGloo (DDP's logger casts it so).
        return NAME

    # torch reads these through Python attributes; left to the C++ base, reading one from
    # Python recurses (the base's property asks the subclass again).
    @property
    def supports_coalescing(self) -> bool:
        return False

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def _supports_time_estimate(self) -> bool:
        return False

    # -- memory ------------------------------------------------------------------------------

    def supports_tensor_alloc(self, device: Any) -> bool:
        return torch.device(device).type == "cpu"

    def allocate_tensor(self, size: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
        """A 1-D tensor of ``size`` elements in this rank's shared arena: collectives on it copy
        nothing in (FSDP2 asks for its communication buffers here after
        ``set_allocate_memory_from_process_group_for_comm(True)``)."""
        if torch.device(device).type != "cpu":
            raise CollschedError(f"collsched: allocate_tensor on {device}; this backend's memory is the CPU's")
        nbytes = int(size) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._comm.alloc(nbytes), dtype=dtype, count=int(size))

    # -- reductions -------------------------------------------------------------------------

    def _kernel_op(self, op: Any, dtype: torch.dtype) -> tuple[str, float] | None:
        """``(op, pre_divide)`` when the kernels run this reduction, else ``None``."""
        if dtype not in _KERNEL_TYPES:
            return None
        if op == _R.SUM:
            return ("sum", 1.0)
        if op == _R.AVG:
            return ("avg", 1.0)
        if op == _R.PREMUL_SUM:
            factor = getattr(op, "factor", None)
            if not isinstance(factor, (int, float)) or factor == 0:
                raise CollschedError(
                    "collsched: PREMUL_SUM with a tensor factor is not supported; give a number "
                    "(dist._make_nccl_premul_sum(0.5))"
                )
            return ("sum", 1.0 / float(factor))
        return None

    @profiling.recorded("all_reduce", profiling.first)
    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        return self._all_reduce(tensors, opts.reduceOp)

    @profiling.recorded("all_reduce", profiling.first)
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        return self._all_reduce(tensors, opts.reduceOp)

    def _all_reduce(self, tensors: list[torch.Tensor], op: Any) -> _Work:
        if any(t.is_sparse for t in tensors):
            return _done([self._sparse_sum(t, op) for t in tensors])
        dtypes = {t.dtype for t in tensors}
        kernel = self._kernel_op(op, tensors[0].dtype) if len(dtypes) == 1 else None
        if kernel is None:

            def reduce(stacks: list[torch.Tensor]) -> None:
                for t, stacked in zip(tensors, stacks):
                    t.copy_(_local_reduce(stacked, op, self._n))

            return self._gathered_then([t.clone() for t in tensors], tensors, reduce)
        after: list[Callable[[], None]] = []
        bufs = [_contiguous_out(t, after) for t in tensors]
        for b, t in zip(bufs, tensors):
            if b is not t:
                b.copy_(t)
        elem, (op_name, pre) = _KERNEL_TYPES[tensors[0].dtype], kernel
        native = self._comm.all_reduce([_span(b) for b in bufs], elem, op_name, bufs, pre)
        return _Work(native, tensors, keep=bufs, after=after)

    @profiling.recorded("reduce_scatter_tensor", profiling.second)
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Work:
        return self._reduce_scatter([output], [input], opts.reduceOp)

    _reduce_scatter_base = reduce_scatter_single

    @profiling.recorded("reduce_scatter_tensor_coalesced", profiling.second)
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any):
        return self._reduce_scatter(outputs, inputs, opts.reduceOp)

    @profiling.recorded("reduce_scatter", profiling.nested_second)
    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> _Work:
        flat = []
        for out, parts in zip(outputs, inputs):
            self._same_sizes("reduce_scatter", out, parts)
            flat.append(torch.cat([p.reshape(-1) for p in parts]))
        return self._reduce_scatter(outputs, flat, opts.reduceOp)

    def _reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: Any) -> _Work:
        dtypes = {t.dtype for t in [*outputs, *inputs]}
        kernel = self._kernel_op(op, outputs[0].dtype) if len(dtypes) == 1 else None
        if kernel is None:
            me, n = self._comm.group_rank, self._n

            def reduce(stacks: list[torch.Tensor]) -> None:
                for out, stacked in zip(outputs, stacks):
                    out.copy_(_local_reduce(stacked.view(n, n, -1)[:, me], op, n).view_as(out))

            return self._gathered_then([inp.reshape(-1).clone() for inp in inputs], outputs, reduce)
        after: list[Callable[[], None]] = []
        outs = [_contiguous_out(o, after) for o in outputs]
        ins = [i.contiguous() for i in inputs]
        elem = _KERNEL_TYPES[outputs[0].dtype]
        spans = ([_span(o) for o in outs], [_span(i) for i in ins])
        native = self._comm.reduce_scatter(*spans, elem, kernel[0], [*outs, *ins], kernel[1])
        return _Work(native, outputs, keep=[*outs, *ins], after=after)

    # -- data movement ----------------------------------------------------------------------

    @profiling.recorded("all_gather_into_tensor", profiling.second)
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Work:
        return self._all_gather([output], [input])

    _allgather_base = all_gather_single

    @profiling.recorded("all_gather_into_tensor_coalesced", profiling.second)
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any):
        return self._all_gather(outputs, inputs)

    @profiling.recorded("all_gather", profiling.second)
    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:
        flats, after = [], []
        for outs, inp in zip(outputs, inputs):
            self._same_sizes("all_gather", inp, outs)
            flat = torch.empty((self._n, *inp.shape), dtype=inp.dtype)
            flats.append(flat)
            after.append(functools.partial(_unstack, flat, outs))
        work = self._all_gather(flats, inputs)
        work._after = [*work._after, *after]
        work._result = [t for outs in outputs for t in outs]
        return work

    @profiling.recorded("all_gather", profiling.second)
    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:
        """``all_gather_coalesced``: ``outputs[r][j]`` gets member ``r``'s ``inputs[j]``."""
        if len(outputs) != self._n or any(len(row) != len(inputs) for row in outputs):
            raise CollschedError(
                f"collsched: all_gather_coalesced needs {self._n} output lists of {len(inputs)} tensors each, got "
                f"{[len(row) for row in outputs]}"
            )
        return self.allgather([[row[j] for row in outputs] for j in range(len(inputs))], inputs, opts)

    def _all_gather(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> _Work:
        after: list[Callable[[], None]] = []
        outs = [_contiguous_out(o, after) for o in outputs]
        ins = [i.contiguous() for i in inputs]
        for o, i in zip(outs, ins):
            if o.dtype != i.dtype:
                raise CollschedError(f"collsched: all_gather from {i.dtype} into {o.dtype}; give one dtype")
        native = self._comm.all_gather([_span(o) for o in outs], [_span(i) for i in ins], [*outs, *ins])
        return _Work(native, outputs, keep=[*outs, *ins], after=after)

    def _sparse_sum(self, t: torch.Tensor, op: Any) -> torch.Tensor:
        """All-reduce of a sparse COO tensor, as gloo's: the sum of every member's, coalesced,
        written into ``t``. Members' entry counts differ: each member's indices and values are
        gathered padded to the largest count."""
        if op != _R.SUM or not t.is_sparse:
            raise CollschedError(
                f"all_reduce: a sparse tensor ({t.layout}, {t.dtype}) is reduced by SUM alone, and every "
                "tensor of the call must be sparse then (gloo's rule too); densify it for other ops"
            )
        c = t.coalesce()
        idx, val = c.indices(), c.values()
        counts = self._gathered(torch.tensor([idx.shape[1]], dtype=torch.int64)).view(-1).tolist()
        most = max(counts)
        pad_idx = torch.zeros((idx.shape[0], most), dtype=idx.dtype)
        pad_idx[:, : idx.shape[1]] = idx
        pad_val = torch.zeros((most, *val.shape[1:]), dtype=val.dtype)
        pad_val[: val.shape[0]] = val
        all_idx, all_val = self._gathered(pad_idx), self._gathered(pad_val)
        cat_idx = torch.cat([all_idx[q, :, :k] for q, k in enumerate(counts)], dim=1)
        cat_val = torch.cat([all_val[q, :k] for q, k in enumerate(counts)])
        total = torch.sparse_coo_tensor(cat_idx, cat_val, t.shape).coalesce()
        t.copy_(total)
        return t

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t`` stacked along a new first dimension (waited for)."""
        stacked = torch.empty((self._n, *t.shape), dtype=t.dtype)
        self._all_gather([stacked], [t]).wait()
        return stacked

    def _gathered_then(
        self, inputs: list[torch.Tensor], result: list[torch.Tensor], finish: Callable[[list[torch.Tensor]], None]
    ) -> _Work:
        """Every member's ``inputs`` gathered, each stacked along a new first dimension, by one
        launch that is not waited for here; ``finish(stacks)`` fills the outputs from them once
        the work is waited for. An ``async_op`` call of an op built on it (a local reduction)
        so returns at once, as gloo's does: a rank may send, or launch more, before it waits."""
        stacks = [torch.empty((self._n, *t.shape), dtype=t.dtype) for t in inputs]
        work = self._all_gather(stacks, inputs)
        return _Work(work._native, result, keep=[work._keep, inputs], after=[*work._after, lambda: finish(stacks)])

    @profiling.recorded("broadcast", profiling.first)
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        root = self._ranks[opts.rootRank]
        after: list[Callable[[], None]] = []
        bufs = [_contiguous_out(t, after) for t in tensors]
        for b, t in zip(bufs, tensors):
            if b is not t:
                b.copy_(t)
        native = self._comm.broadcast([_span(b) for b in bufs], root, bufs)
        return _Work(native, tensors, keep=bufs, after=after)

    @profiling.recorded("barrier", profiling.none)
    def barrier(self, opts: Any = None) -> _Work:
        return _Work(self._comm.barrier(), [])

    def monitored_barrier(self, opts: Any, wait_all_ranks: bool) -> None:
        """``dist.monitored_barrier``: every member checks in through the group's store; the
        group's rank 0 waits for each within the timeout and names those that did not come
        (the first, or with ``wait_all_ranks`` all of them), in gloo's words; the others wait
        for rank 0's release."""
        given = getattr(opts, "timeout", None)
        if given is not None and hasattr(given, "total_seconds") and given.total_seconds() == 0:
            # No time at all to wait in (negative is unset).
            raise RuntimeError(f"Rank {self._me} timed out in monitoredBarrier after 0 ms")
        seconds = _seconds(given) or 1800.0
        ms = int(seconds * 1000)
        key = f"collsched/monitored_barrier/{self._monitored}"
        self._monitored += 1
        self._store.set(f"{key}/{self._me}", b"1")
        if self._me != 0:
            try:
                self._store.wait([f"{key}/released"], datetime.timedelta(seconds=seconds))
            except Exception:
                raise RuntimeError(
                    f"Rank {self._me} successfully reached monitoredBarrier, but received errors while waiting for "
                    "send/recv from rank 0. Please check rank 0 logs for faulty rank."
                ) from None
            return
        deadline = time.monotonic() + seconds
        missing = []
        for r in range(1, self._n):
            try:
                left = max(deadline - time.monotonic(), 0.001)
                self._store.wait([f"{key}/{r}"], datetime.timedelta(seconds=left))
            except Exception:
                missing.append(r)
                if not wait_all_ranks:
                    break
        if not missing:
            self._store.set(f"{key}/released", b"1")
            return
        if wait_all_ranks:
            raise RuntimeError(f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms")
        raise RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms")

    # -- built on the above -----------------------------------------------------------------

    @profiling.recorded("reduce", profiling.first)
    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        """An all-reduce whose result only the root keeps."""
        me = self._comm.group_rank
        copies = tensors if me == opts.rootRank else [t.clone() for t in tensors]
        work = self._all_reduce(copies, opts.reduceOp)
        work._result = tensors
        return work

    @profiling.recorded("gather", profiling.second)
    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> _Work:
        """An all-gather whose result only the root keeps."""
        if self._comm.group_rank == opts.rootRank:
            return self.allgather(outputs, inputs, opts)
        flat = torch.empty((self._n, *inputs[0].shape), dtype=inputs[0].dtype)
        work = self._all_gather([flat], [inputs[0]])
        work._result = []
        return work

    @profiling.recorded("scatter", profiling.first)
    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> _Work:
        """The root's list broadcast; each member keeps its part."""
        out = outputs[0]
        if self._comm.group_rank == opts.rootRank:
            self._same_sizes("scatter", out, inputs[0])
            flat = torch.stack([t.contiguous() for t in inputs[0]])
        else:
            flat = torch.empty((self._n, *out.shape), dtype=out.dtype)
        me = self._comm.group_rank
        work = _Work(self._comm.broadcast([_span(flat)], self._ranks[opts.rootRank], [flat]), outputs, keep=[flat])
        work._after = [lambda: out.copy_(flat[me])]
        return work

    @profiling.recorded("all_to_all", profiling.second)
    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list, input_split_sizes: list, opts: Any
    ) -> _Work:
        """Rows along the first dimension, ``input_split_sizes[q]`` of them to member ``q`` and
        ``output_split_sizes[q]`` from it (equal splits when not given): every member's input
        gathered (padded to the longest; with split sizes, after one small gather of every
        member's splits, waited for), each member keeping the rows sent to it."""
        n, me = self._n, self._comm.group_rank
        rows, got = (input.shape[0] if input.dim() else 1), (output.shape[0] if output.dim() else 1)
        if input.dtype != output.dtype:
            raise CollschedError(
                f"all_to_all_single: a {input.dtype} input into a {output.dtype} output; give one dtype"
            )
        sends = [int(k) for k in input_split_sizes] or ([rows // n] * n if rows % n == 0 else [])
        takes = [int(k) for k in output_split_sizes] or ([got // n] * n if got % n == 0 else [])
        if len(sends) != n or len(takes) != n or sum(sends) != rows or sum(takes) != got or min(sends + takes) < 0:
            raise CollschedError(
                f"all_to_all_single: {rows} input rows split {list(input_split_sizes) or 'evenly'} and {got} output "
                f"rows split {list(output_split_sizes) or 'evenly'} over {n} members: give {n} sizes adding up to "
                "each tensor's first dimension (or none, for a first dimension the group's size divides)"
            )
        if input_split_sizes or output_split_sizes:
            # Every member's sizes, both ways, so that every member finds a disagreement alike.
            both = self._gathered(torch.tensor(sends + takes, dtype=torch.int64)).tolist()
            splits = [row[:n] for row in both]
            wrong = [(q, r) for q in range(n) for r in range(n) if splits[q][r] != both[r][n + q]]
        else:
            splits, wrong = [sends] * n, []
        if wrong:
            q, r = wrong[0]
            raise CollschedError(
                f"all_to_all_single: member {q} sends {splits[q][r]} rows to member {r}, whose output_split_sizes "
                f"takes {both[r][n + q]} from it: the sizes of the members disagree"
            )
        flat = input.reshape(rows, math.prod(input.shape[1:]))
        most = max(sum(row) for row in splits)
        if most == 0:
            return _done([output])  # no member sends a row
        padded = torch.zeros((most, flat.shape[1]), dtype=input.dtype)
        padded[:rows] = flat

        def keep_mine(stacks: list[torch.Tensor]) -> None:
            parts = [stacks[0][q, sum(splits[q][:me]) : sum(splits[q][: me + 1])] for q in range(n)]
            output.copy_(torch.cat(parts).view_as(output))

        return self._gathered_then([padded], [output], keep_mine)

    # -- point to point (p2p.py) -------------------------------------------------------------

    @profiling.recorded("send", profiling.first)
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        for t in tensors:
            self._mailbox.send(t, dst, tag)
        return _done(tensors)

    @profiling.recorded("recv", profiling.first)
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        reads, ready = zip(*(self._mailbox.recv(t, src, tag) for t in tensors))
        what = self._mailbox.where("recv", src, tag)
        return _Work(None, tensors, after=reads, ready=lambda: all(r() for r in ready), what=what)

    @profiling.recorded("recvAnySource", profiling.first)
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> _Work:
        if len(tensors) != 1:
            raise CollschedError(f"collsched: recv from any source of {len(tensors)} tensors; give one")
        read, ready = self._mailbox.recv_any(tensors[0], tag)
        work = _Work(None, tensors, ready=ready, what=self._mailbox.where("recv from any source", None, tag))

        def receive() -> None:
            work._source = read()
            note_source(tensors[0], work._source)

        work._after = [receive]
        return work

    def _same_sizes(self, what: str, one: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        if len(parts) != self._n or any(p.numel() != one.numel() or p.dtype != one.dtype for p in parts):
            shapes = [(tuple(p.shape), p.dtype) for p in parts]
            raise CollschedError(
                f"collsched: {what} over {self._n} ranks with {len(parts)} tensors {shapes} for "
                f"{tuple(one.shape)} {one.dtype}; give {self._n} tensors of its size and dtype"
            )


def _unstack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
    for q, o in enumerate(outs):
        o.copy_(flat[q].view_as(o))


def creator(name: str = NAME) -> Callable[..., _Backend]:
    """torch.distributed's constructor of a group's backend (``extended_api``), for the backend
    registered as ``name`` (profiler events carry it: ``"gloo"`` where collsched stands in for
    gloo)."""
    return functools.partial(_create, name=name)


def _create(opts: Any, backend_options: Any = None, *, name: str = NAME) -> _Backend:
    """torch.distributed's constructor of a ``"collsched"`` group's backend (``extended_api``)."""
    ranks = list(opts.global_ranks_in_group)
    timeout = _seconds(opts.timeout)
    if not ranks:
        # The default group: its ranks are the job's, and it makes (or reuses) the job's world,
        # whose members wait the group's timeout for each other (as gloo's do).
        world = _world.adopt(opts.store, opts.group_rank, opts.group_size, timeout)
        ranks = list(range(opts.group_size))
    else:
        world = _world._WORLD
        if world is None:
            raise CollschedError(
                "new_group(backend='collsched'): the job has no collsched world yet; initialize the default group "
                "with init_process_group('collsched'), or call collsched.torch.init() on every rank first"
            )
    if ranks != sorted(ranks):
        # (torch's group rank is the position in this order; the library's groups are ascending.)
        raise CollschedError(
            f"new_group(ranks={ranks}, sort_ranks=False): the 'collsched' backend runs groups whose ranks are in "
            "ascending order (a group rank is then the rank's position among them); give the ranks sorted"
        )
    tag = zlib.crc32(str(opts.group_id).encode())
    comm = _native.Comm(world, ranks, tag, timeout)
    backend = _Backend(comm, opts.group_rank, opts.group_size, opts.store, name, timeout)
    # torch holds the backend in C++ only: without a Python reference its Python half (the
    # methods overriding the C++ ones) would be collected, and a later call from C++ would
    # reach the base class ("getBackendName is not implemented") or freed memory.
    _LIVE.append(backend)
    return backend


# Every backend made in this process (see _create).
_LIVE: list[_Backend] = []


def _unwrapped_in_detail_mode() -> None:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` torch wraps each group's backend in a checker
    that asks the backend's sequence number, which torch's trampoline of a Python backend does
    not forward (every collective would fail with "does not yet support sequence numbers").
    This backend is left unwrapped: its collectives check agreement themselves (a mismatch is
    an error on every rank, with the flight recorder's dump). Idempotent."""
    c10d = dist.distributed_c10d
    wrap = c10d._create_process_group_wrapper
    if getattr(wrap, "_collsched", False):
        return

    def wrapper(wrapped_pg: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(wrapped_pg, _Backend):
            return wrapped_pg
        return wrap(wrapped_pg, *args, **kwargs)

    wrapper._collsched = True  # type: ignore[attr-defined]
    c10d._create_process_group_wrapper = wrapper


def register() -> None:
    """Registers ``"collsched"`` with torch.distributed (CPU tensors). Idempotent; importing
    ``collsched.torch`` does it."""
    holder.install()
    _unwrapped_in_detail_mode()
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
