"""Gradient clipping over sharded parameters: the norm of the whole model's gradient, every
rank's elements counted once, not this rank's shard alone.

``torch.nn.utils.clip_grad_norm_`` on a rank's shards would clip each rank by the norm of its
own elements: every rank a different factor, the model no longer the one plain PyTorch trains,
and no error. Importing ``collsched.torch`` makes that function do the sharded computation when
it is given collsched's shards (other parameters go to torch's own, unchanged);
:func:`clip_grad_norm_` here is the same, called by name."""

from __future__ import annotations

import functools
import math
import struct
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
        if p.tp is None or placement.is_replicate():
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
    p = float(norm_type)
    if p <= 0 and not math.isinf(p):
        raise CollschedError(f"clip_grad_norm_: norm_type={norm_type}; expected a positive number or inf")
    # This rank's part, summed on the gradients' device and read once (one host sync).
    parts = []
    for s in shards:
        g = s.grad
        if g is None or g.numel() == 0:
            continue
        k = _replicas(*s._collsched_param)
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
            f"clip_grad_norm_: the total norm of order {norm_type} of the gradients is {total}; it cannot be "
            "clipped (pass error_if_nonfinite=False to scale by it anyway)"
        )
    coef = min(float(max_norm) / (total + 1e-6), 1.0)
    for s in shards:
        if s.grad is not None:
            s.grad.detach().mul_(coef)
    dtype = shards[0].dtype if shards else torch.float32
    device = shards[0].device if shards else torch.device("cpu")
    return torch.tensor(total, dtype=dtype, device=device)


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


def install() -> None:
    """Makes ``torch.nn.utils.clip_grad_norm_`` sharding-aware (once)."""
    from torch.nn.utils import clip_grad

    if getattr(torch.nn.utils.clip_grad_norm_, "_collsched", False):
        return
    aware = _sharding_aware(torch.nn.utils.clip_grad_norm_)
    torch.nn.utils.clip_grad_norm_ = aware
    clip_grad.clip_grad_norm_ = aware
