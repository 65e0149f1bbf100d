"""Building a root's sharded model (``_State.build``): the units and parameters found in the
modules, their initial values (or none, for a model built on the meta device), the plan, the
library's model and engines, and the shards put in the modules."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import _native
from .._native import CollschedError
from . import clip as clip_
from . import compat as compat_
from . import post_forward as post_
from . import tp as tp_
from . import values as values_
from . import world as world_
from .spans import Spans
from .units import _Param, _tensor, _Unit, library_model
from .world import _DTYPE_BYTES, _FROM_TORCH, world

if TYPE_CHECKING:
    from .shard import _State


def build(st: _State) -> None:
    """Builds ``st``'s sharded model: its units and parameters from the modules, the plan,
    the library's model and engines, the shards in the modules."""
    w = st.world
    for m in st.root.modules():
        # An int refused before anything changes (FSDP2 checks it in fully_shard).
        after_forward(m.__dict__.get("_collsched_reshard"), st, "fully_shard")
    if w.kind == "cuda":
        st.device = torch.device("cuda", torch.cuda.current_device())
    st.on_device = w.kind in ("cuda", "emulated")
    st.spans = Spans(w.kind != "cuda")
    root = st.root
    mp = st.opts["mp"]
    unit_of: dict[int, int] = {}
    st.units = []

    # The unit of each fully_shard([...]) list met so far, by the list's id.
    groups: dict[int, int] = {}

    def visit(m: nn.Module, u: int) -> None:
        if m is not root and getattr(m, "_collsched_unit", False):
            group = m.__dict__.get("_collsched_group")
            if group is not None and id(group) in groups:
                u = groups[id(group)]
                st.units[u].members.append(m)
            else:
                u = len(st.units)
                st.units.append(_Unit(u, m))
                if group is not None:
                    groups[id(group)] = u
        unit_of[id(m)] = u
        for c in m.children():
            if id(c) not in unit_of:
                visit(c, u)

    st.units.append(_Unit(0, root))
    visit(root, 0)
    # FSDP2's dp_mesh_dims of the root's call (tp.py), which its blocks' calls must share.
    spmd = st.opts.get("spmd")
    for m in (m for u in st.units for m in u.members if "_collsched_part" in m.__dict__):
        if m.__dict__["_collsched_spmd"] != spmd:
            raise CollschedError(
                f"fully_shard: {type(m).__name__} was given in a list {_dims(m.__dict__['_collsched_spmd'])}, the root "
                f"{type(root).__name__} {_dims(spmd)}; give the list and the root the same mesh= and dp_mesh_dims="
            )
        if m.__dict__["_collsched_part"] != st.part:
            raise CollschedError(
                f"fully_shard: {type(m).__name__} was given in a list with mesh over ranks "
                f"{m.__dict__['_collsched_part'] or 'of the whole job'}, the root {type(root).__name__} with one over "
                f"{st.part or 'the whole job'}; give the list and the root the same mesh="
            )
    for u in st.units:
        # A unit's own output_dtype applies to its outputs; the rest is the root's.
        own = u.module.__dict__.get("_collsched_mp", mp)
        u.output_dtype = None if own is None else own.output_dtype
        if values_.without_output(own) != values_.without_output(mp):
            raise CollschedError(
                f"fully_shard: unit {type(u.module).__name__} was sharded with mp_policy {own}, the root "
                f"with {mp}; give every unit the root's param_dtype, reduce_dtype and cast_forward_inputs"
            )
        off = u.module.__dict__.get("_collsched_offload", st.opts.get("offload"))
        if off != st.opts.get("offload"):
            raise CollschedError(
                f"fully_shard: unit {type(u.module).__name__} was sharded with offload_policy {off}, the root "
                f"with {st.opts.get('offload')}; give every unit the root's offload_policy"
            )
    # Parameters in module order; a tied parameter belongs to its first unit and is
    # fetched by every unit that uses it.
    found: dict[int, _Param] = {}
    values: list[torch.Tensor] = []
    # Whether each parameter has no value yet: on the meta device, or of an earlier build of one.
    metas: dict[str, bool] = {}
    old_states: dict[int, _State] = {}
    names = {id(m): q for q, m in root.named_modules(remove_duplicate=False)}
    inside = set(names)
    # ``ignored_params`` of every fully_shard call under the root, and every parameter that is
    # not of a floating dtype: left in the modules as they are.
    ignored = {id(p) for m in root.modules() for p in m.__dict__.get("_collsched_ignored", ())}
    # The job's ranks the model is sharded over (tensor-parallel meshes must lie across them).
    job = world()
    dp_ranks = list(st.part) if st.part is not None else list(range(job.world))
    # The parameters given to collsched for the first time, with their names: marked once the
    # build is done, so that a later fully_shard finding one of them (tied elsewhere) says so.
    originals: list[tuple[torch.Tensor, str]] = []
    for m in root.modules():
        u = unit_of[id(m)]
        for name, p in list(m._parameters.items()):
            if p is None or id(p) in ignored or not (p.is_floating_point() or p.is_complex()):
                continue
            info = found.get(id(p))
            if info is None:
                prev = getattr(p, "_collsched_param", None)
                qual = f"{names[id(m)]}.{name}" if names[id(m)] else name
                if prev is not None:
                    before, old = prev
                    if before.model is None or id(before.root) not in inside:
                        raise CollschedError(
                            f"fully_shard: parameter {qual} is already sharded by the fully_shard of a module "
                            f"above {type(root).__name__}; call fully_shard on the blocks first, then on the root"
                        )
                    if before.opts.get("spmd") != spmd:
                        raise CollschedError(
                            f"fully_shard: parameter {qual} was sharded {_dims(before.opts.get('spmd'))} (a block's "
                            f"call), the root {type(root).__name__} {_dims(spmd)}; give the blocks and the root the "
                            "same mesh= and dp_mesh_dims="
                        )
                    if before.part != st.part:
                        raise CollschedError(
                            f"fully_shard: parameter {qual} was sharded over {before.world.world} ranks (a block's "
                            f"mesh), the root {type(root).__name__} over {st.world.world}; give the blocks and the "
                            "root the same mesh="
                        )
                    old_states[id(before)] = before
                    shape, dtype, requires_grad = old.shape, p.dtype, p.requires_grad
                else:
                    earlier = getattr(p, "_collsched_sharded_as", None)
                    if earlier is not None:
                        raise CollschedError(
                            f"fully_shard: parameter {qual} of {type(root).__name__} is {earlier}, which an earlier "
                            f"fully_shard sharded already (a parameter tied across units before they were sharded "
                            f"would train as two); tie it again after sharding (model.tie_weights(), or assign the "
                            f"one to the other), or give fully_shard the module that holds both instead"
                        )
                    originals.append((p, qual))
                    shape, dtype, requires_grad = p.shape, p.dtype, p.requires_grad
                # A tensor-parallel parameter (tp.py): its local tensor is what is sharded.
                dtensor = tp_.is_dtensor(p)
                if dtensor:
                    shape = p._local_tensor.shape
                elif spmd is not None and prev is None:
                    raise CollschedError(
                        f"fully_shard: parameter {qual} is a plain tensor; under dp_mesh_dims every parameter is a "
                        f"DTensor on the mesh given (distribute_tensor(p, mesh, [Replicate(), ...])), or ignored"
                    )
                if dtype not in _FROM_TORCH:
                    raise CollschedError(
                        f"fully_shard: parameter {qual} has dtype {dtype}; collsched moves float32, bfloat16 "
                        "and float16 parameters (cast the module first, e.g. module.to(torch.bfloat16), or "
                        "leave it unsharded with ignored_params)"
                    )
                if p.device.type not in ("cpu", "meta", st.device.type):
                    raise CollschedError(
                        f"fully_shard: parameter {qual} is on {p.device}; this world shards tensors on "
                        f"{st.device} (and takes CPU and meta ones there)"
                    )
                metas[qual] = p.is_meta if prev is None else prev[0].meta
                # Under mixed precision the library's shards and gathers are of param_dtype;
                # the module's shard (the optimizer's) stays of the parameter's dtype.
                gather = mp.param_dtype if mp is not None and mp.param_dtype is not None else dtype
                info = _Param(len(st.params), qual, shape, gather, st.device)
                info.unit = u
                if dtensor:
                    info.tp = tp_.spec_of(p, qual, dp_ranks, job.rank, gather, spmd)
                    info.spmd = spmd
                elif prev is not None and prev[1].tp is not None:
                    info.tp, info.spmd = prev[1].tp, prev[1].spmd
                if info.tp is not None:
                    info.full = tp_.full_param(info.placeholder, info.tp)
                info.shard = p if prev is not None else nn.Parameter(torch.empty(0, dtype=dtype, device=st.device))
                info.shard.requires_grad_(requires_grad)
                found[id(p)] = info
                st.params.append(info)
                values.append(p._local_tensor if dtensor else p)
            st.units[u].slots.append((m, name, info.pid))
    if not st.params:
        raise CollschedError(f"fully_shard: {type(root).__name__} has no parameters to shard")
    for unit in st.units:
        seen: dict[int, None] = {}
        for _, _, pid in unit.slots:
            seen[pid] = None
        unit.ids = list(seen)
        unit.params = [st.params[pid] for pid in unit.ids]
    st.meta = _no_values(w, metas, st.opts["sync_module_states"])
    # The dtypes of the parameters' values (under mixed precision, of the f32 masters).
    dtypes = [v.dtype for v in values]
    full: list[torch.Tensor] | None = None
    if not st.meta:
        full = values_.full_values(values, old_states)
        if st.opts["sync_module_states"]:
            full = values_.from_rank0(w, full)
    lib = None if full is None else [v.to(p.dtype) if v.dtype != p.dtype else v for v, p in zip(full, st.params)]
    trainable = [bool(p.shard.requires_grad) for p in st.params]
    st.model = library_model(w, st.params, trainable, lib, st.opts["strategy"], st.opts["bucket_mb"])
    del lib
    o = st.opts
    # The plan's gather buckets, parsed once: id -> (parameter names, bytes of parameters).
    by_name = {p.name: p for p in st.params}
    st.gather_buckets = {
        b["id"]: (b["params"], _DTYPE_BYTES[b["dtype"]] * sum(by_name[n].numel for n in b["params"]))
        for b in json.loads(st.model.plan)["buckets"]
        if b["kind"] == "gather"
    }
    st.unit_buckets = st._unit_buckets()
    ahead_bytes, ahead_buckets = st._one_unit_ahead()
    prefetch_bytes = ahead_bytes if o["prefetch_bytes"] is None else o["prefetch_bytes"]
    max_inflight = ahead_buckets if o["max_inflight"] is None else o["max_inflight"]
    policy = "none" if o["prefetch"] == "explicit" else o["prefetch"]
    if mp is not None and o["reduce_dtype"] is None:
        # Gradients reduced in the parameters' own dtype (torch 2.15's FSDP2).
        own = {_FROM_TORCH[d] for d in dtypes}
        if len(own) > 1:
            raise CollschedError(f"fully_shard: parameters of dtypes {sorted(own)}: give mp_policy.reduce_dtype")
        o["reduce_dtype"] = own.pop()
    st.engine_args = (policy, prefetch_bytes, max_inflight, None, o["reduce_dtype"])
    st.divide = divides(st)
    st.train = st.model.engine(*st.engine_args, divide=st.divide)
    st.eval = st.model.engine(*st.engine_args)
    for old in old_states.values():
        # A flag set on a block before the root's call is the whole model's now (compat.py).
        st.grad_sync &= old.grad_sync
        st.all_reduce &= old.all_reduce
        old.retire()
    compat_.settle_sync(st)
    st.masters = []
    st.offloaded = []
    offload = st.opts.get("offload")
    # Where the module's shards (the optimizer's) live: host memory under CPU offload.
    where = torch.device("cpu") if offload is not None else st.device
    # Page-locked only where the shards cross to a CUDA device (a host world copies host to host).
    pin = offload is not None and offload.pin_memory and st.device.type == "cuda"
    for i, (p, dtype) in enumerate(zip(st.params, dtypes)):
        region, p.offset, numel = st.model.shard(p.pid)
        data = _tensor(region, p.dtype, [numel], st.device)
        assert data.numel() == numel
        # Under mixed precision or offload the module's shard is a tensor of its own, of the
        # value's dtype (f32 under mixed precision), where it lives: this rank's elements of
        # the full value (zeros for a model without values yet), copied into the library's
        # shard at each pass's start.
        apart = dtype != p.dtype or offload is not None
        p.home = data
        mine = data
        if apart and full is None:
            mine = torch.zeros(numel, dtype=dtype, device=where)
        elif apart and dtype != p.dtype:
            mine = full[i].reshape(-1)[p.offset : p.offset + numel].to(where, copy=True)
        elif apart:
            mine = data.to(where, copy=True)
        p.own = p.shard.data = mine
        if apart:
            st.masters.append(p)
        p.shard._collsched_param = (st, p)
        p.full.requires_grad_(p.shard.requires_grad)
    del full
    if offload is not None:
        values_.pack_offloaded(st, pin)
    for m, name, pid in (s for u in st.units for s in u.slots):
        m._parameters[name] = st.params[pid].shard
    users: dict[int, int] = {}
    for u in st.units:
        for pid in u.ids:
            users[pid] = users.get(pid, 0) + 1
    for u in st.units:
        for m in u.members:
            m.__dict__["_collsched_u"] = u
        flag = u.module.__dict__.get("_collsched_reshard")
        if flag is None and u.module is root:
            # FSDP2's default: the root is kept fetched from its forward into its backward,
            # which begins with it (and a module of it run after the root's forward, a
            # chunked loss's head, finds its full parameters).
            flag = False
        set_reshard(u, after_forward(flag, st, "fully_shard"))
        u.reshard_bwd = u.module.__dict__.get("_collsched_reshard_bwd", True)
        u.swaps = [(m._parameters, name, st.params[pid].full, st.params[pid].shard) for m, name, pid in u.slots]
        u.shared = any(users[pid] > 1 for pid in u.ids)
        u.known = [0] * len(u.ids)
    if o["prefetch"] == "explicit":
        st.apply_explicit()
    st.mask = [bool(p.shard.requires_grad) for p in st.params]
    st.empty = [p for p in st.params if p.own.numel() == 0]
    st._own_grads()
    clip_.track(st)
    st.hooks = _native.Hooks(len(st.units), [p.unit for p in st.params], st._unpack_saved)
    # The first tensor-parallel parameter's spec: the other parameters are replicated over its mesh.
    st.tp_spec = next((p.tp for p in st.params if p.tp is not None), None)
    if st.tp_spec is not None:
        st.pack, st.unpack = tp_.saved_hooks(st.hooks)
    else:
        st.pack, st.unpack = st.hooks.pack, st.hooks.unpack
    try:
        post_.build(st)
    except BaseException:
        # The model stands without its post-forward layouts: those units reshard to all ranks.
        for u in st.units:
            u.post = 0
        raise
    for p, qual in originals:
        p._collsched_sharded_as = f"{qual} of {type(st.root).__name__}"


def _no_values(w: Any, metas: dict[str, bool], sync_module_states: bool) -> bool:
    """Whether the model is built without values (every parameter on the meta device, or of
    an earlier build without values): its shards are zeros until a load writes them."""
    here = any(metas.values())
    if sync_module_states:
        # Every rank's answer (collective, as the values' exchange after it): rank 0 would
        # send values to ranks that have none to take, or none to ranks that wait for them.
        flags = w.all_gather(b"1" if here else b"0")
        if any(f == b"1" for f in flags):
            ranks = [r for r, f in enumerate(flags) if f == b"1"]
            raise CollschedError(
                f"fully_shard: sync_module_states=True on a model built on the meta device (on ranks {ranks}): "
                "there are no values to send; load them (set_model_state_dict with broadcast_from_rank0=True) "
                "instead"
            )
    if not here:
        return False
    if not all(metas.values()):
        on = next(n for n, m in metas.items() if m)
        off = next(n for n, m in metas.items() if not m)
        raise CollschedError(
            f"fully_shard: parameter {on} is on the meta device and {off} is not; build the whole model on "
            "the meta device (then load its values with load_state_dict or set_model_state_dict) or none of it"
        )
    return True


def after_forward(value: Any, st: _State, what: str) -> bool | int:
    """What a unit does after its training forward, from its ``reshard_after_forward``: None
    (the caller makes it False for the root) or True, release it (True); False, keep it
    fetched into its backward (False); an int as
    FSDP2 reads it, the number of ranks its parameters are resharded to, a factor of the shard
    group's size (the world, or ``G`` of ``hybrid:G``): the size itself is True, 1 (a full
    copy kept) is False, one between is returned (``post_forward.py``); others are refused."""
    if value is None or isinstance(value, bool):
        return value is not False
    size = st.shard_group
    if value == 1:
        return False
    if value == size:
        return True
    if 1 < value < size and size % value == 0:
        declared = world_.CUDA_GROUP_SIZE
        if st.world.kind == "cuda" and declared != value:
            raise CollschedError(
                f"{what}: reshard_after_forward={value} on the cuda backend gathers within groups of {value} "
                f"ranks, whose NCCL communicators are made at init; this world was made with "
                f"hybrid_group_size={declared}: call collsched.torch.init('cuda', hybrid_group_size={value})"
            )
        return int(value)
    factors = [f for f in range(1, size + 1) if size % f == 0]
    raise CollschedError(
        f"{what}: reshard_after_forward={value}: the parameters are sharded over {size} ranks, and an int is "
        f"the number of them each unit is resharded to after its forward, a factor of {size} (as FSDP2 "
        f"requires): one of {factors} ({size} is True, 1 is False)"
    )


def set_reshard(unit: Any, want: bool | int) -> None:
    """Sets ``unit``'s flags from :func:`after_forward`'s answer."""
    resharded_to_some = not isinstance(want, bool)
    unit.reshard = True if resharded_to_some else want
    unit.post = int(want) if resharded_to_some else 0


def divides(st: Any) -> list[tuple[int, float]]:
    """``(gather bucket, factor)`` for the buckets of the parameters each unit owns, where the
    unit's module has a gradient divide factor (``set_gradient_divide_factor``): the training
    engine reduces those gradients to their sum over the ranks divided by it."""
    buckets_of: dict[str, list[int]] = {}
    for bid, (names, _) in st.gather_buckets.items():
        for n in names:
            buckets_of.setdefault(n, []).append(bid)
    out: dict[int, float] = {}
    for u in st.units:
        factor = u.module.__dict__.get("_collsched_divide")
        if factor is not None:
            for p in u.params:
                if p.unit == u.index:
                    out.update(dict.fromkeys(buckets_of.get(p.name, []), factor))
    return sorted(out.items())


def _dims(spmd: Any) -> str:
    """How a call was given ``dp_mesh_dims``, for an error."""
    if spmd is None:
        return "without dp_mesh_dims"
    names = spmd.mesh.mesh_dim_names
    return f"with dp_mesh_dims over {[names[i] for i in spmd.dp]} of mesh {names}"
