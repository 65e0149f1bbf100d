"""Rank functions of test_mesh_part.py (importable by spawned processes): models sharded
over part of the job (a slice of a 2-D mesh), beside pipeline parallelism."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import collsched.torch as cst

IN, HIDDEN, OUT, BATCH = 6, 12, 5, 4


def stage_model(stage: int) -> nn.Sequential:
    """Stage ``stage``'s model, the same on every rank (seeded by the stage)."""
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def batch(stage: int, dp_rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * stage + 10 * step + dp_rank)
    return torch.randn(BATCH, IN, generator=g)


def plain(t: torch.Tensor) -> list:
    return t.detach().to(torch.float64).reshape(-1).tolist()


def _sharded(stage: int, dp: Any) -> nn.Sequential:
    model = stage_model(stage)
    for layer in model:
        if isinstance(layer, nn.Linear):
            cst.fully_shard(layer, mesh=dp)
    return cst.fully_shard(model, mesh=dp)


def dp_parts(rank: int, world: int, steps: int, path: str) -> dict[str, Any]:
    """A (pp, dp) mesh of 2 x world/2: each pp row trains its own model, sharded over its dp
    ranks alone (``fully_shard(mesh=mesh["dp"])`` per layer and on the root), SGD with
    momentum; returns its losses, its parameters and momenta (from the state dicts' DTensors
    over the part), the ranks of the part, the parameters of a fresh model loaded from the
    checkpoint both parts saved to ``path``, and the error of a root sharded over the job on
    blocks sharded over the part."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = world // 2
    mesh = init_device_mesh("cpu", (2, dp_size), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"]
    stage, dp_rank = rank // dp_size, dp.get_local_rank()
    model = _sharded(stage, dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses = []
    for step in range(steps):
        loss = model(batch(stage, dp_rank, step)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = model.state_dict()
    params = {k: plain(v.full_tensor()) for k, v in sd.items()}
    osd = opt.state_dict()
    momenta = {i: plain(s["momentum_buffer"].full_tensor()) for i, s in osd["state"].items()}
    cst.save_checkpoint(model, opt, path, step=steps)
    # Named by its stage too, for a job of another data-parallel size (dp_reloaded).
    cst.save_checkpoint(model, opt, path + "-named", step=steps, part=f"stage{stage}")
    fresh = _sharded(stage + 7, dp)
    cst.load_checkpoint(fresh, None, path)
    loaded = {k: plain(v.full_tensor()) for k, v in fresh.state_dict().items()}
    blocks = stage_model(stage)
    cst.fully_shard(blocks[0], mesh=dp)
    try:
        cst.fully_shard(blocks)
        mixed = "no error"
    except Exception as e:
        mixed = f"{type(e).__name__}: {e}"
    return {
        "stage": stage,
        "dp_rank": dp_rank,
        "ranks": dp.mesh.tolist(),
        "losses": losses,
        "params": params,
        "momenta": momenta,
        "loaded": loaded,
        "mixed": mixed,
    }


def dp_reloaded(rank: int, world: int, path: str) -> dict[str, Any]:
    """A (pp, dp) mesh of world x 1, stage ``rank % 2`` on each rank: a fresh model sharded over
    this rank alone loads the stage's checkpoint :func:`dp_parts` saved over two ranks (by the
    stage's name), and without the name gets an error naming what is there. Returns the
    stage, the loaded parameters and the error."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    stage = rank % 2
    fresh = _sharded(stage + 7, mesh["dp"])
    try:
        cst.load_checkpoint(fresh, None, path)
        unnamed = "no error"
    except Exception as e:
        unnamed = f"{type(e).__name__}: {e}"
    index = cst.load_checkpoint(fresh, None, path, part=f"stage{stage}")
    loaded = {k: plain(v.full_tensor()) for k, v in fresh.state_dict().items()}
    return {"stage": stage, "loaded": loaded, "world": index["world"], "unnamed": unnamed}


def _schedule_step(schedule: Any, first: bool, dp_rank: int, step: int, n_micro: int, losses: list) -> None:
    """One step of a pipeline ``schedule`` on this dp rank's ``n_micro`` micro-batches: the
    first pipeline rank feeds the inputs, the last gives targets and appends the step's
    micro-batch losses to ``losses``."""
    x = torch.cat([batch(0, dp_rank, step * n_micro + m) for m in range(n_micro)])
    if first:
        schedule.step(x)
    else:
        got: list[torch.Tensor] = []
        schedule.step(target=torch.zeros(x.shape[0], OUT), losses=got)
        losses.append([t.item() for t in got])


def pipelined(rank: int, world: int, steps: int, n_micro: int, kind: str) -> dict[str, Any]:
    """Pipeline parallelism beside sharding, torchtitan's way: a (pp, dp) mesh of 2 x
    world/2; the model's two stages (a linear layer and tanh, then a linear layer), each
    sharded over its dp ranks (``fully_shard(mesh=mesh["dp"])``), run by
    ``torch.distributed.pipelining``'s schedule ``kind`` (GPipe, 1F1B) over the pp group (the collsched
    backend's point-to-point) with ``n_micro`` micro-batches of each rank's batch, SGD; returns
    the last stage's micro-batch losses per step and the stage's parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dp_size = world // 2
    mesh = init_device_mesh("cpu", (2, dp_size), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    stage, dp_rank = pp.get_local_rank(), dp.get_local_rank()
    full = stage_model(0)
    part = nn.Sequential(full[0], full[1]) if stage == 0 else nn.Sequential(full[2])
    for layer in part:
        if isinstance(layer, nn.Linear):
            cst.fully_shard(layer, mesh=dp)
    cst.fully_shard(part, mesh=dp)
    pipe = PipelineStage(part, stage, 2, torch.device("cpu"), group=pp.get_group())
    schedule = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[kind](pipe, n_micro, loss_fn=nn.MSELoss())
    opt = torch.optim.SGD(part.parameters(), lr=0.2)
    losses, reductions = [], []
    for step in range(steps):
        _schedule_step(schedule, stage == 0, dp_rank, step, n_micro, losses)
        # The library steps that reduced during this schedule step (stats' running count).
        reductions.append(cst.stats(part)["reduced_steps"] - sum(reductions))
        opt.step()
        opt.zero_grad()
    params = {k: plain(v.full_tensor()) for k, v in part.state_dict().items()}
    return {"stage": stage, "dp_rank": dp_rank, "losses": losses, "params": params, "reductions": reductions}


def deep_model() -> nn.Sequential:
    """Four stages' model for interleaved schedules: three hidden layers with tanh, then the output."""
    torch.manual_seed(300)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


# The deep model's layers of each of its four stages.
DEEP_STAGES = ((0, 1), (2, 3), (4, 5), (6,))


def interleaved(rank: int, world: int, steps: int, n_micro: int, defer: bool) -> dict[str, Any]:
    """``deep_model`` in four stages over a (pp 2, dp world/2) mesh, pp rank ``p`` holding
    stages ``p`` and ``p + 2``, each stage a root of its own sharded over its dp ranks, run by
    ``ScheduleInterleaved1F1B`` (which unshards, reshards and finalizes each stage's reduction
    by FSDP2's methods) with ``n_micro`` micro-batches, ``defer``: its
    ``defer_reduce_grad_wait``; SGD. Returns the last stage's micro-batch losses per step and
    each stage's parameters by the deep model's names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    dp_size = world // 2
    mesh = init_device_mesh("cpu", (2, dp_size), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"], mesh["dp"]
    p, dp_rank = pp.get_local_rank(), dp.get_local_rank()
    full = deep_model()
    parts, stages = [], []
    for s in (p, p + 2):
        part = nn.Sequential(*(full[i] for i in DEEP_STAGES[s]))
        cst.fully_shard(part, mesh=dp)
        parts.append((s, part))
        stages.append(PipelineStage(part, s, 4, torch.device("cpu"), group=pp.get_group()))
    schedule = ScheduleInterleaved1F1B(stages, n_micro, loss_fn=nn.MSELoss(), defer_reduce_grad_wait=defer)
    opt = torch.optim.SGD([q for _, part in parts for q in part.parameters()], lr=0.2)
    losses = []
    for step in range(steps):
        _schedule_step(schedule, p == 0, dp_rank, step, n_micro, losses)
        opt.step()
        opt.zero_grad()
    params = {}
    for s, part in parts:
        for k, v in part.state_dict().items():
            i, leaf = k.split(".")
            params[f"{DEEP_STAGES[s][int(i)]}.{leaf}"] = plain(v.full_tensor())
    return {"pp": p, "dp_rank": dp_rank, "losses": losses, "params": params}
