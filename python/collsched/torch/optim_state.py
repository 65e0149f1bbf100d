"""An optimizer's ``state_dict()`` and ``load_state_dict()`` over a sharded model's parameters,
as FSDP2's are: each state tensor shaped like a parameter's shard (Adam's moments, SGD's
momentum) as a ``Shard(0)`` DTensor of the parameter's global shape (``state_dict.py``'s
placement), so ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` /
``set_optimizer_state_dict`` and ``dcp.save`` / ``dcp.load`` reshard it into any world size
or strategy; loading takes those DTensors or full values.

An optimizer over a sharded model's parameters is hooked at its first ``state_dict()``,
``load_state_dict()`` or ``step()`` (importing ``collsched.torch`` wraps torch's
``Optimizer.state_dict`` and ``load_state_dict`` to look, once per change of its parameter
groups). Both calls are collective: the save gathers each parameter's states from every rank
(one gather per parameter), the load each DTensor's full value.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._native import CollschedError
from .state_dict import _mesh, mine, place

_INSTALLED: list[Any] = []


def install() -> None:
    """Registers the global step pre-hook and wraps torch's ``Optimizer.state_dict`` and
    ``load_state_dict`` (once)."""
    if _INSTALLED:
        return
    _INSTALLED.append(register_optimizer_step_pre_hook(_on_step))
    for name in ("state_dict", "load_state_dict"):
        _INSTALLED.append(_looking(name))


def _looking(name: str) -> Any:
    """Wraps ``Optimizer.<name>`` so that it hooks the optimizer first; returns the original."""
    original = getattr(torch.optim.Optimizer, name)

    @functools.wraps(original)
    def call(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        _hook(self)
        return original(self, *args, **kwargs)

    setattr(torch.optim.Optimizer, name, call)
    return original


def _on_step(opt: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    _hook(opt)


def _hook(opt: torch.optim.Optimizer) -> None:
    """Hooks ``opt``'s state dicts when it holds a sharded model's parameters (looked at once
    per change of its parameter groups)."""
    d = opt.__dict__
    groups = len(opt.param_groups)
    if d.get("_collsched_hooked") or d.get("_collsched_groups") == groups:
        return
    d["_collsched_groups"] = groups
    if any(hasattr(p, "_collsched_param") for g in opt.param_groups for p in g["params"]):
        opt.register_state_dict_post_hook(_save)
        opt.register_load_state_dict_pre_hook(_load)
        d["_collsched_hooked"] = True


def _ours(opt: torch.optim.Optimizer) -> list[tuple[int, Any, Any]]:
    """(index in the state dict, state, parameter) of each sharded parameter of ``opt``."""
    flat = [p for g in opt.param_groups for p in g["params"]]
    out = []
    for i, t in enumerate(flat):
        found = getattr(t, "_collsched_param", None)
        if found is not None:
            out.append((i, *found))
    return out


def _sharded_keys(states: dict, p: Any) -> list[str]:
    n = p.shard.numel()
    return sorted(k for k, v in states.items() if torch.is_tensor(v) and v.dim() == 1 and v.numel() == n)


def _save(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    ours = _ours(opt)
    if not ours:
        return sd
    if len({st.part for _, st, _ in ours}) > 1:
        raise CollschedError(
            "optimizer.state_dict: the optimizer holds parameters of models sharded over different parts of the "
            "job (meshes); give each model an optimizer of its own"
        )
    mesh = _mesh(ours[0][1], "optimizer.state_dict")
    state = dict(sd["state"])
    for i, st, p in ours:
        mine = state.get(i, {})
        keys = _sharded_keys(mine, p)
        pieces: list[Any] = [None] * mesh.size()
        sharded = {k: mine[k].detach().to("cpu") for k in keys}
        mine_all = (p.offset, sharded, {k: v for k, v in mine.items() if k not in sharded})
        dist.all_gather_object(pieces, mine_all, group=mesh.get_group())
        # The keys some rank holds; a rank without state or without elements adds nothing; the
        # others' pieces must cover every element.
        union = sorted({k for piece in pieces if piece is not None for k in piece[1]})
        if not union:
            continue
        full = {k: None for k in union}
        covered = torch.zeros(p.numel, dtype=torch.bool)
        for rank, piece in enumerate(pieces):
            if not piece[1]:
                continue
            offset, values, _ = piece
            missing = [k for k in union if k not in values]
            if missing:
                raise CollschedError(
                    f"optimizer.state_dict: parameter {p.name} has state {missing} on some ranks and not on "
                    f"rank {rank}; step the optimizer on every rank alike"
                )
            for k, v in values.items():
                if full[k] is None:
                    full[k] = torch.empty(p.numel, dtype=v.dtype)
                full[k][offset : offset + v.numel()] = v
            covered[offset : offset + values[union[0]].numel()] = True
        if not bool(covered.all()):
            raise CollschedError(
                f"optimizer.state_dict: parameter {p.name}'s optimizer state is missing elements (a rank holding some "
                "has none); step the optimizer on every rank alike"
            )
        # The other states (Adam's step) are those of the first rank holding elements, on every
        # rank: a rank without elements steps none of them (its copy, if any, is stale).
        holder = next(piece for piece in pieces if any(v.numel() for v in piece[1].values()))
        out = dict(holder[2])
        for k, v in full.items():
            out[k] = place(p, v.view(p.shape).to(st.device), mesh)
        state[i] = out
    return {**sd, "state": state}


def _load(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    ours = _ours(opt)
    if not ours:
        return sd
    # The saved groups' keys (ids, or names where torch.distributed.checkpoint wrote them)
    # name this optimizer's parameters in order, as load_state_dict pairs them.
    keys = [k for g in sd.get("param_groups", []) for k in g["params"]]
    state = dict(sd.get("state", {}))
    todo = []
    for at, _, p in ours:
        if at >= len(keys):
            continue
        i = keys[at]
        # In one order on every rank: each DTensor's gather is collective.
        for k, v in sorted((state.get(i) or {}).items(), key=lambda kv: str(kv[0])):
            shape = tuple(p.global_shape)
            if isinstance(v, DTensor) or (torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == shape):
                if tuple(v.shape) != shape:
                    raise CollschedError(
                        f"optimizer.load_state_dict: state {k!r} of parameter {p.name} is a DTensor of shape "
                        f"{tuple(v.shape)}; the parameter's is {shape}; nothing was loaded"
                    )
                todo.append((i, k, p, v))
    for i, k, p, v in todo:
        state[i] = {**state[i], k: mine(p, v)}
    return {**sd, "state": state}
