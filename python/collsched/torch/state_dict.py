"""``state_dict()`` and ``load_state_dict()`` of a sharded model as FSDP2 gives them.

``module.state_dict()`` (of the root or of any module under it) gives each sharded parameter
as a DTensor over torch.distributed's default group: ``Shard(0)`` (this rank's rows, cut as
``torch.chunk`` cuts them; a 0-dim parameter ``Replicate()``) with the parameter's global
shape, and in the shard's dtype (under mixed precision the f32 master), whatever the
strategy: the rows are cut from the gathered values, one gather per module. It is collective
(every rank calls it, between steps) and needs ``torch.distributed`` initialized over the
same ranks (``init_process_group("collsched")``, ``"gloo"`` or ``"nccl"``);
:func:`collsched.torch.full_state_dict` and :func:`collsched.torch.save_checkpoint` need not.

``module.load_state_dict(sd)`` takes, per sharded parameter, its full value (a tensor of the
parameter's shape, on every rank) or a DTensor of it (any placement, gathered with
``full_tensor()``: collective); each rank keeps its own elements. So
``torch.distributed.checkpoint``'s ``dcp.save`` / ``dcp.load`` and its
``get_model_state_dict`` / ``set_model_state_dict`` (``full_state_dict``,
``broadcast_from_rank0``) work on a sharded model, into any world size or strategy.
``assign=True`` is refused: it would replace the shards that live in collsched's memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._native import CollschedError
from . import tp as tp_
from . import values as values_
from .units import _Param, _tensor
from .world import world

# The meshes state dicts are made over, by (device type, default group's name).
_MESHES: dict[tuple[str, str], Any] = {}


def install(state: Any) -> None:
    """Hooks the ``state_dict`` and ``load_state_dict`` of every module holding ``state``'s
    parameters (once per module; the hooks find the parameters' current state themselves)."""
    for unit in state.units:
        for m, name, _ in unit.slots:
            names: set[str] | None = m.__dict__.get("_collsched_sd")
            if names is None:
                names = m.__dict__["_collsched_sd"] = set()
                m._register_state_dict_hook(_save_hook)
                m._register_load_state_dict_pre_hook(_load_hook, with_module=True)
            names.add(name)
    # The root's hook checks a whole load first, even where the root holds no parameter itself.
    if "_collsched_sd" not in state.root.__dict__:
        state.root.__dict__["_collsched_sd"] = set()
        state.root._register_state_dict_hook(_save_hook)
        state.root._register_load_state_dict_pre_hook(_load_hook, with_module=True)


def _sharded(module: nn.Module, what: str) -> list[tuple[str, Any, _Param]]:
    """``module``'s own sharded parameters: (name, state, parameter)."""
    out = []
    for name in sorted(module.__dict__.get("_collsched_sd", ())):
        t = module._parameters.get(name)
        if t is None:
            continue
        found = getattr(t, "_collsched_param", None)
        if found is None:
            raise CollschedError(
                f"{what}: {type(module).__name__}.{name} holds its full value: a forward or backward is running, "
                "unshard() was called without reshard(), or set_reshard_after_backward(False) holds it since a "
                "backward under no_sync; call it between synchronized steps, after reshard()"
            )
        st, p = found
        if st.model is None:
            raise CollschedError(f"{what}: {type(module).__name__}'s sharding was taken over by a root's fully_shard")
        if st.phase != "idle" or st.unsynced or any(u.fetched is not None for u in st.units):
            raise CollschedError(
                f"{what}: call it between synchronized steps (after the optimizer's step, not between no_sync "
                "micro-batches or inside a pass)"
            )
        out.append((name, st, p))
    return out


def _mesh(st: Any, what: str) -> Any:
    """The 1-D mesh a state dict's DTensors of ``st`` are placed on: the job's default group,
    or the mesh of a model sharded over part of the job (under dp_mesh_dims, its shard dimension)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    device = st.device
    w = world()
    if st.part is not None or st.opts.get("spmd") is not None:
        mesh = st.opts["mesh"]
        if mesh.ndim != 1:
            raise CollschedError(
                f"{what}: the model is sharded over part of the job on a {mesh.ndim}-D mesh; its state dict is "
                "DTensors on a 1-D mesh of the part alone: use collsched.torch.full_state_dict or save_checkpoint"
            )
        return mesh
    if not dist.is_initialized():
        raise CollschedError(
            f"{what}: a sharded model's state dict is DTensors over torch.distributed's default group, which is "
            "not initialized; call torch.distributed.init_process_group('collsched') (or 'gloo', 'nccl') on every "
            "rank first, or use collsched.torch.full_state_dict (full values) or save_checkpoint"
        )
    if dist.get_world_size() != w.world or dist.get_rank() != w.rank:
        raise CollschedError(
            f"{what}: torch.distributed's default group is rank {dist.get_rank()} of {dist.get_world_size()}, "
            f"collsched's world rank {w.rank} of {w.world}; a state dict's DTensors need the same ranks"
        )
    group = dist.group.WORLD
    key = (device.type, group.group_name)
    mesh = _MESHES.get(key)
    if mesh is None or mesh.get_group() is not group:
        mesh = _MESHES[key] = DeviceMesh.from_group(group, device.type)
    return mesh


def _rows(full: torch.Tensor, mesh: Any) -> tuple[torch.Tensor, list[Any]]:
    """This rank's part of ``full`` as ``Shard(0)`` places it over ``mesh`` (``torch.chunk``'s
    rows: ``ceil(rows / ranks)`` each, the last ranks' fewer or none), a copy, and the
    placements; a 0-dim value is ``Replicate()``d."""
    from torch.distributed.tensor import Replicate, Shard

    if full.dim() == 0:
        return full.clone(), [Replicate()]
    rank, n = mesh.get_local_rank(), mesh.size()
    rows = -(-full.shape[0] // n)
    lo, hi = min(full.shape[0], rank * rows), min(full.shape[0], (rank + 1) * rows)
    return full[lo:hi].clone(), [Shard(0)]


def _save_hook(module: nn.Module, sd: dict[str, Any], prefix: str, _meta: Any) -> None:

    entries = _sharded(module, "state_dict")
    if not entries:
        return
    st = entries[0][1]
    mesh = _mesh(st, "state_dict")
    params = list({p.pid: p for _, _, p in entries}.values())
    placed: dict[int, Any] = {}

    def keep(p: _Param, full: torch.Tensor) -> None:
        placed[p.pid] = place(p, full.to(p.shard.dtype), mesh)

    masters = {p.pid for p in st.masters}
    for pid, full in values_.master_values(st, [p for p in params if p.pid in masters]).items():
        keep(st.params[pid], full)
    ids = [p.pid for p in params if p.pid not in masters]
    if ids:
        regions = st.eval.fetch(ids)
        try:
            for pid, region in zip(ids, regions):
                p = st.params[pid]
                keep(p, _tensor(region, p.dtype, p.shape, st.device))
        finally:
            st.eval.release(ids)
            st.eval.end_step()
    for name, _, p in entries:
        sd[prefix + name] = placed[p.pid]


def place(p: _Param, full: torch.Tensor, mesh: Any) -> Any:
    """The state dict's DTensor of ``p`` from ``full`` (its value as the library holds it,
    gathered over ``mesh``'s ranks): ``Shard(0)`` over ``mesh``, of the parameter's global
    shape; a tensor-parallel parameter's on the mesh of its tensor-parallel dimensions and
    ``mesh`` (``tp.py``)."""
    from torch.distributed.tensor import DTensor

    if p.tp is not None:
        return tp_.place(full, p.tp, mesh, _rows, p.spmd)
    t, placements = _rows(full, mesh)
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def mine(p: _Param, v: torch.Tensor) -> torch.Tensor:
    """This rank's elements of ``p`` (a copy, 1-D) from ``v``, a value of the parameter's global
    shape or a DTensor of it (gathered with ``full_tensor()``: collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v.full_tensor()
    if p.tp is not None:
        v = tp_.local_of(v, p.tp)
    n = p.shard.numel()
    # A copy: a DTensor's gathered full value is freed before the next one is gathered.
    return v.detach().reshape(-1)[p.offset : p.offset + n].clone()


def _load_hook(
    module: nn.Module,
    sd: dict[str, Any],
    prefix: str,
    meta: Any,
    _strict: bool,
    _missing: list[str],
    _unexpected: list[str],
    _errors: list[str],
) -> None:
    """The first of these hooks a load reaches (the outermost sharded module) checks every
    sharded parameter's value under it before any is copied (a refused load changes nothing),
    then puts each rank's elements in their place; the hooks below find them done."""

    todo = []
    for mname, m in module.named_modules(prefix=prefix[:-1], remove_duplicate=False):
        for name, st, p in _sharded(m, "load_state_dict"):
            key = f"{mname}.{name}" if mname else name
            v = sd.get(key)
            if v is None or getattr(v, "_collsched_loaded", False):
                continue
            todo.append((key, st, p, v))
    if todo and meta.get("assign_to_params_buffers", False):
        raise CollschedError(
            f"load_state_dict(assign=True) into {type(module).__name__}: a sharded model's parameters live in "
            "collsched's memory and are copied into, never replaced; load without assign"
        )
    for key, _, p, v in todo:
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(p.global_shape):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise CollschedError(
                f"load_state_dict: {key} is {got}; a sharded parameter loads its full value (shape "
                f"{tuple(p.global_shape)}) or a DTensor of it (a local 1-D shard is not one: load those with "
                "collsched.torch.load_checkpoint); nothing was loaded"
            )
    for key, st, p, v in todo:
        st.meta = False
        elements = mine(p, v)
        elements._collsched_loaded = True
        sd[key] = elements
