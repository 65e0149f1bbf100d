"""Gradient clipping over sharded parameters: the norm of the whole model's gradient, every
rank's elements counted once, not this rank's shard alone.

``torch.nn.utils.clip_grad_norm_`` on a rank's shards would clip each rank by the norm of its
own elements: every rank a different factor, the model no longer the one plain PyTorch trains,
and no error. Importing ``collsched.torch`` makes that function do the sharded computation when
it is given collsched's shards (other parameters go to torch's own, unchanged);
:func:`clip_grad_norm_` here is the same, called by name. ``torch.nn.utils.get_total_norm``
likewise, given the shards' gradients (torchtitan's clipping: the norm, then
``clip_grads_with_norm_``, which scales each gradient by it)."""

from __future__ import annotations

import functools
import math
import struct
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .._native import CollschedError
from .world import world


def _shards(parameters: Any) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The collsched shards among ``parameters`` (a module, a tensor, or an iterable of them)
    and the other tensors."""
    if isinstance(parameters, nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    shards, others = [], []
    for p in parameters:
        if getattr(p, "_collsched_param", None) is not None:
            shards.append(p)
        elif p.grad is not None:
            # Tensors without a gradient (frozen, or of an integer dtype) add nothing.
            others.append(p)
    return shards, others


def _replicas(state: Any, p: Any) -> int:
    """How many ranks of the job hold each element of parameter ``p``'s shards: the number of
    groups of a ``hybrid:G`` strategy (its shards repeat in every group), times, in a model
    with tensor-parallel parameters, the tensor-parallel ranks holding the same elements:
    those of a ``Replicate`` placement for a tensor-parallel parameter, all of them for
    another (the tensor-parallel ranks run the same model on the same batch)."""
    strategy = str(state.opts["strategy"])
    k = state.world.world // int(strategy.split(":")[1]) if strategy.startswith("hybrid:") else 1
    spec = p.tp if p.tp is not None else state.tp_spec
    if spec is None:
        return k
    for dim, placement in enumerate(spec.placements):
        # Under dp_mesh_dims the data-parallel dimensions are counted above (not replicas).
        if dim not in p.tp_dp and (p.tp is None or placement.is_replicate()):
            k *= spec.mesh.size(dim)
    return k


def clip_grad_norm_(
    parameters: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over collsched's shards (a sharded module, or its
    parameters): the ``norm_type`` norm of the gradient of the whole model (every element once,
    over every rank's shards), and every shard's ``.grad`` scaled by
    ``max_norm / (norm + 1e-6)`` where that is below 1, as torch does. Returns the norm.
    Collective: every rank calls it at the same point. Shards without ``.grad`` count as
    zeros. ``foreach`` is accepted for torch's signature.

    Raises :class:`CollschedError` when the parameters mix shards with other tensors (their
    elements' owners are unknown: clip those apart), and, with ``error_if_nonfinite``, when
    the norm is NaN or infinite."""
    del foreach
    shards, others = _shards(parameters)
    if others:
        kinds = "shards of collsched.torch.fully_shard and other tensors" if shards else "no collsched shards"
        raise CollschedError(
            f"clip_grad_norm_: the parameters given are {kinds} ({len(others)} tensors such as one of shape "
            f"{tuple(others[0].shape)}); give the sharded model's parameters alone, and clip other parameters "
            "with torch.nn.utils.clip_grad_norm_ apart"
        )
    total = _total_norm(
        [(s.grad, *s._collsched_param) for s in shards], norm_type, error_if_nonfinite, "clip_grad_norm_"
    )
    coef = min(float(max_norm) / (total + 1e-6), 1.0)
    for s in shards:
        if s.grad is not None:
            s.grad.detach().mul_(coef)
    dtype = shards[0].dtype if shards else torch.float32
    device = shards[0].device if shards else torch.device("cpu")
    return torch.tensor(total, dtype=dtype, device=device)


def _total_norm(grads: list[tuple[Any, Any, Any]], norm_type: float, error_if_nonfinite: bool, what: str) -> float:
    """The ``norm_type`` norm over every rank's elements of the gradients ``grads`` (each with
    its state and parameter; None or empty ones add nothing): this rank's part, summed on
    the gradients' device and read once, then every rank's (collective over the job)."""
    p = float(norm_type)
    if p <= 0 and not math.isinf(p):
        raise CollschedError(f"{what}: norm_type={norm_type}; expected a positive number or inf")
    parts = []
    for g, state, param in grads:
        if g is None or g.numel() == 0:
            continue
        k = _replicas(state, param)
        g64 = g.detach().to(torch.float64).abs()
        parts.append(g64.max() if math.isinf(p) else g64.pow(p).sum() / k)
    local = 0.0
    if parts:
        joined = torch.stack(parts)
        local = float(joined.max() if math.isinf(p) else joined.sum())
    every = [struct.unpack("<d", b)[0] for b in world().all_gather(struct.pack("<d", local))]
    total = max(every) if math.isinf(p) else math.fsum(every) ** (1.0 / p)
    if error_if_nonfinite and not math.isfinite(total):
        raise CollschedError(
            f"{what}: the total norm of order {norm_type} of the gradients is {total}; it cannot be "
            "clipped (pass error_if_nonfinite=False to scale by it anyway)"
        )
    return total


# Every sharded model built (its state), so that a gradient handed to get_total_norm is known
# as a shard's.
_STATES: weakref.WeakSet = weakref.WeakSet()


def track(state: Any) -> None:
    """Makes ``state``'s shards' gradients known to :func:`get_total_norm`."""
    _STATES.add(state)


def get_total_norm(
    tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` over collsched's shards' gradients (the ``.grad`` of
    a sharded model's parameters, as torchtitan's clipping gathers them before
    ``clip_grads_with_norm_``): the norm of the whole model's gradient, every element once,
    over every rank's shards. Collective: every rank calls it at the same point.
    ``foreach`` is accepted for torch's signature.

    Raises :class:`CollschedError` when the tensors mix shards' gradients with other tensors,
    and, with ``error_if_nonfinite``, when the norm is NaN or infinite."""
    del foreach
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owners = _grad_owners()
    found = [(g, *owners[id(g)]) for g in tensors if id(g) in owners]
    if len(found) != len(tensors):
        other = next(g for g in tensors if id(g) not in owners)
        raise CollschedError(
            f"get_total_norm: the tensors given are gradients of collsched shards and other tensors (one of shape "
            f"{tuple(other.shape)}); give the sharded model's gradients alone, and take other norms apart"
        )
    total = _total_norm(found, norm_type, error_if_nonfinite, "get_total_norm")
    if not tensors:
        return torch.tensor(total)
    return torch.tensor(total, dtype=tensors[0].dtype, device=tensors[0].device)


def _grad_owners() -> dict[int, tuple[Any, Any]]:
    """The state and parameter of each live shard's gradient, by the gradient's id."""
    out = {}
    for state in list(_STATES):
        for p in state.params:
            g = p.shard.grad
            if g is not None:
                out[id(g)] = (state, p)
    return out


def _sharding_aware(torch_clip: Any) -> Any:
    """``torch_clip`` (torch's ``clip_grad_norm_``) that hands collsched's shards to
    :func:`clip_grad_norm_`."""

    @functools.wraps(torch_clip)
    def clip(parameters: Any, max_norm: float, norm_type: float = 2.0, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(parameters, (nn.Module, torch.Tensor)) or not isinstance(parameters, Iterable):
            listed = parameters
        else:
            listed = list(parameters)
        if _shards(listed)[0]:
            return clip_grad_norm_(listed, max_norm, norm_type, *args, **kwargs)
        return torch_clip(listed, max_norm, norm_type, *args, **kwargs)

    clip._collsched = True  # type: ignore[attr-defined]
    return clip


def _norm_aware(torch_norm: Any) -> Any:
    """``torch_norm`` (torch's ``get_total_norm``) that hands collsched's shards' gradients to
    :func:`get_total_norm`."""

    @functools.wraps(torch_norm)
    def norm(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if listed and _STATES:
            owners = _grad_owners()
            if any(id(g) in owners for g in listed):
                return get_total_norm(listed, *args, **kwargs)
        return torch_norm(listed, *args, **kwargs)

    norm._collsched = True  # type: ignore[attr-defined]
    return norm


def install() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` and ``get_total_norm`` sharding-aware (once)."""
    from torch.nn.utils import clip_grad

    if getattr(torch.nn.utils.clip_grad_norm_, "_collsched", False):
        return
    aware = _sharding_aware(torch.nn.utils.clip_grad_norm_)
    torch.nn.utils.clip_grad_norm_ = aware
    clip_grad.clip_grad_norm_ = aware
    # torch's own clip_grad_norm_ (of other tensors) calls the module's _get_total_norm: the
    # aware one hands those back to torch's.
    norm = _norm_aware(clip_grad._get_total_norm)
    torch.nn.utils.get_total_norm = norm
    clip_grad._get_total_norm = norm
