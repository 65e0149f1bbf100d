"""Tensor-parallel parameters under ``fully_shard`` (FSDP2's 2-D dp x tp sharding).

``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ...) makes a module's
parameters DTensors on a tensor-parallel mesh; ``fully_shard(module, mesh=world_mesh["dp"])``
then shards each one's local tensor over the data-parallel ranks as it shards any parameter.
In the modules, between steps, a parameter is this rank's 1-D shard of its local tensor; in a
pass, it is a DTensor of the tensor-parallel spec whose local tensor views the gathered buffer
(the library's memory), so the module's forward runs on DTensors as it did before sharding.
Its gradient, a DTensor, is redistributed to the parameter's placements (a ``Partial`` one
reduced over the tensor-parallel ranks, as FSDP2 does) and its local tensor reduced over the
data-parallel ranks. Saved tensors of the graph that are DTensors viewing a gathered parameter
are saved as references too (:func:`saved_hooks`). State dicts give DTensors on the mesh of
the data-parallel dimension followed by the tensor-parallel ones (:func:`place`; under
``dp_mesh_dims``, on the parameters' own mesh).

FSDP2's other form, ``fully_shard(module, mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(...))``
(:func:`spmd_mesh`), takes parameters that are DTensors on the whole mesh, ``Replicate`` on
its data-parallel dimensions: the same sharding of their local tensors over those dimensions,
a pass's parameters DTensors of their own specs (on the whole mesh), and gradients reduced over
the data-parallel ranks as they are on those dimensions (a ``Partial`` there is this rank's
part, averaged as any gradient; redistributed over the other dimensions alone)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from .._native import CollschedError


def is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


@dataclasses.dataclass(frozen=True)
class Spmd:
    """``dp_mesh_dims`` over ``mesh``: the indices of its data-parallel dimensions, ``shard``
    (the ones the parameters are sharded over, flattened into one in mesh order; none: DDP)
    and ``dp`` (those and the replicate ones); and the layout of a state dict's DTensors (as
    FSDP2 places them): on ``sd_mesh`` (``mesh`` itself unless several dimensions are
    flattened, then ``mesh`` with those replaced by their flattened mesh, and under HSDP the
    replicate ones by ``Replicate()`` beside it), dimension ``i`` of it taking the placement of
    the parameter's dimension ``take[i]`` (-1: ``Replicate()``), the shard placement at
    ``at`` (None: DDP), its rows cut over ``cut`` (the 1-D mesh of the shard dimensions, or of
    the replicate ones for DDP)."""

    mesh: Any
    shard: tuple[int, ...]
    dp: tuple[int, ...]
    sd_mesh: Any = dataclasses.field(compare=False)
    take: tuple[int, ...]
    at: int | None
    cut: Any = dataclasses.field(compare=False)


def _names(given: Any) -> tuple[str, ...]:
    if given is None:
        return ()
    return (given,) if isinstance(given, str) else tuple(given)


def spmd_mesh(mesh: Any, dims: Any) -> tuple[Any, Spmd, str | None]:
    """The data-parallel mesh of FSDP2's ``dp_mesh_dims`` (a ``DataParallelMeshDims``, or
    anything with its ``shard`` and ``replicate``) over ``mesh`` (the whole SPMD mesh): 1-D
    over the shard dimensions, ``(replicate, shard)`` for HSDP, 1-D over the replicate ones for
    DDP (strategy ``hybrid:1``, the third value; None: as given), several names of one kind
    flattened into one dimension as FSDP2 does; and the :class:`Spmd`. Refused by name where
    the mesh or the names do not fit."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        raise CollschedError(
            f"fully_shard: dp_mesh_dims={dims!r} needs mesh= the whole SPMD DeviceMesh, with mesh_dim_names; "
            f"got mesh={mesh!r}"
        )
    shard = _names(getattr(dims, "shard", None))
    replicate = _names(getattr(dims, "replicate", None))
    names = tuple(mesh.mesh_dim_names)
    if not shard and not replicate:
        raise CollschedError(f"fully_shard: dp_mesh_dims={dims!r} names no dimension; name shard=, replicate= or both")
    for n in shard + replicate:
        if n not in names:
            raise CollschedError(
                f"fully_shard: dp_mesh_dims names dimension {n!r}, which mesh of dimensions {names} lacks"
            )
    # A name given for both kinds, or twice in one.
    both = sorted({n for n in shard + replicate if (shard + replicate).count(n) > 1})
    if both:
        raise CollschedError(
            f"fully_shard: dp_mesh_dims={dims!r} names {both[0]!r} twice (to shard over and to replicate over, or "
            "twice in one); name each dimension once"
        )

    def flat(group: tuple[str, ...], what: str) -> Any:
        at = [names.index(n) for n in group]
        if at != list(range(at[0], at[0] + len(at))):
            raise CollschedError(
                f"fully_shard: dp_mesh_dims.{what}={group!r} are not neighbouring dimensions in mesh order "
                f"{names}; several names are flattened into one dimension, as FSDP2 does: give them in the "
                "mesh's order, side by side"
            )
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    strategy = None
    if not shard:
        # DDP: every rank holds whole parameters (groups of one), gradients all-reduced.
        dp_mesh, strategy = flat(replicate, "replicate"), "hybrid:1"
        cut = dp_mesh
    elif not replicate:
        dp_mesh = cut = flat(shard, "shard")
    else:
        # HSDP: (replicate, shard) whatever order the mesh has them in (as FSDP2 makes it).
        cut = flat(shard, "shard")
        dp_mesh = DeviceMesh._concatenate([flat(replicate, "replicate"), cut])
    index = tuple(names.index(n) for n in shard)
    dp = tuple(names.index(n) for n in replicate) + index
    if len(shard) <= 1:
        sd_mesh, take, at = mesh, tuple(range(len(names))), (index[0] if index else None)
    else:
        # As FSDP2's sharded spec: the shard dimensions replaced by their flattened mesh (HSDP:
        # the (replicate, shard) mesh, the replicate dimensions dropped where they were).
        subs, take_, at = [], [], 0
        for i, n in enumerate(names):
            if i in index[1:] or (replicate and n in replicate):
                continue
            if i == index[0]:
                subs.append(dp_mesh)
                if replicate:
                    take_.append(-1)
                at = len(take_)
                take_.append(i)
            else:
                subs.append(mesh[n])
                take_.append(i)
        sd_mesh, take = DeviceMesh._concatenate(subs), tuple(take_)
    return dp_mesh, Spmd(mesh, index, dp, sd_mesh, take, at, cut), strategy


def spec_of(p: Any, qual: str, dp_ranks: list[int], rank: int, dtype: torch.dtype, spmd: Spmd | None = None) -> Any:
    """The spec of tensor-parallel parameter ``p`` (a DTensor) that its gathered value takes,
    of ``dtype`` (the gathers' dtype); refused by name where collsched cannot shard it: a
    placement other than ``Shard`` or ``Replicate``, or a mesh that shares ranks with the
    data-parallel ones (``dp_ranks``) beside this rank; under ``dp_mesh_dims`` (``spmd``), a
    mesh other than the one given, or a data-parallel dimension it is not ``Replicate`` on."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    spec = p._spec
    odd = [pl for pl in spec.placements if type(pl) not in (Shard, Replicate)]
    if odd:
        raise CollschedError(
            f"fully_shard: parameter {qual} is a DTensor placed {tuple(spec.placements)}; collsched shards "
            f"tensor-parallel parameters placed Shard or Replicate, not {odd[0]}: redistribute it first"
        )
    tp_ranks = spec.mesh.mesh.flatten().tolist()
    if spmd is not None:
        if spec.mesh != spmd.mesh:
            raise CollschedError(
                f"fully_shard: parameter {qual} is a DTensor on a mesh of shape {tuple(spec.mesh.shape)} "
                f"{spec.mesh.mesh_dim_names}, not the mesh given with dp_mesh_dims; put every parameter on that mesh"
            )
        placed = [spec.placements[i] for i in spmd.dp]
        if any(not isinstance(pl, Replicate) for pl in placed):
            raise CollschedError(
                f"fully_shard: parameter {qual} is placed {tuple(spec.placements)} on mesh "
                f"{spec.mesh.mesh_dim_names}; under dp_mesh_dims it must be Replicate() on the data-parallel "
                f"dimensions {[spec.mesh.mesh_dim_names[i] for i in spmd.dp]} (collsched shards it there)"
            )
        tp_ranks = [rank]
    both = sorted(set(tp_ranks) & set(dp_ranks) - {rank})
    if both:
        raise CollschedError(
            f"fully_shard: parameter {qual} is a DTensor on a mesh of ranks {tp_ranks}, and the model is sharded "
            f"over ranks {dp_ranks}: ranks {both} would be in both; shard over the data-parallel dimension alone "
            "(fully_shard(module, mesh=world_mesh['dp']) with parallelize_module on world_mesh['tp']), or, for "
            "DTensors on the whole mesh, fully_shard(module, mesh=world_mesh, "
            "dp_mesh_dims=DataParallelMeshDims(shard='dp'))"
        )
    return dataclasses.replace(spec, tensor_meta=TensorMeta(spec.shape, spec.stride, dtype))


def full_param(placeholder: torch.Tensor, spec: Any) -> nn.Parameter:
    """The parameter a pass puts in the modules: a DTensor of ``spec`` whose local tensor is
    ``placeholder`` until a fetch points it at the gathered buffer (``_Param.point``)."""
    from torch.distributed.tensor import DTensor

    return nn.Parameter(DTensor(placeholder, spec, requires_grad=False), requires_grad=False)


def settled(g: Any, spec: Any, name: str) -> Any:
    """A gradient of a tensor-parallel parameter as autograd left it: a DTensor (a functional
    collective's result waited for), its placements as they are (``Partial`` stays: no_sync
    micro-batches sum such gradients before :func:`local_grad` redistributes them once)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(g, AsyncCollectiveTensor):
        g = g.wait()
    if not is_dtensor(g):
        raise CollschedError(
            f"backward: the gradient of tensor-parallel parameter {name} is a {type(g).__name__}, not a "
            f"DTensor placed {tuple(spec.placements)}; a hook that replaced it must give a DTensor of the "
            "parameter's spec"
        )
    return g


def add_into(acc: Any, g: Any, spec: Any, name: str, keep: tuple[int, ...] = ()) -> Any:
    """``acc += g`` for two gradients of one parameter; of a tensor-parallel one (``spec``
    not None), ``g`` redistributed to ``acc``'s placements where autograd left it otherwise,
    except on the mesh dimensions ``keep`` (``dp_mesh_dims``': there the local tensors add, each
    this rank's part, as :func:`local_grad` hands them)."""
    if spec is None:
        return acc.add_(g)
    g = settled(g, spec, name)
    want = tuple(g.placements[i] if i in keep else pl for i, pl in enumerate(acc.placements))
    if tuple(g.placements) != want:
        g = g.redistribute(acc.device_mesh, want)
    if keep and want != tuple(acc.placements):
        acc._local_tensor.add_(g._local_tensor)
        return acc
    return acc.add_(g)


def local_grad(g: Any, spec: Any, name: str, keep: tuple[int, ...] = ()) -> torch.Tensor:
    """The local tensor of a gradient of a tensor-parallel parameter, redistributed to the
    parameter's placements first where autograd left it otherwise (``Partial``: collective
    over the tensor-parallel ranks, which all hand the same gradients in the same order),
    except on the mesh dimensions ``keep`` (``dp_mesh_dims``': the library reduces there)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    g = settled(g, spec, name)
    want = tuple(g.placements[i] if i in keep else pl for i, pl in enumerate(spec.placements))
    if tuple(g.placements) != want:
        g = g.redistribute(spec.mesh, want)
    local = g._local_tensor
    # A functional collective's result is read by address below: wait for it first.
    return local.wait() if isinstance(local, AsyncCollectiveTensor) else local


class _Saved:
    """A saved DTensor whose local tensor is a reference to a gathered parameter."""

    __slots__ = ("inner", "spec", "requires_grad")

    def __init__(self, inner: Any, spec: Any, requires_grad: bool) -> None:
        self.inner = inner
        self.spec = spec
        self.requires_grad = requires_grad


def saved_hooks(hooks: Any) -> tuple[Any, Any]:
    """The saved-tensor hooks of a model with tensor-parallel parameters: the native ``hooks``
    for plain tensors, and for a DTensor, a reference where its local tensor views a gathered
    parameter (the native hooks decide, and unpack it: the unit fetched again if released);
    otherwise the DTensor, detached where it has a ``grad_fn`` (as the native hook does)."""
    from torch.distributed.tensor import DTensor

    native_pack, native_unpack = hooks.pack, hooks.unpack

    def pack(t: Any) -> Any:
        if not isinstance(t, DTensor):
            return native_pack(t)
        inner = native_pack(t._local_tensor)
        if not isinstance(inner, torch.Tensor):
            return _Saved(inner, t._spec, t.requires_grad)
        return t.detach() if t.grad_fn is not None else t

    def unpack(x: Any) -> Any:
        if type(x) is _Saved:
            return DTensor(native_unpack(x.inner), x.spec, requires_grad=x.requires_grad)
        return native_unpack(x)

    return pack, unpack


# The meshes of the data-parallel dimension followed by the tensor-parallel ones, by the two
# meshes' ids, with the two meshes (held: an id is another mesh's once its mesh is freed).
_MESHES: dict[tuple[int, int], tuple[Any, Any, Any]] = {}


def place(local: torch.Tensor, spec: Any, dp_mesh: Any, rows: Any, spmd: Spmd | None = None) -> Any:
    """A state dict's DTensor of a tensor-parallel parameter of ``spec`` from ``local`` (this
    rank's whole local tensor, gathered over the data-parallel ranks): on the mesh of the
    data-parallel dimension followed by the tensor-parallel ones (FSDP2's), of the parameter's
    global shape; this rank holds its rows of the local tensor (cut by ``rows``, state_dict.py's
    cut), which is ``Shard(0)`` over the data-parallel ranks, or, where the tensor-parallel
    ranks shard rows first, ``_StridedShard(0)`` (as FSDP2 places it), or, where they cut
    the rows unevenly, ``Replicate()`` (the whole local tensor). Under ``dp_mesh_dims``
    (``spmd``), on its ``sd_mesh``, the shard placement so chosen at its ``at`` (the mesh
    dimensions after the shard ones are those cutting rows first); under its DDP form, the
    parameter's own spec (whole local tensors)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if spmd is None:
        key = (id(dp_mesh), id(spec.mesh))
        known = _MESHES.get(key)
        if known is None or known[0] is not dp_mesh or known[1] is not spec.mesh:
            known = _MESHES[key] = (dp_mesh, spec.mesh, DeviceMesh._concatenate([dp_mesh, spec.mesh]))
        # The tensor-parallel dimensions all come after the data-parallel one.
        mesh, at, placements = known[2], 0, [Replicate(), *spec.placements]
        after = range(len(spec.placements))
    elif spmd.at is None:
        return DTensor.from_local(
            local.clone(), spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
    else:
        mesh, at = spmd.sd_mesh, spmd.at
        placements = [Replicate() if i < 0 else spec.placements[i] for i in spmd.take]
        after = [d for d in range(spmd.shard[-1] + 1, len(spec.placements)) if d not in spmd.dp]
    split = 1
    for dim in after:
        placement = spec.placements[dim]
        if isinstance(placement, Shard) and placement.dim == 0:
            split *= spec.mesh.size(dim)
    if split > 1 and spec.shape[0] % split:
        # DTensor reads _StridedShard as equal pieces of rows, one a tensor-parallel rank,
        # cut alike over dp: with rows the tensor-parallel ranks cut unevenly, the rows of a
        # dp rank would be placed on other tp ranks. Whole local tensors, replicated over dp.
        return DTensor.from_local(
            local.clone(), mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride
        )
    mine, (dp_placement,) = rows(local, dp_mesh)
    if split > 1 and isinstance(dp_placement, Shard):
        dp_placement = _StridedShard(0, split_factor=split)
    placements[at] = dp_placement
    return DTensor.from_local(mine, mesh, placements, run_check=False, shape=spec.shape, stride=spec.stride)


def local_of(full: torch.Tensor, spec: Any) -> torch.Tensor:
    """This rank's local tensor of ``spec`` cut from the parameter's global value ``full``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def full_value(local: torch.Tensor, spec: Any) -> torch.Tensor:
    """The global value of a tensor-parallel parameter of ``spec`` from every rank's ``local``
    (collective over the tensor-parallel ranks)."""
    from torch.distributed.tensor import DTensor

    d = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
    return d.full_tensor()
