"""The compute track of a rank's flight record, and the simulator's workload of a sharded model.

Each unit's forward and backward compute is timed on the host between this package's hooks
(their fetches, releases and hand-overs left out): spans ``"forward U"`` and ``"backward U"``,
``U`` the unit's index (0 the root), each with its training pass (0-based: a forward and its
backward; each micro-batch under ``no_sync`` is one). A unit whose forward runs others' (the
root around its blocks) has one span per piece between them; a forward recomputed by
activation checkpointing counts in its unit's backward; a pass given up (a forward or a
backward that raised) leaves no span. The step's compute outside the units has two spans:
``"loss"``, from the end of a training forward to its backward's first hook (the loss), and
``"update"``, from the end of a synchronized backward's step (the reduced gradients delivered;
not after a ``no_sync`` micro-batch) to the next pass's first hook or the next call that
gathers the whole model (the optimizer step, ``zero_grad``, the loop's own work), each with
the pass it follows. Recorded on host
backends, where the host's time is the compute's (on ``cuda`` the host only queues kernels:
nothing is recorded), the last ``COLLSCHED_FLIGHT_ENTRIES`` (default 2000) spans;
:func:`flight_record` puts them on the record's compute track, beside the collectives
(``collsched flight DIR --trace-out``). A record
the library writes by itself on a failure (``COLLSCHED_FLIGHT_RECORDER``) holds none.

:func:`workload_record` writes what ``collsched sim --workload`` reads: the sharded parameters,
one layer per unit with the compute its spans measured (the median pass), the step's loss and
update, at 1 TFLOP/s (run the simulator with ``--tflops 1``: compute is its input, the
collectives and waits its prediction), and the engine's host time per unit.
"""

from __future__ import annotations

import json
import statistics
import time
import weakref
from collections import deque
from typing import Any

from .. import _native
from .world import CollschedError

_ALL: weakref.WeakSet = weakref.WeakSet()
# The rate the workload's FLOPs are counted at: measured seconds times this (``--tflops 1``).
FLOPS_PER_SECOND = 1e12
_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


class Spans:
    """One sharded model's compute spans on this rank: the units whose compute runs (innermost
    last), the span in progress (``open``: its start, 0 for none) and the step's compute outside
    the units in progress (``gap``: its name, pass and start, or None)."""

    __slots__ = ("on", "spans", "stack", "open", "step", "begun", "gap", "__weakref__")

    def __init__(self, on: bool) -> None:
        self.on = on
        # As many as the native record keeps collectives (``COLLSCHED_FLIGHT_ENTRIES``).
        self.spans: deque[tuple[str, int, int, int]] = deque(maxlen=_native.flight_entries())
        self.stack: list[tuple[str, int]] = []
        self.open = 0
        self.step = 0
        # When the training pass in progress began (:meth:`mark`).
        self.begun = 0
        self.gap: tuple[str, int, int] | None = None
        if on:
            _ALL.add(self)

    def pause(self) -> None:
        """A hook's own work begins: the span in progress ends, and the loss or update."""
        if self.open:
            kind, index = self.stack[-1]
            self.spans.append((f"{kind} {index}", self.step, self.open, time.time_ns()))
            self.open = 0
        if self.gap is not None:
            if self.gap[2]:
                self.spans.append((*self.gap, time.time_ns()))
            self.gap = None

    def begin(self, kind: str, index: int) -> None:
        """Unit ``index``'s ``kind`` (forward, backward) compute begins now (a unit begun
        again, as a recomputed forward's unit is at its own pre-backward, is not stacked twice)."""
        if self.on:
            self.end(index)
            self.stack.append((kind, index))
            self.open = time.time_ns()

    def end(self, index: int) -> None:
        """Unit ``index``'s compute is over (the one around it goes on at :meth:`resume`)."""
        if self.on:
            self.pause()
            for i in range(len(self.stack) - 1, -1, -1):
                if self.stack[i][1] == index:
                    kind, _ = self.stack.pop(i)
                    if kind == "forward" and not self.stack:
                        # The training forward is over: the loss runs from the end of this
                        # hook (:meth:`resume`) to the next.
                        self.gap = ("loss", self.step, 0)
                    break

    def resume(self) -> None:
        """A hook's own work is over: the innermost unit's compute goes on, or the loss begins."""
        if self.on and self.stack and not self.open:
            self.open = time.time_ns()
        elif self.gap is not None and not self.gap[2]:
            self.gap = (*self.gap[:2], time.time_ns())

    def mark(self) -> None:
        """A training pass begins: what :meth:`drop_pass` drops."""
        if self.on:
            self.begun = time.time_ns()

    def drop_pass(self) -> None:
        """The pass begun at :meth:`mark` raised in its forward: its spans are dropped (its step
        goes on with the next forward)."""
        if self.on:
            self._drop(self.begun)

    def next_step(self, keep: bool = True) -> None:
        """The pass ended: what was open closes; or (``keep`` False) it was given up (a backward
        that raised): its spans are dropped."""
        if self.on:
            if keep:
                self.pause()
            self._drop(1 << 63 if keep else 0)
            self.step += 1

    def idle(self, synchronized: bool) -> None:
        """The library's step that :meth:`next_step` kept is over: after a synchronized one
        (its gradients delivered), the update runs until the next hook; after one under
        ``no_sync`` (a micro-batch of several), nothing is open until the next pass."""
        if self.on and synchronized and self.spans and self.spans[-1][1] == self.step - 1:
            self.gap = ("update", self.step - 1, time.time_ns())

    def _drop(self, since: int) -> None:
        """Nothing is open any more; this step's spans begun at ``since`` or later are dropped."""
        self.open = 0
        self.gap = None
        self.stack.clear()
        while self.spans and self.spans[-1][1] == self.step and self.spans[-1][2] >= since:
            self.spans.pop()


def per_unit(stats: dict[str, Any], host_s: float, native_s: float, units: int) -> None:
    """Adds a step's host times per unit forward to its ``stats``: ``host_us_per_unit`` (the
    package's hooks, ``host_s``), ``native_us_per_unit`` (their calls into the library, the
    step's end included, ``native_s``) and ``calls_us_per_unit`` (those less the waits for
    collectives, ``stats["wait_ms"]``)."""
    per = 1e6 / max(units, 1)
    stats["host_us_per_unit"] = host_s * per
    stats["native_us_per_unit"] = native_s * per
    stats["calls_us_per_unit"] = max(native_s - stats["wait_ms"] / 1e3, 0.0) * per


def recorded() -> list[tuple[str, int, int, int]]:
    """Every live sharded model's spans on this rank, by start."""
    return sorted((s for sp in list(_ALL) for s in sp.spans), key=lambda s: s[2])


def workload_record(module: Any, path: Any = None) -> dict[str, Any]:
    """The workload ``collsched sim --workload`` reads, of ``module``'s sharded model (its root,
    or any module of it) as the job ran it: each sharded parameter (the shape collsched shards:
    a tensor-parallel one's local tensor; the dtype it is gathered in; its unit as its
    ``"module"``), one layer per unit (``unit U``, its parameters) with the forward and backward
    compute of its spans at 1 TFLOP/s, the step's compute outside the units (the loss and the
    update; the last pass's update runs on until the next pass, and is not counted), the
    engine's host time per unit of the last step (``hook_s``: the hooks' own and their calls into
    the library, waits for collectives left out: ``stats``' ``host_us_per_unit`` plus
    ``calls_us_per_unit``), and the orders the units ran in this rank's last pass. Each time is
    a rank's median over its recorded passes (the first left out where there are others), the
    largest over the ranks, each span apart: the simulator runs every rank alike, and the real
    ranks wait for the slowest at each collective (the sum may exceed every rank's own). The
    simulator runs one update a pass: under gradient accumulation it counts the update once
    per micro-batch. Collective: every rank calls it,
    and gets the same workload; with ``path``, also written there (give it on one rank).
    Simulate it with ``collsched sim --workload PATH --world N --tflops 1 --bucket-by module
    --bucket-mb B ...`` (``B`` the model's ``bucket_mb``: the simulated buckets are then the
    library's, ids included); with ``--against`` a trace of this run's flight record, the compute
    is paired by unit and the collectives by bucket.
    Raises on the cuda backend (no spans) and before a training pass on any rank."""
    from .module import _root_state

    st = _root_state(module)
    if not st.spans.on:
        raise CollschedError(
            "workload_record: the cuda backend records no compute spans (the host only queues kernels); "
            "record the workload of a run on a host backend (local, shm, mpi)"
        )
    last = st.spans.step - 1
    mine = [s for s in st.spans.spans if s[1] == last] if last >= 0 else []
    first: dict[str, int] = {}
    for name, _step, start, _end in mine:
        first.setdefault(name, start)
    # Each span's seconds a pass (a unit's pieces summed), by name.
    per: dict[str, dict[int, float]] = {}
    for name, step, start, end in st.spans.spans:
        at = per.setdefault(name, {})
        at[step] = at.get(step, 0.0) + (end - start) / 1e9
    # The median over the recorded passes, the first (first-call costs) left out where there
    # are others; and the hooks' time (a key no span has).
    typical = {n: statistics.median([v for k, v in at.items() if k > 0] or at.values()) for n, at in per.items()}
    if mine:
        # The engine's own host time: its hooks' and their calls into the library, less the
        # waits for collectives (the simulator's own).
        typical["hooks"] = (st.last.get("host_us_per_unit", 0.0) + st.last.get("calls_us_per_unit", 0.0)) * 1e-6
    every = [json.loads(b) for b in st.world.all_gather(json.dumps(typical if mine else {}).encode())]
    if not all(every):
        idle = [r for r, t in enumerate(every) if not t]
        raise CollschedError(
            f"workload_record: no training pass recorded yet on rank(s) {idle} (or COLLSCHED_FLIGHT_ENTRIES=0); "
            "run a forward and backward first"
        )

    def seconds(name: str) -> float:
        return max(t.get(name, 0.0) for t in every)

    # A parameter of no element (a tensor-parallel piece of an uneven cut) is not gathered; a
    # scalar is one element.
    kept = [p for p in st.params if p.numel > 0]
    params = [
        {
            "name": p.name,
            "shape": list(p.shape) or [1],
            "dtype": _DTYPES[str(p.dtype).removeprefix("torch.")],
            "trainable": bool(st.mask[p.pid]),
            # Its unit: buckets end between units (``--bucket-by module``), as collsched's do.
            "module": f"unit {p.unit}",
        }
        for p in kept
    ]
    # Every unit a layer, the k-th unit the k-th layer: the simulator's layer index is the
    # spans' unit index.
    units = st.units
    layers = [
        {
            "name": f"unit {u.index}",
            "params": [p.name for p in u.params if p.numel > 0],
            "forward_flops": seconds(f"forward {u.index}") * FLOPS_PER_SECOND,
            "backward_flops": seconds(f"backward {u.index}") * FLOPS_PER_SECOND,
            "recompute_flops": 0.0,
            # Kept fetched from its forward into its backward (the root, by default).
            "keep": not u.reshard and not u.post,
        }
        for u in units
    ]

    def order(kind: str) -> list[str]:
        ran = sorted(units, key=lambda u: (first.get(f"{kind} {u.index}", 1 << 63), u.index))
        return [f"unit {u.index}" for u in ran]

    out = {
        "format": "collsched-workload",
        "version": 1,
        "name": type(st.root).__name__,
        "params": params,
        "layers": layers,
        "forward_order": order("forward"),
        "backward_order": order("backward"),
        "loss_flops": seconds("loss") * FLOPS_PER_SECOND,
        "update_flops": seconds("update") * FLOPS_PER_SECOND,
        "hook_s": seconds("hooks"),
        # Buckets cut in the parameters' order, as the library cut them: the same ids.
        "bucket_order": "params",
    }
    if path is not None:
        with open(path, "w") as f:
            json.dump(out, f)
    return out
