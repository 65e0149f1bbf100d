"""Checkpoints of sharded modules: every rank's shards and optimizer state
(:func:`save_checkpoint`, :func:`load_checkpoint`, into any world size or strategy), and the
full parameters for export (:func:`full_state_dict`, :func:`save_full`)."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from .. import _native
from .._native import CollschedError
from . import tp as tp_
from . import values
from .module import _root_state
from .shard import _State
from .units import _tensor
from .world import _FROM_TORCH, _TO_TORCH

# The name under which a mixed-precision parameter's f32 master is saved beside its shard.
MASTER = "collsched.master"


def _between_steps(state: _State, what: str) -> None:
    if state.phase == "idle":
        # What set_reshard_after_backward(False) held since the last backward.
        state.drop_held()
    if state.phase != "idle" or any(u.fetched is not None for u in state.units):
        raise CollschedError(f"{what}: call it between steps (after the optimizer's step), not inside a pass")


def _part_path(state: Any, path: Any, part: str | None = None) -> str:
    """Where a model's checkpoint lives under ``path``: the directory ``part`` in it when given
    (a pipeline stage's name: what a job with another data-parallel size loads again); else
    ``path`` itself, or for a model sharded over part of the job (a mesh slice) the directory
    ``part-R0-R1-...``, named by the part's ranks, so that parts saving to one path never
    share files."""
    if part is not None:
        name = str(part)
        if not name or name in (".", "..") or os.sep in name:
            raise CollschedError(f"checkpoint: part={part!r}: give a directory name (a stage's, e.g. 'stage0')")
        return os.path.join(os.fspath(path), name)
    ranks = state.part
    if ranks is None:
        return os.fspath(path)
    return os.path.join(os.fspath(path), "part-" + "-".join(map(str, ranks)))


def _tp_layout(state: _State) -> dict[str, str]:
    """Each tensor-parallel parameter's placements, mesh shape and this rank's place in it,
    by name: what the local tensors a checkpoint holds were cut by (the same on every rank
    of the part: its ranks share their tensor-parallel coordinates; under ``dp_mesh_dims``
    the data-parallel dimensions' coordinates are left out)."""

    def at(p: Any) -> list[int]:
        return [c for i, c in enumerate(p.tp.mesh.get_coordinate()) if i not in p.tp_dp]

    return {
        p.name: f"{tuple(p.tp.placements)} on a mesh of shape {tuple(p.tp.mesh.shape)} at {at(p)}"
        for p in state.params
        if p.tp is not None
    }


# How a tensor among an optimizer's hyperparameters (a tensor ``lr``) is kept in the index.
_TENSOR = "collsched.tensor"


def _encode(v: Any) -> Any:
    """A parameter group's hyperparameter as the index keeps it (JSON): a tensor as its values
    and dtype, tuples and lists element by element; what JSON has no form for is written as
    its text (and refused at load, see :func:`_decode`)."""
    if torch.is_tensor(v):
        return {_TENSOR: v.detach().cpu().tolist(), "dtype": str(v.dtype).removeprefix("torch.")}
    if isinstance(v, (tuple, list)):
        return [_encode(x) for x in v]
    return v


def _decode(v: Any, now: Any) -> Any:
    """The hyperparameter :func:`_encode` kept, as the optimizer's own value ``now`` has it: a
    tensor again (on ``now``'s device), a tuple where ``now`` is one. A value kept as text
    where the optimizer holds no text is refused by name, not handed to it."""
    if isinstance(v, dict) and _TENSOR in v:
        device = now.device if torch.is_tensor(now) else "cpu"
        return torch.tensor(v[_TENSOR], dtype=getattr(torch, v["dtype"]), device=device)
    if isinstance(v, list):
        like = list(now) if isinstance(now, (tuple, list)) and len(now) == len(v) else [None] * len(v)
        out = [_decode(x, n) for x, n in zip(v, like)]
        return tuple(out) if isinstance(now, tuple) else out
    if isinstance(v, str) and now is not None and not isinstance(now, str):
        raise CollschedError(
            f"load_checkpoint: an optimizer hyperparameter was saved as the text {v!r} (a type the index has no "
            f"form for), and this optimizer holds {type(now).__name__} {now!r} there; give it as a number or a "
            "tensor when saving"
        )
    return v


def _groups(index: dict, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyperparameters ``index`` keeps for each of ``optimizer``'s parameter groups, as its
    own values have them (:func:`_decode`)."""
    kept = ((index.get("meta") or {}).get("optimizer") or {}).get("groups", [])
    return [{k: _decode(v, g.get(k)) for k, v in s.items()} for g, s in zip(optimizer.param_groups, kept)]


def save_checkpoint(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, path: Any, step: int = 0, *, part: str | None = None
) -> dict:
    """Saves ``module``'s shards, and ``optimizer``'s state of them, to the directory ``path``
    (collective: every rank calls it, between steps). Each rank writes only its own elements
    (safetensors); the index is written last and the directory renamed into place, so an
    interrupted save leaves the previous checkpoint at ``path`` whole. Tensor states shaped
    like a shard (Adam's moments) are saved per element; scalar ones (``step``) and the
    parameter groups' hyperparameters go into the index. A model sharded over part of the job
    saves into ``path/part-R0-R1-...`` (its ranks), or ``path/PART`` with ``part`` (a stage's
    name, which a job of another data-parallel size gives to ``load_checkpoint``). Returns the
    index."""
    state = _root_state(module)
    _between_steps(state, "save_checkpoint")
    keep, extras, scalars = [], [], {}
    groups: list[dict] = []
    # Mixed precision: the library saves its shards of the gather dtype; the f32 masters go
    # beside them, per element, as a state of their own.
    values.push_masters(state)
    for p in state.masters:
        v = p.shard.detach().to("cpu").contiguous()
        keep.append(v)
        extras.append((MASTER, p.pid, _FROM_TORCH[v.dtype], v))
    if optimizer is not None:
        for p in state.params:
            st = optimizer.state.get(p.shard) or {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == p.shard.numel() and v.dtype in _FROM_TORCH:
                    # The library reads states from host memory.
                    v = v.detach().to("cpu").contiguous()
                    keep.append(v)
                    extras.append((k, p.pid, _FROM_TORCH[v.dtype], v))
                elif p.shard.numel() == 0:
                    # A rank holding no element of it steps none: its scalars (if any) are stale.
                    continue
                elif torch.is_tensor(v) and v.numel() == 1:
                    scalars.setdefault(p.name, {})[k] = {
                        "value": v.item(),
                        "dtype": str(v.dtype).removeprefix("torch."),
                    }
                elif isinstance(v, (int, float)):
                    scalars.setdefault(p.name, {})[k] = {"value": v}
        groups = [{k: _encode(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    # Scalar states come from the ranks holding elements of their parameter (all alike).
    merged: dict[str, Any] = {}
    for blob in state.world.all_gather(json.dumps(scalars).encode()):
        merged.update(json.loads(blob))
    meta: dict[str, Any] = {"optimizer": {"groups": groups, "scalars": merged}} if optimizer is not None else {}
    if state.tp_spec is not None:
        meta["tp"] = _tp_layout(state)
    text = state.model.save(_part_path(state, path, part), int(step), extras, json.dumps(meta, default=str))
    del keep
    return json.loads(text)


def load_checkpoint(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, path: Any, *, part: str | None = None
) -> dict:
    """Loads the checkpoint at ``path`` into ``module``'s shards (collective: every rank calls
    it, between steps), whatever world size, strategy and bucket size saved it: each rank reads
    only the elements it holds. With ``optimizer``, its state of each shard and its groups'
    hyperparameters come back too. A checkpoint that does not fit (a parameter missing, extra,
    of another shape or dtype), is incomplete or damaged raises ``CollschedError`` naming it,
    and nothing changes. ``part``: the directory under ``path`` ``save_checkpoint`` was given
    (a stage's name), else as it names one. Returns the index."""
    state = _root_state(module)
    state.meta = False
    where = _part_path(state, path, part)
    # Where the library reads it (PATH.partial while a commit is stopped between its renames).
    held = os.fspath(_native.checkpoint_dir(where))
    if part is None and state.part is not None and not os.path.exists(held) and os.path.isdir(path):
        parts = sorted(d for d in os.listdir(path) if os.path.isfile(os.path.join(path, d, "index.json")))
        raise CollschedError(
            f"load_checkpoint: no checkpoint of this model's part (ranks {list(state.part)}) at {where}; {path} holds "
            f"{parts or 'none'}: a part saved by other ranks (another data-parallel size) loads with part=NAME, "
            "given to save_checkpoint as well; nothing was loaded"
        )
    _between_steps(state, "load_checkpoint")
    try:
        with open(os.path.join(held, "index.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = None  # the library's load names what is wrong, on every rank
    layout = ((saved or {}).get("meta") or {}).get("tp")
    if saved is not None and (state.tp_spec is not None or layout is not None):
        mine = _tp_layout(state) if state.tp_spec is not None else {}
        saved_layout = layout or {}
        differ = [n for n in sorted(set(mine) | set(saved_layout)) if mine.get(n) != saved_layout.get(n)]
        if differ:
            n = differ[0]
            raise CollschedError(
                f"load_checkpoint: the checkpoint at {where} holds parameter {n} cut "
                f"{saved_layout.get(n, 'without tensor parallelism')}, this model's is "
                f"{mine.get(n, 'not tensor-parallel')} ({len(differ)} parameters differ); a checkpoint of "
                "save_checkpoint reloads at its own tensor-parallel layout: change the layout through "
                "torch.distributed.checkpoint (dcp.save of model.state_dict(), dcp.load) instead; nothing was loaded"
            )
    if saved is not None and optimizer is not None:
        _groups(saved, optimizer)  # a hyperparameter it cannot give back is refused before anything changes
    names = {e["name"] for e in (saved or {}).get("extras", [])}
    wanted = [
        (p.pid, n.split("#", 1)[1])
        for p in state.params
        if p.shard.numel() > 0
        for n in names
        if n.split("#", 1)[0] == p.name
    ]
    text, states = state.model.load(where, wanted)
    index = json.loads(text)
    if (saved or {}).get("save") != index.get("save") or (saved is None and index.get("extras")):
        # The index this function read first (what it asked the library for) is not the one
        # loaded: the checkpoint was replaced meanwhile, and states may be left out.
        raise CollschedError(
            f"load_checkpoint: the checkpoint at {where} was replaced while it was loaded (save "
            f"{(saved or {}).get('save')} then {index.get('save')}); the shards hold the later one's values, "
            "the optimizer's states may not: load again"
        )
    masters = {pid: got for (pid, name), got in zip(wanted, states) if name == MASTER and got is not None}
    with torch.no_grad():
        for p in state.masters:
            got = masters.get(p.pid)
            if got is None:
                # Saved without mixed precision: the loaded shard, cast up.
                p.shard.copy_(p.home)
            else:
                p.shard.copy_(torch.frombuffer(got[1], dtype=_TO_TORCH[got[0]]))
    if optimizer is None:
        return index
    meta = (index.get("meta") or {}).get("optimizer") or {}
    for g, kept in zip(optimizer.param_groups, _groups(index, optimizer)):
        g.update(kept)
    for (pid, name), got in zip(wanted, states):
        if got is not None and name != MASTER:
            dtype, data = got
            shard = state.params[pid].shard
            optimizer.state[shard][name] = torch.frombuffer(data, dtype=_TO_TORCH[dtype]).to(shard.device)
    scalars = meta.get("scalars", {})
    for p in state.params:
        if p.shard.numel() == 0 or p.shard not in optimizer.state:
            continue
        for k, v in scalars.get(p.name, {}).items():
            if "dtype" in v:
                # Adam keeps `step` on the CPU unless it is capturable or fused; as torch makes it.
                optimizer.state[p.shard][k] = torch.tensor(v["value"], dtype=getattr(torch, v["dtype"]))
            else:
                optimizer.state[p.shard][k] = v["value"]
    return index


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value by name (copies; tied parameters once), gathered one
    bucket at a time, so the memory beyond the result is one bucket's gathered buffers.
    Collective: every rank calls it, between steps."""
    state = _root_state(module)
    _between_steps(state, "full_state_dict")
    values.push_masters(state)
    by_name = {p.name: p for p in state.params}
    out: dict[str, torch.Tensor] = {}
    for names, _ in state.gather_buckets.values():
        ids = [by_name[n].pid for n in names]
        regions = state.eval.fetch(ids)
        for pid, region in zip(ids, regions):
            p = state.params[pid]
            out[p.name] = _tensor(region, p.dtype, p.shape, state.device).clone()
        state.eval.release(ids)
        state.eval.end_step()
    for pid, v in values.master_values(state).items():
        out[state.params[pid].name] = v
    # A tensor-parallel parameter's global value: its local tensors gathered over its mesh.
    return {p.name: out[p.name] if p.tp is None else tp_.full_value(out[p.name], p.tp) for p in state.params}


def save_full(module: nn.Module, path: Any) -> None:
    """Writes every parameter's full value to one safetensors file at ``path``, which plain
    PyTorch loads into the unsharded model (``safetensors.torch.load_file`` then
    ``load_state_dict``; tied parameters appear once, under their first name). Gathers one
    bucket at a time; rank 0 writes. Collective: every rank calls it, between steps."""
    state = _root_state(module)
    _between_steps(state, "save_full")
    if state.tp_spec is not None:
        raise CollschedError(
            "save_full: the model has tensor-parallel parameters, and the library holds their local tensors alone; "
            "write cst.full_state_dict(module) (their global values) with safetensors.torch.save_file on rank 0"
        )
    if any(p.own.dtype != p.dtype for p in state.masters):
        raise CollschedError(
            "save_full: the model gathers in its mixed-precision param_dtype, and the file would hold those values; "
            "write cst.full_state_dict(module) (the f32 masters) with safetensors.torch.save_file on rank 0"
        )
    # CPU offload: the library's shards take the module's values first.
    values.push_masters(state)
    state.model.save_full(str(path))
