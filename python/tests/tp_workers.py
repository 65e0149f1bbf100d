"""Rank functions of test_tp.py (importable by spawned processes): tensor-parallel models
(``parallelize_module`` on a ``tp`` mesh) sharded over the ``dp`` dimension of a 2-D mesh,
FSDP2's 2-D way."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import collsched.torch as cst

from surface_workers import error_text

# HIDDEN 10: a tp rank's 5 rows of the up projection are cut 3 and 2 over dp (uneven).
D, HIDDEN, OUT, BATCH = 8, 10, 5, 6


class Block(nn.Module):
    """A residual MLP block: layer norm (replicated over tp), an up projection
    (``ColwiseParallel``) and a down one (``RowwiseParallel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Net(nn.Module):
    """Two blocks and a head; ``recompute``: the blocks under activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, OUT)
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.recompute else b(x)
        return self.head(x)


def model(seed: int = 0) -> Net:
    """The model, the same on every rank (seeded)."""
    torch.manual_seed(seed)
    return Net()


def batch(dp_rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + dp_rank)
    return torch.randn(BATCH, D, generator=g)


def plain(t: torch.Tensor) -> list:
    return t.detach().to(torch.float64).reshape(-1).tolist()


def _meshes(world: int) -> tuple[Any, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    return mesh, mesh["dp"], mesh["tp"]


def _sharded(dp: Any, tp: Any, seed: int = 0, mp: Any = None, reshard: Any = None) -> Net:
    """The model made tensor-parallel over ``tp``, then each block and the root sharded over
    ``dp`` (the blocks with ``reshard_after_forward=reshard``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    m = model(seed)
    for b in m.blocks:
        parallelize_module(b, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in m.blocks:
        cst.fully_shard(b, mesh=dp, mp_policy=mp, reshard_after_forward=reshard)
    return cst.fully_shard(m, mesh=dp, mp_policy=mp, prefetch="none")


def train_2d(
    rank: int, world: int, steps: int, path: str, checkpointed: bool, bf16: bool = False, reshard: Any = None
) -> dict[str, Any]:
    """A (dp, tp) mesh of world/2 x 2: the model tensor-parallel over tp and sharded over dp,
    Adam with gradient clipping for ``steps`` steps (each dp rank its batch; ``checkpointed``:
    the blocks under activation checkpointing; ``bf16``: gathered in bfloat16, reduced in
    float32, under a ``MixedPrecisionPolicy``; ``reshard``: the blocks' ``reshard_after_forward``,
    and each backward's gathers from the post-forward layouts); returns the losses, the clipped norms, the
    parameters (the state dict's DTensors' full values, and ``full_state_dict``'s), the Adam
    moments of the optimizer's state dict, and the parameters after a ``dcp.save`` to ``path``
    and a ``dcp.load`` into a fresh model of the same layout, and the local shapes."""
    import torch.distributed.checkpoint as dcp

    _, dp, tp = _meshes(world)
    mp = cst.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    m = _sharded(dp, tp, mp=mp, reshard=reshard)
    m.recompute = checkpointed
    # Another model of the same shapes: its blocks unsharded between a forward and its
    # backward take the buffers the forward's gathers used (the part's world is one memory
    # pool), so the backward gathers at other addresses, and a saved tensor that kept
    # viewing the old ones would read the other model's values.
    other = _sharded(dp, tp, seed=5, mp=mp)
    dp_rank = dp.get_local_rank()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    losses, norms, totals, post = [], [], [], []
    for step in range(steps):
        loss = m(batch(dp_rank, step)).float().pow(2).mean()
        if step == 1:
            for b in other.blocks:
                b.unshard()
        loss.backward()
        post.append({n: st["all_gathers"] for n, st in cst.stats(m).get("post_forward", {}).items()})
        if step == 1:
            for b in other.blocks:
                b.reshard()
        # torchtitan's clipping (the norm of the gradients, then a scaling by it), and torch's.
        grads = [p.grad for p in m.parameters() if p.grad is not None]
        totals.append(float(torch.nn.utils.get_total_norm(grads, 2.0)))
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = m.state_dict()
    params = {k: plain(v.full_tensor()) for k, v in sd.items()}
    full = {k: plain(v) for k, v in cst.full_state_dict(m).items()}
    osd = opt.state_dict()
    moments = {i: plain(s["exp_avg"].full_tensor()) for i, s in osd["state"].items()}
    dcp.save({"model": sd}, checkpoint_id=path)
    fresh = _sharded(dp, tp, seed=5, mp=mp)
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=path)
    fresh.load_state_dict(target["model"])
    loaded = {k: plain(v.full_tensor()) for k, v in fresh.state_dict().items()}
    placements = {k: f"{tuple(v.placements)} {v.dtype}" for k, v in sd.items()}
    return {
        "dp_rank": dp_rank,
        "losses": losses,
        "norms": norms,
        "totals": totals,
        "params": params,
        "full": full,
        "moments": moments,
        "loaded": loaded,
        "placements": placements,
        "post": post,
    }


def load_1d(rank: int, world: int, path: str) -> dict[str, Any]:
    """The checkpoint of :func:`train_2d` loaded (``dcp.load``) into the model sharded over the
    whole job without tensor parallelism; its parameters' full values."""
    import torch.distributed.checkpoint as dcp

    m = model(seed=9)
    for b in m.blocks:
        cst.fully_shard(b)
    cst.fully_shard(m)
    target = {"model": m.state_dict()}
    dcp.load(target, checkpoint_id=path)
    m.load_state_dict(target["model"])
    return {k: plain(v) for k, v in cst.full_state_dict(m).items()}


def refusals(rank: int, world: int, path: str) -> dict[str, str]:
    """The errors of what collsched refuses of a tensor-parallel model: sharding it over the
    tp ranks too (the whole job), ``save_full``, and ``load_checkpoint`` of a checkpoint of
    another tensor-parallel layout."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    error = error_text
    _, dp, tp = _meshes(world)
    out = {}
    whole = model()
    parallelize_module(whole.blocks[0], tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    out["whole_job"] = error(lambda: cst.fully_shard(whole))
    m = _sharded(dp, tp)
    out["save_full"] = error(lambda: cst.save_full(m, path + "-full.safetensors"))
    cst.save_checkpoint(m, None, path)
    other = model()
    for b in other.blocks:
        parallelize_module(b, tp, {"up": RowwiseParallel(), "down": ColwiseParallel()})
        cst.fully_shard(b, mesh=dp)
    cst.fully_shard(other, mesh=dp)
    out["layout"] = error(lambda: cst.load_checkpoint(other, None, path))
    fresh = _sharded(dp, tp, seed=3)
    out["same_layout"] = error(lambda: cst.load_checkpoint(fresh, None, path))
    saved, loaded = m.state_dict(), fresh.state_dict()
    out["same_values"] = str(all(torch.equal(saved[k].full_tensor(), loaded[k].full_tensor()) for k in saved))
    # dp_mesh_dims: a plain parameter, one sharded over dp already, names the mesh lacks, no shard.
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _meshes(world)[0]
    dims = DataParallelMeshDims(shard="dp")
    out["spmd_plain"] = error(lambda: cst.fully_shard(model(), mesh=mesh, dp_mesh_dims=dims))
    placed = spmd_model(mesh)
    placed.head.weight = nn.Parameter(distribute_tensor(model().head.weight.data, mesh, [Shard(0), Shard(1)]))
    out["spmd_placed"] = error(lambda: cst.fully_shard(placed, mesh=mesh, dp_mesh_dims=dims))
    cp = DataParallelMeshDims(shard="cp")
    out["spmd_names"] = error(lambda: cst.fully_shard(spmd_model(mesh), mesh=mesh, dp_mesh_dims=cp))
    out["spmd_int"] = error(
        lambda: cst.fully_shard(spmd_model(mesh), mesh=mesh, dp_mesh_dims=dims, reshard_after_forward=2)
    )
    same = DataParallelMeshDims(shard="dp", replicate="dp")
    out["spmd_same"] = error(lambda: cst.fully_shard(spmd_model(mesh), mesh=mesh, dp_mesh_dims=same))
    # A block with dp_mesh_dims, the root without.
    mixed = spmd_model(mesh)
    for b in mixed.blocks:
        cst.fully_shard(b, mesh=mesh, dp_mesh_dims=dims)
    out["spmd_mixed"] = error(lambda: cst.fully_shard(mixed, mesh=dp))
    # HSDP whose mesh has the shard dimension first.
    from torch.distributed.device_mesh import init_device_mesh

    flipped = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "rep"))
    hsdp = DataParallelMeshDims(shard="dp", replicate="rep")
    out["spmd_order"] = error(lambda: cst.fully_shard(spmd_model(flipped, tp=False), mesh=flipped, dp_mesh_dims=hsdp))
    ddp = DataParallelMeshDims(replicate="dp")
    out["spmd_ddp"] = error(lambda: cst.fully_shard(spmd_model(mesh), mesh=mesh, dp_mesh_dims=ddp, strategy="flat"))
    backwards = DataParallelMeshDims(shard=("tp", "dp"))
    out["spmd_backwards"] = error(lambda: cst.fully_shard(spmd_model(mesh), mesh=mesh, dp_mesh_dims=backwards))
    return out


SEQ = 4


def seq_batch(dp_rank: int, step: int) -> torch.Tensor:
    """A batch of sequences (batch, SEQ, D)."""
    g = torch.Generator().manual_seed(100 + 10 * step + dp_rank)
    return torch.randn(2, SEQ, D, generator=g)


def sequence_parallel(rank: int, world: int, steps: int, no_sync: bool, backend: str) -> dict[str, Any]:
    """torchtitan's layout of a block: the norms ``SequenceParallel`` (replicated weights whose
    gradients are ``Partial`` over tp, each tp rank computing on its part of the sequence),
    the up projection ``ColwiseParallel`` from the sequence-sharded input, the down one
    ``RowwiseParallel`` back to it, the head ``ColwiseParallel`` to a replicated output; every
    parameter a DTensor; each tp rank given its part of the sequence. Sharded over dp, SGD,
    ``no_sync``: each step two micro-batches (halves of the batch), the first under no_sync;
    on collsched's ``backend`` (``shm``, or ``emulated``: the device paths). Returns the
    losses, the parameters' full values and their state dict's placements."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    cst.init(backend)
    _, dp, tp = _meshes(world)
    m = model(0)
    for b in m.blocks:
        parallelize_module(
            b,
            tp,
            {
                "norm": SequenceParallel(),
                "up": ColwiseParallel(input_layouts=Shard(1)),
                "down": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(m.head, tp, ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    for b in m.blocks:
        cst.fully_shard(b, mesh=dp)
    cst.fully_shard(m, mesh=dp)
    t, n = tp.get_local_rank(), tp.size()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = seq_batch(dp.get_local_rank(), step)[:, t * SEQ // n : (t + 1) * SEQ // n]
        parts = [x[:1], x[1:]] if no_sync else [x]
        total = 0.0
        for i, part in enumerate(parts):
            with m.no_sync() if i + 1 < len(parts) else contextlib.nullcontext():
                loss = m(part).pow(2).mean() / len(parts)
                loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    sd = m.state_dict()
    return {
        "losses": losses,
        "params": {k: plain(v.full_tensor()) for k, v in sd.items()},
        "placements": {k: str(tuple(v.placements)) for k, v in sd.items()},
    }


def meta_init(rank: int, world: int) -> dict[str, Any]:
    """torchtitan's start with tensor parallelism: the model built on the meta device, made
    tensor-parallel over tp, sharded over dp, ``to_empty``, then rank 0's full values broadcast
    (``set_model_state_dict(..., broadcast_from_rank0=True)``). Returns the state dict's full
    values and a forward's loss."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _, dp, tp = _meshes(world)
    with torch.device("meta"):
        m = Net()
    for b in m.blocks:
        parallelize_module(b, tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in m.blocks:
        cst.fully_shard(b, mesh=dp)
    cst.fully_shard(m, mesh=dp)
    m.to_empty(device="cpu")
    full = model(0).state_dict() if rank == 0 else {}
    set_model_state_dict(m, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    values = {k: plain(v.full_tensor()) for k, v in m.state_dict().items()}
    with torch.no_grad():
        loss = m(batch(dp.get_local_rank(), 0)).pow(2).mean().item()
    return {"values": values, "loss": loss}


def spmd_model(mesh: Any, seed: int = 0, tp: bool = True) -> Net:
    """The model with every parameter a DTensor on the whole 2-D ``mesh``, ``Replicate`` on
    its first dimension (FSDP2's ``dp_mesh_dims`` form); ``tp``: the second is tensor-parallel,
    the up projections' rows and the down ones' columns sharded over it, the rest replicated."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    m = model(seed)
    r = Replicate()
    over_tp = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)} if tp else {}
    for name, p in list(m.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        placed = over_tp.get(f"{owner.rpartition('.')[2]}.{leaf}", r)
        setattr(m.get_submodule(owner), leaf, nn.Parameter(distribute_tensor(p.data, mesh, [r, placed])))
    return m


def _spmd_sharded(mesh: Any, dims: Any, tp: bool, kind: str, seed: int = 0) -> Net:
    m = spmd_model(mesh, seed, tp=tp)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = cst.fully_shard
    for b in m.blocks:
        fully_shard(b, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(m, mesh=mesh, dp_mesh_dims=dims)
    return m


# dp_mesh_dims layouts of 4 ranks: the mesh's shape and names, the DataParallelMeshDims'
# (shard, replicate), whether the second dimension is tensor-parallel.
SPMD_LAYOUTS = {
    "dp-tp": ((2, 2), ("dp", "tp"), ("dp", None), True),
    "hsdp": ((2, 2), ("rep", "dp"), ("dp", "rep"), False),
    "flat": ((2, 2), ("dp", "cp"), (("dp", "cp"), None), False),
    "ddp-tp": ((2, 2), ("rep", "tp"), (None, "rep"), True),
}


def train_spmd(rank: int, world: int, steps: int, kind: str, layout: str, path: str, micro: int = 1) -> dict[str, Any]:
    """``spmd_model`` sharded by ``kind`` (``"collsched"`` or ``"fsdp2"``) with FSDP2's
    ``dp_mesh_dims``, each block and the root, on a mesh of ``SPMD_LAYOUTS[layout]``: sharded
    over (dp, tp), replicated over rep and sharded over dp (HSDP), sharded over dp and cp
    flattened, or replicated over rep with tp beside (DDP). Each step a DTensor batch sharded
    over the data-parallel dimensions (each data-parallel rank, in mesh order, its batch), the
    loss a DTensor mean over the global batch (``micro`` of them a step, gradients synchronized
    at the last one alone), gradients clipped to norm 0.5, SGD. Returns the losses, the norms,
    the state dict's full values and placements, and (collsched) the values after a
    ``save_checkpoint`` to ``path`` and a ``load_checkpoint`` into a fresh model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate, Shard

    shape, names, (shard, replicate), tp = SPMD_LAYOUTS[layout]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    if tp:
        index, placements = mesh[names[0]].get_local_rank(), [Shard(0), Replicate()]
    else:
        index, placements = rank, [Shard(0), Shard(0)]
    m = _spmd_sharded(mesh, dims, tp, kind)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(steps):
        for k in range(micro):
            m.set_requires_gradient_sync(k == micro - 1)
            loss = m(DTensor.from_local(batch(index, step * micro + k), mesh, placements)).pow(2).mean()
            losses.append(loss.full_tensor().item())
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    sd = m.state_dict()
    loaded = {}
    if kind == "collsched":
        cst.save_checkpoint(m, None, path)
        fresh = _spmd_sharded(mesh, dims, tp, kind, seed=5)
        cst.load_checkpoint(fresh, None, path)
        loaded = {k: plain(v.full_tensor()) for k, v in fresh.state_dict().items()}
    return {
        "losses": losses,
        "norms": norms,
        "params": {k: plain(v.full_tensor()) for k, v in sd.items()},
        "placements": {k: str(tuple(v.placements)) for k, v in sd.items()},
        "loaded": loaded,
    }


# dp_mesh_dims layouts of 16 ranks for the placements of a state dict: the mesh's shape and
# names, the DataParallelMeshDims' (shard, replicate), the tensor-parallel dimension.
FAKE_LAYOUTS = {
    "hsdp-flat-tp": ((2, 2, 2, 2), ("rep", "dp", "cp", "tp"), (("dp", "cp"), "rep"), "tp"),
    "flat-hsdp-tp": ((2, 2, 2, 2), ("dp", "cp", "rep", "tp"), (("dp", "cp"), "rep"), "tp"),
    "flat-tp": ((4, 2, 2), ("dp", "cp", "tp"), (("dp", "cp"), None), "tp"),
    "tp-first": ((2, 8), ("tp", "dp"), ("dp", None), "tp"),
    "ddp-two-names": ((2, 2, 4), ("r1", "r2", "tp"), (None, ("r1", "r2")), "tp"),
}


def fake_placements(rank: int, world: int, layout: str, as_rank: int) -> dict[str, Any]:
    """One process as rank ``as_rank`` of 16 on torch's fake process group (collectives do
    nothing): a (32, 8) weight, a DTensor on the ``FAKE_LAYOUTS[layout]`` mesh sharded over tp,
    placed for a state dict by collsched (``tp.place`` over ``tp.spmd_mesh``) and sharded by
    FSDP2's ``fully_shard``; both DTensors' placements, mesh ranks and local values."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from collsched.torch import tp as tp_
    from collsched.torch.state_dict import _rows

    shape, names, (shard, replicate), tp_dim = FAKE_LAYOUTS[layout]
    dist.init_process_group("fake", rank=as_rank, world_size=16, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dims = DataParallelMeshDims(shard=shard, replicate=replicate)
        placements = [Shard(0) if n == tp_dim else Replicate() for n in names]
        g = torch.Generator().manual_seed(3)
        w = nn.Parameter(distribute_tensor(torch.randn(32, 8, generator=g), mesh, placements))
        _, spmd, _ = tp_.spmd_mesh(mesh, dims)
        ours = tp_.place(w._local_tensor, w._spec, spmd.cut, _rows, spmd)
        holder = nn.Module()
        holder.weight = w
        fully_shard(holder, mesh=mesh, dp_mesh_dims=dims)
        theirs = holder.weight
        return {
            k: [str(tuple(t.placements)), t.device_mesh.mesh.tolist(), plain(t._local_tensor)]
            for k, t in (("ours", ours), ("fsdp2", theirs))
        }
    finally:
        dist.destroy_process_group()
