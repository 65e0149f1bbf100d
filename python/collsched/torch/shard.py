"""A sharded model per root (``_State``, what ``fully_shard`` in ``module.py`` builds): its
plan and engines, and the hooks that fetch, release and reduce around forward and backward.
How a pass runs is told in the package's docstring."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from .._native import CollschedError
from . import post_forward as post_
from . import spans as spans_
from . import values as values_
from .build import build as _build
from .units import _Frame, _needing_grad, _Param, _PostBackward, _recomputing, _Unit
from .world import _FROM_TORCH, world_of

# Views kept per parameter, by address of the gathered buffer (the least recently used goes
# first). A pool hands a bucket any of its size class's free buffers, as many as are live or
# waiting for their events at once (on a GPU, more while the device runs behind the host); a
# view costs a DLPack export and import, and the saved-tensor hooks' spans are set again.
_VIEWS_KEPT = 16
# Containers whose tensors a unit's post-backward looks into (``_pytree`` flattens them).
_NESTS = (list, tuple, dict)
_clock = time.perf_counter


class _State:
    """One root's sharded model on this rank: the library's model and two engines on it
    (training, evaluation), the parameters and units, and the pass in progress."""

    @property
    def world(self) -> Any:
        """The world the model is sharded over (looked up: see ``world.world_of``)."""
        return world_of(self.part)

    def __init__(self, root: nn.Module, opts: dict[str, Any]) -> None:
        self.root = root
        self.opts = opts
        # The part of the job the model is sharded over (its ranks; None: the whole job).
        self.part: tuple[int, ...] | None = opts["part"]
        # The ranks a parameter is sharded over: ``G`` of strategy ``hybrid:G`` (the world then
        # holds ``world / G`` replica groups), else the world's size (a malformed ``G`` too: the
        # library's model refuses it by name at the build).
        kind, _, group = str(opts["strategy"]).partition(":")
        self.shard_group = int(group) if kind == "hybrid" and group.isdigit() else self.world.world
        self.units: list[_Unit] = []
        self.params: list[_Param] = []
        # The saved-tensor hooks (native): the fetched units' parameter spans by address; the
        # pack and unpack hooks a pass pushes (the native ones, or tp.py's around them).
        self.hooks: Any = None
        self.pack: Any = None
        self.unpack: Any = None
        # The spec of the first tensor-parallel parameter (``tp.py``), or None.
        self.tp_spec: Any = None
        # The parameters of which this rank holds no element.
        self.empty: list[_Param] = []
        self.sync = self.grad_sync = self.all_reduce = True
        self.no_sync_depth = 0
        self.unsynced = False
        self.phase = "idle"
        self.engine: Any = None
        self.mask: list[bool] = []
        self.model: Any = None
        self.train: Any = None
        self.eval: Any = None
        self.last: dict[str, Any] = {}
        # Library steps this model ended, and of them those that reduced (``stats``).
        self.steps = self.reduced_steps = 0
        self.host_s = self.native_s = 0.0
        self.host_units = 0
        # Views of gathered buffers made this step (``_fetch``; ``stats``' ``views_made``).
        self.views_made = 0
        self._queued = False
        self.got: set[int] = set()
        # Where the shards, the full parameters and their gradients live: the CPU, or the
        # CUDA device of a world on the cuda backend. On a device backend (cuda, or the
        # emulated one on the CPU) gradients go to the library in the reduction dtype, and
        # under no_sync they accumulate in ``accum`` (a .grad is always its backward's own).
        self.device = torch.device("cpu")
        self.on_device = False
        self.withheld = False
        # Device gradients accumulated under no_sync, in the reduction dtype (as FSDP2 does), by
        # parameter id.
        self.accum: dict[int, torch.Tensor] = {}
        self.gather_buckets: dict[int, tuple[list[str], int]] = {}
        self.unit_buckets: list[list[int]] = []
        self.divide: list[tuple[int, float]] = []
        self.fwd_rules: dict[int, list[int]] = {}
        self.bwd_rules: dict[int, list[int]] = {}
        # Mixed precision's and CPU offload's parameters: the module's shards (f32, or in host
        # memory) apart from the library's.
        self.masters: list[_Param] = []
        # Under CPU offload: each dtype's masters as views of one host tensor (values.pack_offloaded).
        self.offloaded: list[tuple[torch.Tensor, list[_Param], list[int]]] = []
        # A training pass's upload of them, which the step's end waits for (values.end_copies).
        self.pushed: Any = None
        # Built without values (on the meta device), none loaded since: a root's build over
        # it gathers nothing.
        self.meta = False
        # In ``to_empty``: emptied copies of the shards are put back without a word.
        self.emptying = False
        # ``set_manual_backward_finalization``'s flag (finalize.py).
        self.manual = False
        # One per unit forward running (pre-hook to hook), innermost last.
        self.frames: list[_Frame] = []
        # The post-forward layouts of units resharded to some of the ranks, by size (post_forward.py).
        self.post: dict[int, Any] = {}

    @property
    def queued(self) -> bool:
        """Whether this step's backward has begun (its end is queued on autograd's engine)."""
        return self._queued

    @queued.setter
    def queued(self, on: bool) -> None:
        # The native unpack hook views parameters without Python only once the backward began.
        self._queued = on
        if self.hooks is not None:
            self.hooks.backward = on

    # ---- building ----------------------------------------------------------------------

    def build(self) -> None:
        _build(self)

    def _own_grads(self) -> None:
        for u in self.units:
            u.grads = [p for p in u.params if p.unit == u.index and self.mask[p.pid]]

    def _unit_buckets(self) -> list[list[int]]:
        """Each unit's gather buckets (ids): those of every parameter it fetches (a tied
        parameter's bucket is fetched by every unit that uses it)."""
        buckets_of: dict[str, list[int]] = {}
        for bid, (names, _) in self.gather_buckets.items():
            for n in names:
                buckets_of.setdefault(n, []).append(bid)
        out = []
        for unit in self.units:
            ids: dict[int, None] = {}
            for p in unit.params:
                ids.update(dict.fromkeys(buckets_of.get(p.name, [])))
            out.append(list(ids))
        return out

    def apply_explicit(self) -> None:
        """Explicit prefetch rules from the units' lists (``set_modules_to_forward_prefetch``,
        ``set_modules_to_backward_prefetch``); a unit without a list prefetches the next unit
        in the forward (the first block after the root's own parameters) and the previous one
        in the backward (but for units resharded to some ranks after their forward, whose
        backward gathers on their post-forward layout, without prefetch). Between steps."""
        n = len(self.units)
        fwd: dict[int, list[int]] = {u: [u + 1] for u in range(n - 1)}
        bwd: dict[int, list[int]] = {u: [u - 1] for u in range(2, n)}
        if n > 1:
            bwd[0] = [n - 1]
        fwd.update(self.fwd_rules)
        bwd.update(self.bwd_rules)

        def rules(table: dict[int, list[int]], backward: bool = False) -> list[tuple[int, list[int]]]:
            out = []
            for u, then in table.items():
                elsewhere = [v for v in then if backward and post_.has_layout(self.units[v])]
                targets = [b for v in then if v not in elsewhere for b in self.unit_buckets[v]]
                out.extend((b, targets) for b in self.unit_buckets[u])
            return out

        self.train.set_explicit(rules(fwd), rules(bwd, backward=True))
        self.eval.set_explicit(rules(fwd), [])

    def retrace(self, what: str) -> None:
        """A new training engine (between synchronized steps): the units' fetch order changed."""
        if self.phase != "idle" or self.unsynced or self.engine is not None:
            raise CollschedError(f"{what}: call it between synchronized steps (after a backward without no_sync)")
        train = self.model.engine(*self.engine_args, divide=self.divide)
        train.refresh_trainable(self.mask)
        self.train = train
        if self.opts["prefetch"] == "explicit":
            self.apply_explicit()

    def unshard(self, unit: _Unit) -> None:
        """``module.unshard()``: between steps, ``unit`` fetched for reading (on the evaluation
        engine), its full parameters in its modules, until :meth:`reshard`."""
        if self.engine is not None or self.phase != "idle" or unit.fetched is not None:
            return
        if self.masters:
            # The optimizer's (or a load's) latest values, as a pass's start takes them.
            values_.push_masters(self)
        unit.manual = True
        try:
            self._fetch(unit, self.eval, swap=True)
        except BaseException:
            unit.manual = False
            self._release(unit)
            raise

    def reshard(self, unit: _Unit) -> None:
        """``module.reshard()``: releases what :meth:`unshard` fetched, or what the last
        backward held (``reshard_after_backward`` False)."""
        if unit.held and self.phase == "idle":
            self._release(unit)
            return
        if not unit.manual:
            return
        unit.manual = False
        self._release(unit)
        if not any(u.manual for u in self.units):
            self.eval.end_step()

    def reshard_all(self) -> None:
        """Releases every unit :meth:`unshard` fetched (a pass, or a gather of everything, starts)."""
        self.spans.pause()
        for u in self.units:
            if u.manual:
                self.reshard(u)

    def unit_index(self, module: nn.Module) -> int:
        for i, u in enumerate(self.units):
            if any(m is module for m in u.members):
                return i
        raise CollschedError(f"{type(module).__name__} is not a unit of this sharded model: give it to fully_shard")

    def _one_unit_ahead(self) -> tuple[int, int]:
        """The default prefetch budget: one unit ahead, as FSDP2 prefetches one module: the
        largest unit's bytes (the first bucket ahead counts against them, as the scheduler
        counts it) and its buckets plus one."""
        # What a bucket held takes, as the budgets count it (the gathered buffer and, for split
        # parameters, the unpacked copy; the unpacked copy alone where the gather places them).
        memory = dict(self.model.gather_memory)
        per_unit = [[memory[b] for b in bs] for bs in self.unit_buckets if bs]
        if not per_unit:
            return 0, 1
        largest = max(per_unit, key=sum)
        return sum(largest), max(len(v) for v in per_unit) + 1

    def retire(self) -> None:
        """This state's parameters moved to a new root's state (a root over sharded units):
        what it held goes now (its masters, the library's model, the hooks viewing its
        buffers), not when the garbage collector finds it."""
        self.model = self.train = self.eval = self.hooks = self.pack = self.unpack = None
        self.post = {}
        self.units = []
        self.params = []
        self.masters = []
        self.offloaded = []
        self.empty = []
        self.accum = {}

    # ---- passes ------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """A unit's forward pre-hook (FSDP2's way: the module keeps its own ``forward``). A
        root's call, or a unit's outside its root's forward, begins a pass: its engine is
        chosen, the saved-tensor hooks pushed and the root's unit fetched. A unit inside a
        pass is fetched; one recomputed by activation checkpointing is fetched for the
        backward. A frame on ``self.frames`` says what :meth:`post_forward` undoes."""
        frame = _Frame(module, sys.exc_info()[1])
        self.frames.append(frame)
        unit = module.__dict__.get("_collsched_u")
        if unit is None:
            return args, kwargs
        root = module is self.root
        if not root and self.engine is not None:
            return self._enter(frame, unit, args, kwargs)
        if _recomputing(self):
            self._pre_backward(unit)
            t0 = _clock()
            args, kwargs = self._watch(unit, *self._cast_inputs(args, kwargs))
            self.host_s += _clock() - t0
            return args, kwargs
        t0 = _clock()
        if self.engine is None:
            self.reshard_all()
        if self.phase == "backward":
            self._recover()
        if torch.is_grad_enabled():
            if self.phase == "idle":
                self._step_boundary()
            frame.engine = self.train
            self.spans.mark()
        else:
            frame.engine = self.eval
        frame.outer = self.engine
        if self.masters and frame.outer is None:
            values_.push_masters(self, ahead=torch.is_grad_enabled())
        self.engine = frame.engine
        saved = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        saved.__enter__()
        frame.saved = saved
        self.host_s += _clock() - t0
        args, kwargs = self._enter(frame, self.units[0], args, kwargs)
        if not root:
            args, kwargs = self._enter(frame, unit, args, kwargs)
        return args, kwargs

    def post_forward(self, module: nn.Module, out: Any) -> Any:
        """A unit's forward hook, called whether its forward returned or raised (``always_call``):
        releases what :meth:`pre_forward` fetched; a pass's end ends an evaluation step, or
        hooks the backward's beginning to the output, or ends a step nothing can run backward
        through; a pass that raised releases everything it fetched."""
        if not self.frames or self.frames[-1].module is not module:
            # Another pre-hook raised before this module's ran: nothing of ours to undo.
            return None
        frame = self.frames.pop()
        ok = sys.exc_info()[1] is frame.raised
        unit = frame.module.__dict__.get("_collsched_u")
        cast = None if unit is None or not ok else unit.output_dtype
        if unit is not None and not frame.entered and self.frames and _recomputing(self):
            # A unit recomputed inside another's recomputation: its backward comes later.
            self.spans.end(unit.index)
            self.spans.resume()
        if frame.engine is None:
            for unit, training in reversed(frame.entered):
                self._leave(unit, out, ok and training)
            return None if cast is None else values_.cast_floats(out, cast)
        try:
            for unit, training in reversed(frame.entered):
                self._leave(unit, out, ok and training)
        except BaseException:
            ok = False
            raise
        finally:
            try:
                if frame.saved is not None:
                    frame.saved.__exit__()
            finally:
                # A nested pass's units are released above; the outer pass goes on.
                if not ok and frame.outer is None:
                    self._abort(frame.engine)
                self.engine = frame.outer
        if not ok:
            # The forward raised; torch raises it on after this hook.
            return None
        engine = frame.engine
        if cast is not None:
            out = values_.cast_floats(out, cast)
        if frame.outer is not None:
            return out
        if engine is self.eval:
            engine.end_step()
            return out
        needs = _needing_grad(out)
        if needs:
            # The backward begins when the first of these gets its gradient.
            t0 = _clock()
            torch.autograd.graph.register_multi_grad_hook(needs, self._begin_backward_hook, mode="any")
            self.phase = "forward"
            self.host_s += _clock() - t0
        elif self.phase == "idle":
            # Nothing can run backward through this output: the step ends here.
            for unit in self.units:
                self._release(unit)
            self._end_step()
        return out

    def _enter(self, frame: _Frame, unit: _Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Fetches ``unit`` for a forward (unless a call around this one holds it fetched,
        which releases it) and, in training, watches its arguments for its post-backward."""
        args, kwargs = self._cast_inputs(args, kwargs)
        held = unit.held and self.engine is self.train
        if unit.fetched is not None and not held and (not unit.kept or self.engine is not self.train):
            # Held by a call around this one, kept for its backward, or held since the last
            # backward (an evaluation pass leaves those so).
            return args, kwargs
        unit.kept = False
        self.spans.pause()
        t0 = _clock()
        native = self._take_held(unit) if held else self._fetch(unit, self.engine, swap=True)
        training = self.engine is self.train and torch.is_grad_enabled()
        frame.entered.append((unit, training))
        if training:
            args, kwargs = self._watch(unit, args, kwargs)
        self.host_s += _clock() - t0 - native
        self.native_s += native
        if self.engine is self.train:  # (a reentrant checkpoint's first forward runs under no_grad)
            self.spans.begin("forward", unit.index)
        self.spans.resume()
        return args, kwargs

    def _cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        mp = self.opts["mp"]
        if mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
            return values_.cast_floats((args, kwargs), mp.param_dtype)
        return args, kwargs

    def _leave(self, unit: _Unit, out: Any, hook: bool) -> None:
        """Releases ``unit`` after its forward (``hook``: a training forward that returned,
        whose outputs get its pre-backward hook; the unit is kept fetched for its backward
        instead where its ``reshard_after_forward`` is False)."""
        self.spans.end(unit.index)
        t0 = _clock()
        native = 0.0
        try:
            if hook:
                self._hook_pre_backward(unit, out)
                unit.kept = unit.exposed = not unit.reshard
                if unit.post:
                    post_.capture(self, unit)
        finally:
            if not unit.kept:
                native = self._release(unit)
            self.host_s += _clock() - t0 - native
            self.native_s += native
            self.host_units += 1
            self.spans.resume()

    def _hook_pre_backward(self, unit: _Unit, out: Any) -> None:
        """Once the gradient of one of ``out``'s tensors (the unit's outputs) is computed, the
        unit's backward is about to run: :meth:`_pre_backward` (FSDP2's pre-backward hook).
        Leaf tensors are left alone (a unit that returns one computed nothing on it, and a
        hook would stay on it after the step)."""
        for t in _needing_grad(out):
            if t.grad_fn is not None:
                t.register_hook(lambda _g, unit=unit: self._pre_backward(unit))

    def _pre_backward(self, unit: _Unit) -> None:
        """The unit's backward is about to run: it is fetched for it, its full parameters in
        its modules (a forward recomputed by activation checkpointing reads them there),
        until its post-backward or the backward's end releases it."""
        self.spans.pause()
        t0 = _clock()
        if not self.queued:
            self._begin_backward()
        if unit.kept and unit.fetched is self.train:
            # Kept since its forward: fetched again, gathering nothing (backward rules fire).
            unit.kept = False
            native = self._take_held(unit)
        else:
            native = self._fetch(unit, post_.backward_engine(self, unit), swap=True)
        self.host_s += _clock() - t0 - native
        self.native_s += native
        self.spans.begin("backward", unit.index)

    def _watch(self, unit: _Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Passes the unit's tensor arguments that need a gradient through
        :class:`_PostBackward`: once their gradients are computed, the unit's backward is over
        (FSDP2's post-backward hook); tensors nested in lists, tuples and dicts count when
        no argument is such a tensor itself. A unit without such arguments hands its
        gradients over at the end of the backward."""
        at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad] if kwargs else []
        if not at and not keys:
            if any(isinstance(a, _NESTS) for a in args) or any(isinstance(v, _NESTS) for v in kwargs.values()):
                return self._watch_nested(unit, args, kwargs)
            return args, kwargs
        outs = _PostBackward.apply(self, unit, *(args[i] for i in at), *(kwargs[k] for k in keys))
        if at:
            args = list(args)
            for i, o in zip(at, outs):
                args[i] = o
        if keys:
            kwargs = dict(kwargs)
            for k, o in zip(keys, outs[len(at) :]):
                kwargs[k] = o
        return args, kwargs

    def _watch_nested(self, unit: _Unit, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """:meth:`_watch` for tensors nested in the arguments (as FSDP2 flattens them)."""
        flat, spec = _pytree.tree_flatten((args, kwargs))
        at = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return args, kwargs
        outs = _PostBackward.apply(self, unit, *(flat[i] for i in at))
        for i, o in zip(at, outs):
            flat[i] = o
        return _pytree.tree_unflatten(flat, spec)

    def _fetch(self, unit: _Unit, engine: Any, swap: bool) -> float:
        """Fetches ``unit`` on ``engine`` (``swap``: and puts its full parameters in its
        modules); returns the seconds spent in the library."""
        if unit.fetched is not None:
            if swap and not unit.swapped:
                self._swap_in(unit)
            return 0.0
        # A tied parameter's full value may view what another unit fetched last.
        known = [p.addr for p in unit.params] if unit.shared else unit.known
        t0 = _clock()
        regions = engine.fetch(unit.ids, known)
        native = _clock() - t0
        unit.fetched = engine
        moved = any(regions)
        if moved:
            # Some buffers are at new addresses: rebind those parameters.
            for p, region in zip(unit.params, regions):
                if region is None:
                    continue
                addr = region.address
                view = p.views.pop(addr, None)
                if view is None:
                    view = torch.from_dlpack(region.dlpack(_FROM_TORCH[p.dtype], list(p.shape)))
                    self.views_made += 1
                    if len(p.views) >= _VIEWS_KEPT:
                        del p.views[next(iter(p.views))]
                # (Last in the dict: the most recently used.)
                p.views[addr] = view
                p.point(view)
                p.addr = addr
            unit.known = [p.addr for p in unit.params]
        if moved or unit.shared:
            # The saved-tensor hooks' spans, and the tensors they view the parameters through.
            self.hooks.set_spans(unit.index, [(p.addr, p.nbytes, p.pid, p.views[p.addr]) for p in unit.params])
        self.hooks.show(unit.index)
        if swap:
            self._swap_in(unit)
        return native

    def _take_held(self, unit: _Unit) -> float:
        """A unit held since the last backward (or kept since its forward) fetched again for a
        training pass: nothing is gathered (its buffers are live; the schedule sees the fetch in
        its order), then the earlier hold dropped. Returns the seconds spent in the library."""
        unit.fetched = None
        unit.held = False
        native = self._fetch(unit, self.train, swap=True)
        t0 = _clock()
        self.train.release(unit.ids)
        return native + _clock() - t0

    def _after_backward(self, unit: _Unit) -> float:
        """``unit``'s backward is over: released, or held into the next forward where its
        ``reshard_after_backward`` is False and this backward does not synchronize (after a
        synchronized one the optimizer may step: the next forward gathers its new values).
        Returns the seconds spent in the library."""
        if unit.fetched is self.train and not unit.reshard_bwd and not self.sync:
            unit.held = True
            unit.kept = False
            if not unit.swapped:
                # Fetched for a saved tensor alone: its full values go in its modules too,
                # where a pass that skips fetching it (an evaluation) reads them.
                self._swap_in(unit)
            return 0.0
        return self._release(unit)

    def drop_held(self) -> None:
        """Releases the units held since the last backward (``save_checkpoint``,
        ``load_checkpoint``, ``full_state_dict``, ``save_full`` want nothing fetched). Every
        rank holds the same units."""
        for u in self.units:
            if u.held:
                self._release(u)

    def _swap_in(self, unit: _Unit) -> None:
        for params, name, full, _ in unit.swaps:
            params[name] = full
        unit.swapped = True

    def _release(self, unit: _Unit) -> float:
        """Releases ``unit`` (its shards back in its modules); returns seconds in the library."""
        if unit.exposed:
            unit.expire()
        engine = unit.fetched
        unit.kept = False
        unit.held = False
        if engine is None:
            return 0.0
        if unit.swapped:
            for params, name, _, shard in unit.swaps:
                params[name] = shard
            unit.swapped = False
        # The full parameters keep viewing the buffers (nothing outside a pass reaches them;
        # saved tensors are references, see Hooks): the next fetch at the same addresses has
        # nothing to redo.
        self.hooks.hide(unit.index)
        unit.fetched = None
        t0 = _clock()
        engine.release(unit.ids)
        return _clock() - t0

    def _abort(self, engine: Any) -> None:
        """An exception in a forward: release what the pass fetched; an evaluation pass's
        step ends (a training step stays open: its backward may still come, or the next
        forward continues it)."""
        for unit in self.units:
            unit.captured = False
            if unit.fetched is engine:
                self._release(unit)
        if engine is self.eval:
            engine.end_step()
        else:
            self.spans.drop_pass()

    def _recover(self) -> None:
        """A backward that raised left units fetched, and gradients accumulated that were
        never handed over: release the units and end its step, dropping its gradients (found
        at the next forward, after the caller's ``zero_grad``: the next step would add to
        them otherwise)."""
        for unit in self.units:
            self._release(unit)
        for p in self.params:
            p.full.grad = None
        self.accum.clear()
        self.phase = "idle"
        self.queued = False
        self._end_step(deliver=False)

    def _step_boundary(self) -> None:
        if self.opts["auto_refresh_trainable"] and not self.unsynced:
            self.refresh_trainable()

    def check_shards_in_place(self, module: str) -> None:
        """Every shard still views collsched's memory; those that do not are put back, and the
        first is named in the error."""
        moved = []
        for p in self.params:
            data, want = p.shard.data, p.own
            if data.data_ptr() != want.data_ptr() or data.dtype != want.dtype or data.device != want.device:
                moved.append((p, data.dtype, data.device))
                p.shard.data = want
        if moved and self.emptying and all(d == p.own.dtype and dev == p.own.device for p, d, dev in moved):
            # ``to_empty`` on the shards' own device: they are in place already.
            return
        if moved:
            p, dtype, device = moved[0]
            raise CollschedError(
                f"{module}: a conversion (module.to(), .half(), .share_memory(), ...) moved parameter {p.name} "
                f"({len(moved)} parameters in all) out of collsched's memory, to {dtype} on {device}; the shards are "
                f"put back ({p.own.dtype} on {p.own.device}). Convert or move the module before fully_shard"
            )

    def refresh_trainable(self) -> bool:
        mask = [bool(p.shard.requires_grad) for p in self.params]
        if mask == self.mask:
            return False
        if self.phase != "idle" or self.unsynced:
            raise CollschedError(
                "refresh_trainable: call it between steps, after a synchronized backward (not between "
                "the micro-batches of a no_sync accumulation)"
            )
        self.train.refresh_trainable(mask)
        self.mask = mask
        self._own_grads()
        for p, m in zip(self.params, mask):
            p.full.requires_grad_(m)
        return True

    # ---- saved tensors -----------------------------------------------------------------

    def _unpack_saved(self, x: Any) -> torch.Tensor:
        """The tensor a saved reference (``_native.Saved``) stands for: the parameter's full
        value viewed as the saved tensor was, its unit fetched again if released."""
        self.spans.pause()
        t0 = _clock()
        if not self.queued:
            self._begin_backward()
        p = self.params[x.pid]
        unit = self.units[p.unit]
        native = self._fetch(unit, post_.backward_engine(self, unit), swap=False) if unit.fetched is None else 0.0
        base = p.gathered()
        if x.dtype != base.dtype:
            base = base.view(x.dtype)
        out = base.as_strided(x.size, x.stride, x.offset)
        self.host_s += _clock() - t0 - native
        self.native_s += native
        self.spans.resume()
        return out

    # ---- backward ----------------------------------------------------------------------

    def _begin_backward_hook(self, _grad: Any) -> None:
        t0 = _clock()
        self._begin_backward()
        self.host_s += _clock() - t0

    def _begin_backward(self) -> None:
        if self.queued:
            return
        if self.phase == "idle":
            self._step_boundary()
        self.queued = True
        self.phase = "backward"
        self.train.begin_backward()
        post_.begin_backward(self)
        self.train.set_no_sync(not self.sync)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _post_backward(self, unit: _Unit) -> None:
        """The gradients of ``unit``'s arguments are computed: its backward is over. Its
        gradients go to the library and, once all are in, it is released."""
        self.spans.end(unit.index)
        t0 = _clock()
        if not self.queued:
            self._begin_backward()
        native, done = values_.hand(self, unit.grads)
        if done:
            native += self._after_backward(unit)
        self.host_s += _clock() - t0 - native
        self.native_s += native
        self.spans.resume()

    def _end_backward(self) -> None:
        self.spans.pause()
        t0 = _clock()
        native = 0.0
        for unit in self.units:
            native += values_.hand(self, unit.grads, final=True)[0]
        for unit in self.units:
            native += self._after_backward(unit)
        self.queued = False
        self.phase = "idle"
        self.host_s += _clock() - t0 - native
        self.native_s += native
        self._end_step()
        self.spans.idle(self.sync)

    def _end_step(self, deliver: bool = True) -> None:
        """Ends the library's step; after a synchronized backward, adds the reduced gradients
        to the shards' ``.grad`` (``deliver=False``: takes them and drops them)."""
        self.spans.next_step(keep=deliver)
        self.got.clear()
        t0 = _clock()
        try:
            stats = self.train.end_step()
        finally:
            post = post_.end_step(self)
        post_.merge(stats, post)
        native_s = self.native_s + _clock() - t0
        spans_.per_unit(stats, self.host_s + self.hooks.take_seconds(), native_s, self.host_units)
        self.host_s = self.native_s = 0.0
        self.host_units = 0
        stats["views_made"], self.views_made = self.views_made, 0
        self.steps += 1
        self.reduced_steps += stats["reduce_scatters"] > 0
        stats["steps"], stats["reduced_steps"] = self.steps, self.reduced_steps
        self.last = stats
        if not self.sync:
            self.unsynced = stats["accumulated_grads"] > 0 or self.withheld or self.unsynced
            values_.end_copies(self)
            return
        self.unsynced = False
        self.withheld = False
        grads = self.train.take_grads()
        if deliver:
            values_.deliver(self, grads)
        # Their device memory goes back to the pool behind deliver's copies, not a step later.
        del grads
        values_.end_copies(self)
        self.train.release_grads()
