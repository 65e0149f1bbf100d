"""Where a sharded model's values come from and go: the full values a build starts from
(the module's, a re-planned unit's, or rank 0's), and mixed precision (FSDP2's
``MixedPrecisionPolicy``): f32 master shards the optimizer updates, cast into the library's
shards of the gather dtype before a gather reads them, and gathered back whole for export;
a backward's gradients handed to the library (:func:`hand`) and the reduced ones delivered."""

from __future__ import annotations

import ctypes
import dataclasses
import struct
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils import _pytree

from .._native import CollschedError
from . import tp as tp_
from . import world as world_
from .units import _tensor
from .world import _DTYPE_BYTES, _FROM_TORCH, _TO_TORCH

if TYPE_CHECKING:
    from .shard import _State
    from .units import _Param


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's mixed precision, by its names: ``param_dtype`` is the dtype parameters are
    gathered and computed in (each shard cast into it before its gather: half the bytes of f32
    for bf16), while the module's parameters, which the optimizer updates, stay f32 shards;
    ``reduce_dtype`` the dtype gradients are reduced in (``None``: the parameters' own, as
    torch 2.15's FSDP2), delivered to the f32 shards' ``.grad`` without rounding to
    ``param_dtype``; ``output_dtype`` casts the floating-point outputs of the forward of the
    module given this policy (each unit's own); ``cast_forward_inputs`` casts each unit's
    floating-point inputs to ``param_dtype``. FSDP2's own class is taken too (without
    ``param_dtype_override_fn``). The root's ``param_dtype``, ``reduce_dtype`` and
    ``cast_forward_inputs`` apply to every unit under it: a unit sharded with others is
    refused."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclasses.dataclass(frozen=True)
class CPUOffloadPolicy:
    """FSDP2's CPU offload: the module's parameters (the shards the optimizer updates, and
    their gradients) live in host memory, the shards ``pin_memory`` (True: page-locked on a
    CUDA world, for fast copies to and from the device); each pass copies them into the library's shards, on the device,
    before its gathers, and the reduced gradients come back to the host, where the
    optimizer steps. On a CPU world the shards are host memory already: the copies are made
    all the same (what the tests check)."""

    pin_memory: bool = True


def offload_policy(value: Any) -> CPUOffloadPolicy | None:
    """``fully_shard``'s ``offload_policy``: this module's class or FSDP2's (``OffloadPolicy()``,
    FSDP2's default, is no offload)."""
    if value is None:
        return None
    if not isinstance(getattr(value, "pin_memory", None), bool):
        if type(value).__name__ == "OffloadPolicy":
            return None
        raise CollschedError(
            f"fully_shard: offload_policy={value!r}; expected a CPUOffloadPolicy (collsched.torch's or FSDP2's)"
        )
    return CPUOffloadPolicy(bool(value.pin_memory))


def policy(value: Any) -> MixedPrecisionPolicy | None:
    """``fully_shard``'s ``mp_policy``: this module's class or FSDP2's (read by its fields)."""
    if value is None:
        return None
    if getattr(value, "param_dtype_override_fn", None) is not None:
        raise CollschedError("fully_shard: mp_policy.param_dtype_override_fn is not supported; give param_dtype alone")
    try:
        p = MixedPrecisionPolicy(
            value.param_dtype, value.reduce_dtype, value.output_dtype, bool(value.cast_forward_inputs)
        )
    except AttributeError:
        raise CollschedError(
            f"fully_shard: mp_policy={value!r}; expected a MixedPrecisionPolicy (collsched.torch's or FSDP2's)"
        ) from None
    for name in ("param_dtype", "reduce_dtype"):
        d = getattr(p, name)
        if d is not None and d not in _FROM_TORCH:
            raise CollschedError(f"fully_shard: mp_policy.{name}={d}; expected float32, bfloat16 or float16")
    if p.output_dtype is not None and not p.output_dtype.is_floating_point:
        raise CollschedError(f"fully_shard: mp_policy.output_dtype={p.output_dtype}; expected a floating dtype")
    return p


def without_output(p: MixedPrecisionPolicy | None) -> MixedPrecisionPolicy | None:
    """``p`` but for its ``output_dtype`` (which each unit has its own of)."""
    return None if p is None else dataclasses.replace(p, output_dtype=None)


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` (nested lists, tuples, dicts) with its floating-point tensors cast to ``dtype``."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return _pytree.tree_map(cast, tree)


def full_values(values: list[nn.Parameter], old_states: dict[int, _State]) -> list[torch.Tensor]:
    """The full values a build starts from, on the host: a parameter's own, or for one a unit's
    earlier build sharded, its full value gathered from that build (its f32 master under mixed
    precision)."""
    gathered: dict[int, dict[int, torch.Tensor]] = {k: gather_all(st) for k, st in old_states.items()}
    out = []
    for p in values:
        prev = getattr(p, "_collsched_param", None)
        if prev is not None:
            st, old = prev
            out.append(gathered[id(st)][old.pid].to("cpu").contiguous())
        else:
            out.append(p.detach().to("cpu").contiguous())
    return out


def from_rank0(w: Any, full: list[torch.Tensor]) -> list[torch.Tensor]:
    """Rank 0's ``full`` on every rank of the world ``w`` (``sync_module_states``)."""
    mine = b"".join(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()) for t in full) if w.rank == 0 else b""
    data = w.all_gather(mine)[0]
    out, at = [], 0
    for t in full:
        n = t.numel() * t.element_size()
        out.append(torch.frombuffer(bytearray(data[at : at + n]), dtype=t.dtype).view(t.shape))
        at += n
    return out


def cast_batch(
    batch: list[tuple[int, torch.Tensor]], which: list[tuple[int, torch.dtype, torch.device | None]]
) -> None:
    """Replaces ``batch[i]``'s tensor, for each ``(i, dtype, device)`` of ``which``, by a
    contiguous copy in ``dtype`` on ``device`` (``None``: the tensor's own): the copies of one
    dtype and device are views of one new flat tensor, written by one multi-tensor copy (on a
    GPU a launch or two for a unit's gradients where the sources share a dtype and layout, as
    autograd's do, and a cast each launches one per tensor). Sources on one other device are
    cast there into one flat tensor first, then moved by one copy (into page-locked memory
    from a GPU: one transfer and one wait, not one each)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, dtype, device in which:
        groups.setdefault((dtype, batch[i][1].device if device is None else device), []).append(i)
    for (dtype, device), at in groups.items():
        srcs = [batch[i][1] for i in at]
        there = {t.device for t in srcs}
        across = there != {device} and len(there) == 1
        pin = across and device.type == "cpu" and next(iter(there)).type == "cuda"
        flat = torch.empty(sum(t.numel() for t in srcs), dtype=dtype, device=device, pin_memory=pin)
        dsts = _views(flat, srcs)
        with torch.no_grad():
            if there == {device}:
                torch._foreach_copy_(dsts, srcs)
            elif across:
                stage = torch.empty(flat.numel(), dtype=dtype, device=srcs[0].device)
                torch._foreach_copy_(_views(stage, srcs), srcs)
                flat.copy_(stage)
            else:
                for d, t in zip(dsts, srcs):
                    d.copy_(t)
        for i, d in zip(at, dsts):
            batch[i] = (batch[i][0], d)


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive views shaped as the tensors of ``like``."""
    # split's views are 1-D already; others take the source's shape (unpacked: a torch.Size
    # argument parses slower).
    return [
        v if t.dim() == 1 else v.view(*t.shape) if t.dim() else v.view(())
        for v, t in zip(flat.split([t.numel() for t in like]), like)
    ]


def pack_offloaded(state: _State, pin: bool) -> None:
    """Under CPU offload: each dtype's masters become views of one host tensor (page-locked
    where ``pin``), so that a pass's start moves them to the device by one copy
    (:func:`push_masters`)."""
    groups: dict[torch.dtype, list[_Param]] = {}
    for p in state.masters:
        groups.setdefault(p.own.dtype, []).append(p)
    state.offloaded = []
    for dtype, params in groups.items():
        flat = torch.empty(sum(p.own.numel() for p in params), dtype=dtype, pin_memory=pin)
        views = _views(flat, [p.own for p in params])
        with torch.no_grad():
            for p, v in zip(params, views):
                v.copy_(p.own)
                p.own = p.shard.data = v
        state.offloaded.append((flat, params, [v.data_ptr() for v in views]))


def push_masters(state: _State, ahead: bool = False) -> None:
    """Casts the f32 masters into the library's shards the next gathers read. At every pass's
    start: an optimizer, or ``p.data`` written by hand (which no version counter sees), may
    have changed them; it costs a cast of this rank's elements. Under CPU offload, each
    dtype's masters still where :func:`pack_offloaded` put them cross by one copy; ``ahead``
    (a training pass's start): from page-locked memory without the host waiting, until the
    step's end (:func:`end_copies`), before which no optimizer writes the masters."""
    masters = state.masters
    if not masters:
        return
    rest = masters
    with torch.no_grad():
        if state.offloaded:
            rest = []
            for flat, params, at in state.offloaded:
                if any(p.shard.data_ptr() != a or p.shard.device != flat.device for p, a in zip(params, at)):
                    rest += params  # replaced (a load, ``to_empty``): one copy each
                    continue
                early = ahead and flat.is_pinned()
                there = flat.to(state.device, non_blocking=early)
                if early:
                    state.pushed = torch.cuda.Event()
                    state.pushed.record()
                homes = [p.home for p in params]
                torch._foreach_copy_(homes, _views(there, homes))
        local = [p for p in rest if p.shard.device == p.home.device]
        if local:
            # One multi-tensor cast (a launch or two on a GPU, not one per parameter).
            torch._foreach_copy_([p.home for p in local], [p.shard for p in local])
        for p in rest:
            if p.shard.device != p.home.device:
                p.home.copy_(p.shard)


def end_copies(state: _State) -> None:
    """At a step's end, on a CUDA world: the host waits for a pass's upload of the offloaded
    masters (an optimizer may write them next), and the library's compute stream (which
    :func:`deliver`'s gradients' release is fenced on) waits for torch's current one, where
    the copies out of them ran, if they are not the same."""
    if state.pushed is not None:
        state.pushed.synchronize()
        state.pushed = None
    compute = world_._STREAM
    if state.device.type == "cuda" and compute is not None and torch.cuda.current_stream() != compute:
        compute.wait_stream(torch.cuda.current_stream())


_HEAD = struct.Struct("<QQQ")


def master_values(state: _State, params: list[_Param] | None = None) -> dict[int, torch.Tensor]:
    """Every mixed-precision parameter's full f32 value (copies, on the state's device), from
    every rank's masters, or those of ``params`` (masters; every rank names the same).
    Collective (every rank has masters, or none)."""
    masters = state.masters if params is None else params
    if not masters:
        return {}
    parts = []
    for p in masters:
        m = p.shard.detach().to("cpu").contiguous()
        raw = ctypes.string_at(m.data_ptr(), m.numel() * m.element_size()) if m.numel() else b""
        parts.append(_HEAD.pack(p.pid, p.offset, m.numel()) + raw)
    full = {p.pid: torch.empty(p.numel, dtype=p.shard.dtype) for p in masters}
    for blob in state.world.all_gather(b"".join(parts)):
        at = 0
        while at < len(blob):
            pid, offset, numel = _HEAD.unpack_from(blob, at)
            at += _HEAD.size
            t = full[pid]
            n = numel * t.element_size()
            if n:
                t[offset : offset + numel] = torch.frombuffer(bytearray(blob[at : at + n]), dtype=t.dtype)
            at += n
    return {p.pid: full[p.pid].view(p.shape).to(state.device) for p in masters}


def deliver(st: _State, grads: list[tuple[int, int, Any, str]]) -> None:
    """Adds the reduced gradients the library hands over (``take_grads``) to the shards'
    ``.grad`` (host bytes, or library memory on the device copied out here)."""
    for p in st.empty:
        # A trainable parameter this rank holds no element of gets an empty gradient, as
        # FSDP2's do: a rank's `p.grad is not None` list (torchtitan's clipping) is then
        # the same list on every rank.
        if p.shard.grad is None and st.mask[p.pid]:
            p.shard.grad = p.own.new_zeros(0)
    moved = []
    for pid, _offset, data, dtype in grads:
        p = st.params[pid]
        if isinstance(data, (bytes, bytearray)):
            g = torch.frombuffer(data, dtype=_TO_TORCH[dtype])
            if g.dtype != p.shard.dtype or g.device != p.shard.device:
                g = g.to(p.shard.device, p.shard.dtype)
            if p.shard.grad is None:
                p.shard.grad = g
            else:
                p.shard.grad.add_(g)
            continue
        # Library memory on the device, valid until the next call: copied out here into views
        # of one tensor per dtype and device (as FSDP2's sharded gradients view its
        # reduce-scatter's output; under CPU offload, one transfer to the host), then each
        # becomes a shard's gradient or is added to the one it has, by one multi-tensor add.
        g = _tensor(data, _TO_TORCH[dtype], [len(data) // _DTYPE_BYTES[dtype]], st.device)
        keep = p.shard.grad is not None and p.shard.grad.dtype == g.dtype and p.shard.grad.device == g.device
        moved.append((p, g, keep))
    batch = [(i, g) for i, (_p, g, _k) in enumerate(moved)]
    cast_batch(batch, [(i, p.shard.dtype, p.shard.device) for i, (p, _g, keep) in enumerate(moved) if not keep])
    onto = []
    for (p, _g, _k), (_i, g) in zip(moved, batch):
        if p.shard.grad is None:
            p.shard.grad = g
        else:
            onto.append((p.shard.grad, g))
    if onto:
        with torch.no_grad():
            torch._foreach_add_([d for d, _g in onto], [g for _d, g in onto])


def gather_all(st: _State) -> dict[int, torch.Tensor]:
    """Every parameter's full value of ``st``'s model (copies; a mixed-precision one's f32
    master), by id. Collective."""
    st.reshard_all()
    if st.masters:
        push_masters(st)
    ids = [p.pid for p in st.params]
    regions = st.eval.fetch(ids)
    out = {}
    for p, region in zip(st.params, regions):
        out[p.pid] = _tensor(region, p.dtype, p.shape, st.device).clone()
    st.eval.release(ids)
    st.eval.end_step()
    if st.masters:
        out.update(master_values(st))
    return out


def hand(st: _State, params: list[_Param], final: bool = False) -> tuple[float, bool]:
    """Hands the accumulated gradients of ``params`` to the library; returns the seconds
    spent there and whether every one of them is in (one still to come, or of a parameter
    this backward does not reach, is not)."""
    batch, cast, done, got = [], [], True, st.got
    on_device = st.on_device
    for p in params:
        if p.pid in got:
            continue
        full = p.full
        g = full.grad
        if g is None and not (final and on_device and st.sync and p.pid in st.accum):
            # (The backward's end, or a finalization, hands what no_sync accumulated alone.)
            done = False
            continue
        want = reduce_dtype(st, p) if on_device else p.dtype
        if on_device and not st.sync:
            # The library takes device gradients in the synchronized micro-batch only:
            # until then they accumulate here, in the reduction dtype (FSDP2 keeps them
            # likewise), so that a .grad is always this backward's own; a tensor-parallel
            # one as a DTensor, redistributed once, when handed.
            st.withheld = True
            got.add(p.pid)
            if p.tp is not None:
                g = tp_.settled(g, p.tp, p.name)
            full.grad = None
            acc = st.accum.get(p.pid)
            # Contiguous: the synchronized micro-batch hands the sum over as it is.
            summand = g.to(want, memory_format=torch.contiguous_format)
            st.accum[p.pid] = summand if acc is None else tp_.add_into(acc, summand, p.tp, p.name, p.tp_dp)
            continue
        full.grad = None
        # Host gradients go over in the parameter's dtype (the library casts); device ones
        # in the reduction dtype (cast here, on the compute stream, all in one
        # multi-tensor copy below), with what no_sync micro-batches accumulated.
        acc = st.accum.pop(p.pid, None) if on_device else None
        if acc is not None:
            g = acc if g is None else tp_.add_into(acc, g, p.tp, p.name, p.tp_dp)
        if p.tp is not None:
            g = tp_.local_grad(g, p.tp, p.name, p.tp_dp)
        if (acc is None or p.tp is not None) and (g.dtype != want or not g.is_contiguous()):
            cast.append((len(batch), want, None))
        batch.append((p.pid, g))
        got.add(p.pid)
    if not batch:
        return 0.0, done
    if cast:
        cast_batch(batch, cast)
    t0 = time.perf_counter()
    st.train.grad_ready_many(batch)
    return time.perf_counter() - t0, done


def reduce_dtype(st: _State, p: _Param) -> torch.dtype:
    """The dtype ``p``'s gradient is reduced in."""
    r = st.opts["reduce_dtype"]
    return p.dtype if r is None else _TO_TORCH[r]
