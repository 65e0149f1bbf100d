"""Rank functions of ``test_fsdp2_api.py``: FSDP2's API beyond the training loop on a sharded
model (state dicts as DTensors, torch.distributed.checkpoint, meta-device init, meshes,
ignored parameters, unshard, offload), each against an unsharded model built in the worker or
the tests' reference."""

from __future__ import annotations

import functools
from typing import Any

import torch

import models
from surface_workers import error_text


def shard(model: torch.nn.Module, strategy: str, bucket_mb: float, mp: Any = None, reshard: Any = None) -> Any:
    """Each block and then the root sharded alike (``reshard``: ``reshard_after_forward``)."""
    import collsched.torch as cst

    opts = {"strategy": strategy, "bucket_mb": bucket_mb, "mp_policy": mp, "reshard_after_forward": reshard}
    for b in model.blocks:
        cst.fully_shard(b, **opts)
    return cst.fully_shard(model, **opts)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: Any, rank: int) -> tuple[list, list]:
    """The gpt's training ``steps`` on this rank's batches: losses and full parameters after each."""
    import collsched.torch as cst

    import workers

    losses, params = [], []
    for step in steps:
        x, y = models.batch("gpt", 0, step, 0, rank)
        loss = models.loss_fn("gpt", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item()])
        params.append(workers.snapshot(cst.full_parameters(model)))
    return losses, params


def with_tied(full: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``full`` (by the names ``named_parameters`` keeps) with every tied parameter's other
    names too, as a state dict has them."""
    first: dict[int, str] = {}
    out = dict(full)
    for name, p in model.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
        out.setdefault(name, full[first[id(p)]])
    return out


def describe(sd: dict[str, Any], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per key of ``sd`` (DTensors): its type, placements, local shape, dtype, and whether its
    full value is ``ref``'s, bit for bit."""
    from torch.distributed.tensor import DTensor

    out = {}
    for k, v in sd.items():
        row: dict[str, Any] = {"type": type(v).__name__}
        if isinstance(v, DTensor):
            full = v.full_tensor()
            row.update(
                placements=[str(p) for p in v.placements],
                local=list(v.to_local().shape),
                shape=list(v.shape),
                dtype=str(v.dtype),
                equal=k in ref and full.dtype == ref[k].dtype and torch.equal(full, ref[k]),
            )
        out[k] = row
    return out


def dtensors(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """``state_dict()`` of a gpt sharded with ``strategy``, before and after a step, against
    the unsharded model's; then ``load_state_dict`` of another model's full values and of the
    DTensors of a model sharded otherwise."""
    import collsched.torch as cst

    ref = models.build("gpt", 0)
    model = shard(models.build("gpt", 0), strategy, 0.002)
    want = {k: v.clone() for k, v in ref.state_dict().items()}
    out: dict[str, Any] = {"before": describe(model.state_dict(), want), "ref_keys": sorted(want)}
    # One block alone, under its own prefix.
    out["block"] = describe(model.blocks[1].state_dict(prefix="blocks.1."), want)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    x, y = models.batch("gpt", 0, 0, 0, rank)
    models.loss_fn("gpt", model(x), y).backward()
    opt.step()
    # The optimizer's state dict (DTensors) into an optimizer that never stepped: its states
    # come back as this rank's elements, bit for bit.
    fresh = torch.optim.AdamW(model.parameters(), lr=0.01)
    fresh.load_state_dict(opt.state_dict())
    out["optim_back"] = sorted(
        f"{i}.{k}"
        for i, p in enumerate(model.parameters())
        for k, v in opt.state[p].items()
        if type(fresh.state[p].get(k)) is not torch.Tensor or not torch.equal(fresh.state[p][k], v)
    )
    out["optim_states"] = sum(len(opt.state[p]) for p in model.parameters())
    full = with_tied({k: v.clone() for k, v in cst.full_parameters(model).items()}, ref)
    out["after"] = describe(model.state_dict(), full)
    # Full values of another model, then DTensors of a model sharded by another strategy.
    other = models.build("gpt", 1)
    model.load_state_dict(other.state_dict())
    got = cst.full_parameters(model)
    out["loaded_full"] = sorted(k for k, v in other.named_parameters() if not torch.equal(got[k], v))
    third = shard(models.build("gpt", 2), "flat" if strategy != "flat" else "even", 0.001)
    model.load_state_dict(third.state_dict())
    got, want3 = cst.full_parameters(model), cst.full_parameters(third)
    out["loaded_dtensor"] = sorted(k for k, v in want3.items() if not torch.equal(got[k], v))
    out["still_trains"] = bool(torch.isfinite(models.loss_fn("gpt", model(x), y)).item())
    return out


def mixed(rank: int, world: int) -> dict[str, Any]:
    """Under a bf16 MixedPrecisionPolicy the state dict is of the f32 masters."""
    import collsched.torch as cst

    ref = models.build("mlp", 0)
    model = shard(models.build("mlp", 0), "even", 0.002, cst.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    out = {"sd": describe(model.state_dict(), dict(ref.state_dict()))}
    other = models.build("mlp", 3)
    model.load_state_dict(other.state_dict())
    got = cst.full_parameters(model)
    out["loaded"] = sorted(k for k, v in other.named_parameters() if not torch.equal(got[k], v))
    return out


def refusals(rank: int, world: int) -> dict[str, Any]:
    """What a sharded model's state dict refuses, each with its error."""
    import torch.distributed as dist

    import collsched.torch as cst

    model = shard(models.build("mlp", 0), "even", 0.002)
    out: dict[str, Any] = {}
    ref = models.build("mlp", 1).state_dict()
    bad = dict(ref)
    bad["blocks.0.weight"] = bad["blocks.0.weight"][:1]
    out["shape"] = error_text(lambda: model.load_state_dict(bad))
    local = dict(ref)
    local["head.weight"] = model.head.weight.detach().clone()
    out["local"] = error_text(lambda: model.load_state_dict(local))
    out["assign"] = error_text(lambda: model.load_state_dict(ref, assign=True))
    first = dict(models.build("mlp", 0).named_parameters())
    out["unchanged"] = all(torch.equal(v, first[k]) for k, v in cst.full_parameters(model).items())
    x, _ = models.batch("mlp", 0, 0, 0, rank)
    seen: dict[str, str] = {}
    hook = model.blocks[0].register_forward_hook(lambda m, a, o: seen.__setitem__("in_pass", error_text(m.state_dict)))
    model(x).sum().backward()
    hook.remove()
    out["in_pass"] = seen.get("in_pass", "hook did not run")
    dist.destroy_process_group()
    out["no_group"] = error_text(model.state_dict)
    return out


def dcp_round(rank: int, world: int, path: str, how: str, strategy: str) -> dict[str, Any]:
    """torch.distributed.checkpoint on a sharded gpt: ``dcp.save`` of ``state_dict()`` (``how``
    ``"save"``, the model of seed 0 after one step), or ``dcp.load`` into the state dict of a
    model of seed 5 and ``load_state_dict`` (``"load"``); ``get_model_state_dict`` with
    ``full_state_dict`` and ``set_model_state_dict`` with ``broadcast_from_rank0`` beside."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import collsched.torch as cst

    seed = 0 if how == "save" else 5
    model = shard(models.build("gpt", seed), strategy, 0.002)
    out: dict[str, Any] = {}
    if how == "save":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = models.batch("gpt", 0, 0, 0, rank)
        models.loss_fn("gpt", model(x), y).backward()
        opt.step()
        dcp.save(model.state_dict(), checkpoint_id=path)
    else:
        out["before"] = {k: v.flatten().tolist() for k, v in cst.full_parameters(model).items()}
        sd = model.state_dict()
        dcp.load(sd, checkpoint_id=path)
        model.load_state_dict(sd)
    full = cst.full_parameters(model)
    out["params"] = {k: v.flatten().tolist() for k, v in full.items()}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    got = get_model_state_dict(model, options=opts)
    tied = with_tied(full, models.build("gpt", 0))
    same = sorted(got) == sorted(tied) and all(torch.equal(got[k], tied[k]) for k in tied)
    # Rank 0 alone gets the full state dict (cpu_offload), the others an empty one.
    out["get_full"] = same if rank == 0 else got == {}
    fresh = shard(models.build("gpt", 9), "greedy", 0.002)
    set_model_state_dict(
        fresh, got if rank == 0 else {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    again = cst.full_parameters(fresh)
    out["broadcast"] = sorted(k for k, v in full.items() if not torch.equal(again[k], v))
    return out


def meta_init(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's start: the gpt built on the meta device, sharded (no full value made on any
    rank: the build's gathering of values is made to raise), ``to_empty``, rank 0's full
    state dict broadcast with ``set_model_state_dict``; then trained as the reference is.
    Returns losses and full parameters after each step, and the refusals beside."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    import collsched.torch as cst
    from collsched.torch import values

    def no_full_values(*_: Any) -> Any:
        raise AssertionError("the build of a meta model gathered full values")

    real = values.full_values
    values.full_values = no_full_values
    try:
        with torch.device("meta"):
            model = models.build("gpt", 0)
        mp = cst.MixedPrecisionPolicy(**spec["mp"]) if spec.get("mp") else None
        model = shard(model, spec.get("strategy", "even"), spec["bucket_mb"], mp, spec.get("reshard_after_forward"))
    finally:
        values.full_values = real
    out: dict[str, Any] = {"zeros": all(not p.any() for p in cst.full_parameters(model).values())}
    model.to_empty(device="cpu")
    full = models.build("gpt", 0).state_dict() if rank == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    out["losses"], out["params"] = train_steps(model, opt, range(spec["steps"]), rank)
    out["post"] = {n: st["all_gathers"] for n, st in cst.stats(model).get("post_forward", {}).items()}
    with torch.device("meta"):
        half = models.build("mlp", 0)
    half.head = torch.nn.Linear(9, 5)
    out["mixed"] = error_text(lambda: cst.fully_shard(half))
    with torch.device("meta"):
        synced = models.build("mlp", 0)
    out["synced"] = error_text(lambda: cst.fully_shard(synced, sync_module_states=True))
    return out


def ignoring(rank: int, world: int) -> dict[str, Any]:
    """``ignored_params`` (a block's weight, trainable) and a parameter of an integer dtype stay
    in their modules as they were: full, not reduced (the kept weight's gradient is this rank's
    own), while the rest trains as plain PyTorch averaging over ranks. One SGD step against an
    unsharded model that does the same by hand."""
    import collsched.torch as cst

    cst.init()
    ref = models.build("mlp", 0)
    model = models.build("mlp", 0)
    q = torch.nn.Parameter(torch.arange(3, dtype=torch.int8), requires_grad=False)
    model.blocks[0].register_parameter("q", q)
    kept = model.blocks[1].weight
    for b in model.blocks:
        cst.fully_shard(b, ignored_params={kept} if b is model.blocks[1] else None)
    cst.fully_shard(model)
    out: dict[str, Any] = {
        "kept": model.blocks[1].weight is kept and tuple(kept.shape) == (11, 13),
        "q": model.blocks[0].q is q and torch.equal(q, torch.arange(3, dtype=torch.int8)),
        "sharded": sorted(cst.full_parameters(model)),
    }
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = models.batch("mlp", 0, 0, 0, rank)
    models.loss_fn("mlp", model(x), y).backward()
    out["kept_grad"] = torch.equal(
        kept.grad, torch.autograd.grad(models.loss_fn("mlp", ref(x), y), ref.blocks[1].weight)[0]
    )
    opt.step()
    # The reference: every rank's gradients averaged (summed in rank order), the kept weight's
    # this rank's own.
    grads = [
        torch.autograd.grad(models.loss_fn("mlp", ref(bx), by), list(ref.parameters()))
        for bx, by in (models.batch("mlp", 0, 0, 0, r) for r in range(world))
    ]
    with torch.no_grad():
        for i, (n, p) in enumerate(ref.named_parameters()):
            g = grads[rank][i] if n == "blocks.1.weight" else sum(g[i] for g in grads) / world
            p.add_(g, alpha=-0.1)
    want = dict(ref.named_parameters())
    got = cst.full_parameters(model)
    out["params"] = {n: float((got[n] - want[n].detach()).abs().max()) for n in got}
    out["kept_after"] = torch.equal(kept.detach(), want["blocks.1.weight"].detach())
    out["not_param"] = error_text(lambda: cst.fully_shard(models.build("mlp", 1), ignored_params={torch.ones(2)}))
    out["foreign"] = error_text(lambda: cst.fully_shard(models.build("mlp", 1), ignored_params={ref.head.weight}))
    return out


def unsharding(rank: int, world: int) -> dict[str, Any]:
    """``unshard()`` between steps puts a unit's full values in its modules (to read),
    ``reshard()`` takes them back; a forward after an ``unshard()`` without ``reshard()``
    trains as ever; FSDP2's backward methods."""
    import collsched.torch as cst

    cst.init()
    ref = models.build("mlp", 0)
    model = models.build("mlp", 0)
    for b in model.blocks:
        cst.fully_shard(b)
    cst.fully_shard(model)
    # Made from the shards: between unshard() and reshard() the modules hold full values.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    block = model.blocks[1]
    out: dict[str, Any] = {"handle": type(block.unshard(async_op=True)).__name__}
    out["full"] = torch.equal(block.weight, ref.blocks[1].weight) and torch.equal(block.bias, ref.blocks[1].bias)
    out["live_unsharded"] = cst.live_bytes(model)
    block.reshard()
    out["after_reshard"] = (tuple(block.weight.shape), cst.live_bytes(model))
    block.reshard()  # nothing to release: nothing happens
    model.unshard()
    x, y = models.batch("mlp", 0, 0, 0, rank)
    loss = models.loss_fn("mlp", model(x), y)
    loss.backward()
    opt.step()
    grads = [
        torch.autograd.grad(models.loss_fn("mlp", ref(bx), by), list(ref.parameters()))
        for bx, by in (models.batch("mlp", 0, 0, 0, r) for r in range(world))
    ]
    with torch.no_grad():
        for i, p in enumerate(ref.parameters()):
            p.add_(sum(g[i] for g in grads) / world, alpha=-0.1)
    got, want = cst.full_parameters(model), dict(ref.named_parameters())
    out["params"] = {n: float((got[n] - want[n].detach()).abs().max()) for n in want}
    out["live_end"] = cst.live_bytes(model)
    model.set_is_last_backward(False)
    model.set_reshard_after_backward(True)
    out["not_bool"] = error_text(lambda: model.set_reshard_after_backward(0))
    # Held from a backward under no_sync, full values in the modules, until reshard().
    model.set_reshard_after_backward(False)
    with model.no_sync():
        models.loss_fn("mlp", model(x), y).backward()
    out["held"] = (cst.live_bytes(model), tuple(block.weight.shape))
    out["held_state_dict"] = error_text(lambda: model.state_dict())
    for m in [model, *model.blocks]:
        m.reshard()
    out["released"] = (cst.live_bytes(model), tuple(block.weight.shape))
    # The next pass gathers the same values again (the reference holds them).
    with torch.no_grad():
        out["after_hold"] = float((model(x) - ref(x)).abs().max())
    return out


def titan(rank: int, world: int, spec: dict[str, Any], path: str, phase: str) -> dict[str, Any]:
    """A torchtitan-style run with collsched.torch in place of FSDP2: a DeviceMesh (``spec
    ["mesh"][phase]``'s shape: 2-D is HSDP), the model built on the meta device, per-block
    ``fully_shard`` with FSDP2's own MixedPrecisionPolicy, the last layers as one list,
    ``to_empty``; ``save``: rank 0's
    values broadcast, steps ``[0, split)``, model and optimizer saved with DCP; ``load``: a DCP
    load, steps ``[split, steps)``. Losses and full parameters after each step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import collsched.torch as cst

    import workers

    shape = tuple(spec["mesh"][phase])
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape) :])
    with torch.device("meta"):
        model = models.build("gpt", 0)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        cst.fully_shard(b, mesh=mesh, mp_policy=mp, bucket_mb=spec["bucket_mb"])
    # torchtitan's last layers: one unit, kept fetched from forward to backward.
    cst.fully_shard([model.ln, model.head], mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    cst.fully_shard(model, mesh=mesh, mp_policy=mp, bucket_mb=spec["bucket_mb"])
    model.to_empty(device="cpu")
    opt = models.optimizer(spec["opt"], model.parameters())
    if phase == "save":
        full = models.build("gpt", 0).state_dict() if rank == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        steps = range(0, spec["split"])
    else:
        workers.dcp_checkpoint(model, opt, path, "load")
        steps = range(spec["split"], spec["steps"])
    out: dict[str, Any] = {"strategy": cst.plan(model)["strategy"]}
    out["losses"], out["params"] = train_steps(model, opt, steps, rank)
    if phase == "save":
        workers.dcp_checkpoint(model, opt, path, "save")
    # A mesh over part of the job: a model over that part's ranks alone.
    out["part_world"] = cst.plan(cst.fully_shard(models.build("mlp", 0), mesh=mesh["shard"]))["world"]
    return out


def offloaded(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The tests' training run under ``CPUOffloadPolicy`` (``spec["offload"]``), and whether each
    module shard is a tensor apart from the library's shard; FSDP2's own policy classes."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    import collsched.torch as cst

    import workers

    out = workers.train(rank, world, spec)
    model = cst.fully_shard(models.build("mlp", 0), offload_policy=cst.CPUOffloadPolicy())
    homes = [p._collsched_param[1].home for p in model.parameters()]
    out["apart"] = all(h.data_ptr() != p.data_ptr() or h.numel() == 0 for h, p in zip(homes, model.parameters()))
    out["policy"] = error_text(lambda: cst.fully_shard(models.build("mlp", 1), offload_policy=CPUOffloadPolicy()))
    cst.fully_shard(models.build("mlp", 2), offload_policy=OffloadPolicy())
    out["bad"] = error_text(lambda: cst.fully_shard(models.build("mlp", 3), offload_policy="cpu"))
    return out


def divided(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """torch's own FSDP2 with ``set_gradient_divide_factor(spec["divide"])`` (and a forced sum)
    on every block, not the root, on the job's process group: every step's loss and the full
    parameters after it."""
    from torch.distributed.fsdp import fully_shard

    import workers

    name = spec["model"]
    model = models.build(name, spec.get("seed", 0))
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    for b in model.blocks:
        b.set_gradient_divide_factor(spec["divide"])
        b.set_force_sum_reduction_for_comms(True)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    out: dict[str, Any] = {"losses": [], "params": []}
    for step in range(spec["steps"]):
        x, y = models.batch(name, spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item()])
        out["params"].append(workers.snapshot({n: p.full_tensor().detach() for n, p in model.named_parameters()}))
    return out


def divide_refusals(rank: int, world: int) -> dict[str, str]:
    """The gradient reduction policy's refusals: a factor of 0 and a NaN, and
    ``set_requires_all_reduce`` with replica groups (``hybrid:1`` at 2 ranks: taken, no error;
    ``False`` set on a block before the root's ``fully_shard`` defers the model's first
    backward's reduction, ``True`` then the next's), as their error texts and the two
    backwards' reduce-scatter counts; each leaves the model training."""
    import collsched.torch as cst

    cst.init()
    model = models.build("mlp", 0)
    for b in model.blocks:
        cst.fully_shard(b, strategy="hybrid:1")
    # Set on a block before the root's call: the whole model's flag after it.
    model.blocks[0].set_requires_all_reduce(False)
    cst.fully_shard(model, strategy="hybrid:1")
    out: dict[str, Any] = {
        "zero": error_text(lambda: model.blocks[0].set_gradient_divide_factor(0)),
        "nan": error_text(lambda: model.blocks[0].set_gradient_divide_factor(float("nan"))),
    }
    x, y = models.batch("mlp", 0, 0, 0, rank)
    models.loss_fn("mlp", model(x), y).backward()
    out["deferred"] = cst.stats(model)["reduce_scatters"]
    out["hybrid"] = error_text(lambda: model.set_requires_all_reduce(True))
    models.loss_fn("mlp", model(x), y).backward()
    out["reduced"] = cst.stats(model)["reduce_scatters"]
    return out


def fsdp2_methods(rank: int, world: int) -> dict[str, Any]:
    """FSDP2's other module methods and ``shard_placement_fn`` on a collsched-sharded model:
    the accepted ones as calls that change nothing (the model then trains), the refused ones
    as their error texts."""
    from torch.distributed.fsdp import FSDPModule, share_comm_ctx
    from torch.distributed.tensor import Shard

    import collsched.torch as cst

    cst.init()
    model = models.build("mlp", 0)
    out = {
        "placement": error_text(
            lambda: cst.fully_shard(model.blocks[0], shard_placement_fn=lambda p: Shard(p.dim() - 1))
        )
    }
    for b in model.blocks:
        cst.fully_shard(b, shard_placement_fn=lambda p: Shard(0))
    cst.fully_shard(model, shard_placement_fn=lambda p: None)
    accepted = [
        lambda: model.set_post_optim_event(None),
        lambda: model.blocks[0].set_unshard_in_backward(False),
        lambda: model.set_allocate_memory_from_process_group_for_comm(True),
        lambda: model.set_symm_mem_for_comm(),
        lambda: model.set_reduce_scatter_unused_params(True),
        lambda: model.set_reduce_scatter_max_input_buffers(2),
        lambda: model.set_keep_unsharded_storage(False),
        lambda: model.set_separate_reduce_scatter_group(),
    ]
    out["accepted"] = [error_text(f) for f in accepted]
    out["refused"] = [
        error_text(lambda: model.set_custom_all_gather(object())),
        error_text(lambda: model.set_custom_reduce_scatter(object())),
        error_text(lambda: model.set_all_reduce_hook(lambda g: None)),
    ]
    out["other"] = {
        "keep": error_text(lambda: model.set_keep_unsharded_storage(True)),
        "buffers_0": error_text(lambda: model.set_reduce_scatter_max_input_buffers(0)),
        "buffers_bool": error_text(lambda: model.set_reduce_scatter_max_input_buffers(True)),
        "dp_mesh_dims": error_text(lambda: cst.fully_shard(models.build("mlp", 1), dp_mesh_dims=("dp",))),
        "not_manual": error_text(model.finalize_backward),
        # An FSDPModule (code that drives FSDP2's modules by their methods drives it), whose
        # FSDP2 state is its communication context alone (torch's share_comm_ctx sets it), the
        # rest refused by name.
        "fsdp_module": [isinstance(m, FSDPModule) for m in (model, model.blocks[0])],
        "fsdp_state": error_text(lambda: model._get_fsdp_state()._fsdp_param_group),
        "share_comm_ctx": error_text(lambda: share_comm_ctx([model, model.blocks[0]])),
        "shared": model._get_fsdp_state()._comm_ctx is model.blocks[0]._get_fsdp_state()._comm_ctx,
        "manual_on_block": error_text(lambda: model.blocks[0].set_manual_backward_finalization(True)),
        # init() again: the same backend or none is the world joined; another is refused.
        "init_again": [error_text(cst.init), error_text(lambda: cst.init("shm"))],
        "init_other": error_text(lambda: cst.init("emulated")),
    }
    model.set_manual_backward_finalization(True)
    out["other"]["before_forward"] = error_text(model.finalize_backward)
    out["other"]["finalize_on_block"] = error_text(model.blocks[0].finalize_backward)
    x, y = models.batch("mlp", 0, 0, 0, rank)
    loss = models.loss_fn("mlp", model(x), y)
    out["other"]["before_backward"] = error_text(model.finalize_backward)
    loss.backward()
    out["other"]["after_backward"] = error_text(model.finalize_backward)
    out["grads"] = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    return out


def finalized(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Gradient accumulation as torch.distributed.pipelining drives FSDP2: manual finalization,
    each micro-batch's backward under ``set_requires_gradient_sync(False)`` and
    ``set_reshard_after_backward(False)`` (``spec["last_synced"]``: but the last one's), then
    both True and ``finalize_backward(async_op=True).wait()`` before the optimizer's step;
    collsched's model (sharded as ``workers.shard`` does: ``backend``, ``strategy``, ``mp``), or
    torch's FSDP2 (``spec["fsdp2"]``) on the job's process group. Every step's losses and the
    full parameters after it."""

    import workers

    name = spec["model"]
    model = models.build(name, spec.get("seed", 0))
    if spec.get("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    else:
        model = workers.shard(model, spec)
    model.set_manual_backward_finalization(True)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    out: dict[str, Any] = {"losses": [], "params": []}
    micro_n = spec["micro"]
    for step in range(spec["steps"]):
        row = []
        for micro in range(micro_n):
            synced = bool(spec.get("last_synced")) and micro + 1 == micro_n
            model.set_requires_gradient_sync(synced)
            model.set_reshard_after_backward(synced)
            x, y = models.batch(name, spec.get("seed", 0), step, micro, rank)
            loss = models.loss_fn(name, model(x), y)
            loss.backward()
            row.append(loss.item())
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.finalize_backward(async_op=True).wait()
        opt.step()
        opt.zero_grad()
        out["losses"].append(row)
        out["params"].append(workers.snapshot(full_of(model, spec.get("fsdp2", False))))
    return out


def full_of(model: torch.nn.Module, fsdp2: bool) -> dict[str, torch.Tensor]:
    """Every parameter's full value: torch's FSDP2's (``fsdp2``: its DTensors') or collsched's."""
    import collsched.torch as cst

    if fsdp2:
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return cst.full_parameters(model)


def grouped(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's grouping: the gpt's blocks each, then a list of modules as one unit
    (``spec["group"]``: ``"ends"``, the final norm and the head, kept fetched from forward to
    backward as torchtitan keeps them; ``"tied"``, the token embedding and the head that shares
    its weight, released after each one's forward), then the root; the blocks prefetch the
    list's unit by one of its modules (``set_modules_to_forward_prefetch``); ``spec["micro"]``
    micro-batches a step, all but the last unsynchronized; collsched's (on ``spec["backend"]``,
    with ``spec["mp"]``), or torch's FSDP2 (``spec["fsdp2"]``). Every step's losses and full
    parameters."""
    import collsched.torch as cst

    import workers

    fsdp2 = spec.get("fsdp2", False)
    if fsdp2:
        from torch.distributed.fsdp import fully_shard
    else:
        mp = cst.MixedPrecisionPolicy(**spec["mp"]) if spec.get("mp") else None
        fully_shard = functools.partial(cst.fully_shard, bucket_mb=spec["bucket_mb"], mp_policy=mp)  # type: ignore[assignment]
        cst.init(spec.get("backend", "shm"))
    name = spec["model"]
    model = models.build(name, spec.get("seed", 0))
    for b in model.blocks:
        fully_shard(b)
    if spec["group"] == "ends":
        group = fully_shard([model.ln, model.head], reshard_after_forward=False)
    else:
        group = fully_shard([model.tok, model.head])
    out: dict[str, Any] = {"returned": [type(m).__name__ for m in group]}
    fully_shard(model)
    model.blocks[-1].set_modules_to_forward_prefetch(
        [model.head, model.ln] if spec["group"] == "ends" else [model.head]
    )
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    out["losses"], out["params"] = [], []
    micro_n = spec.get("micro", 1)
    for step in range(spec["steps"]):
        row = []
        for micro in range(micro_n):
            # Accumulation: every micro-batch but the last unsynchronized.
            model.set_requires_gradient_sync(micro + 1 == micro_n)
            x, y = models.batch(name, spec.get("seed", 0), step, micro, rank)
            loss = models.loss_fn(name, model(x), y)
            loss.backward()
            row.append(loss.item())
        opt.step()
        opt.zero_grad()
        out["losses"].append(row)
        out["params"].append(workers.snapshot(full_of(model, fsdp2)))
    if not fsdp2:
        out["stats"] = cst.stats(model)
        out["units"] = len(model.__dict__["_collsched_state"].units)
    return out


def reset_after(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A micro-batch accumulated under ``no_sync``, then a training pass that raises
    (``spec["where"]``: in block 1's forward, or in the backward once the blocks after block 0
    are done), then ``reset_iter_state()`` on the root: the steps after must train as if
    neither had happened. Returns the error the pass raised, the refusal on a block, and
    every step's losses and parameters."""
    import collsched.torch as cst

    name = spec["model"]
    cst.init()
    model = shard(models.build(name, spec.get("seed", 0)), "even", spec["bucket_mb"])
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    x, y = models.batch(name, 77, 0, 0, rank)
    with model.no_sync():
        models.loss_fn(name, model(x), y).backward()

    def boom(*_: Any) -> None:
        raise RuntimeError("injected failure")

    def boom_in_backward(_m: Any, _a: Any, o: torch.Tensor) -> None:
        o.register_hook(boom)

    if spec["where"] == "forward":
        hook = model.blocks[1].register_forward_pre_hook(boom)
    else:
        hook = model.blocks[0].register_forward_hook(boom_in_backward)
    out: dict[str, Any] = {"raised": error_text(lambda: models.loss_fn(name, model(x), y).backward())}
    hook.remove()
    out["on_block"] = error_text(model.blocks[0].reset_iter_state)
    model.reset_iter_state()
    out["losses"], out["params"] = train_steps(model, opt, range(spec["steps"]), rank)
    return out


def group_refusals(rank: int, world: int) -> dict[str, Any]:
    """``fully_shard([...])``'s refusals as their error texts, and the same list given twice."""
    import collsched.torch as cst

    cst.init()
    m = models.build("gpt", 0)
    b = m.blocks[0]
    x, _ = models.batch("gpt", 0, 0, 0, rank)
    out = {
        "twice": error_text(lambda: cst.fully_shard([m.head, m.head])),
        "nested": error_text(lambda: cst.fully_shard([b, b.fc])),
        "int": error_text(lambda: cst.fully_shard([m.ln, m.head], reshard_after_forward=2)),
    }
    group = cst.fully_shard([m.ln, m.head])
    out["again"] = cst.fully_shard([m.ln, m.head]) == group == [m.ln, m.head]
    out["unplanned"] = error_text(lambda: m(x))
    out["member_as_root"] = error_text(lambda: cst.fully_shard(m.head))
    out["regrouped"] = error_text(lambda: cst.fully_shard([m.head, m.tok]))
    return out


def reused(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """:class:`models.Reused` trained with SGD: its block sharded (called twice in each
    forward), the head sharded too (``spec["head_unit"]``: called per chunk after the root's
    forward) or left in the root's unit (FSDP2's default keeps the root fetched from its
    forward into its backward, where the head runs), then the root; collsched's or torch's
    FSDP2 (``spec["fsdp2"]``). Every step's loss and full parameters."""
    import collsched.torch as cst

    import workers

    fsdp2 = spec.get("fsdp2", False)
    if fsdp2:
        from torch.distributed.fsdp import fully_shard
    else:
        fully_shard = functools.partial(cst.fully_shard, bucket_mb=0.0002)  # type: ignore[assignment]
        cst.init("shm")
    torch.manual_seed(0)
    model = models.Reused()
    fully_shard(model.block)
    if spec["head_unit"]:
        fully_shard(model.head)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out: dict[str, Any] = {"losses": [], "params": []}
    for step in range(spec["steps"]):
        loss = models.reused_step(model, *models.reused_batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item()])
        out["params"].append(workers.snapshot(full_of(model, fsdp2)))
    return out


def retained(rank: int, world: int) -> dict[str, Any]:
    """:class:`models.Reused` sharded as :func:`reused` does (the head in the root's unit):
    a chunked loss's chunks backward one at a time through a retained graph. The first
    backward ends the step and releases the root, whose full head weight the other chunks
    saved outside the saved-tensor hooks: the second backward's error, then a plain step."""
    import collsched.torch as cst

    cst.init("shm")
    torch.manual_seed(0)
    model = models.Reused()
    cst.fully_shard(model.block, bucket_mb=0.0002)
    cst.fully_shard(model, bucket_mb=0.0002)
    x, y = models.reused_batch(0, rank)
    h = model(x)
    losses = [((model.head(c) - t) ** 2).sum() for c, t in zip(h.chunk(3), y.chunk(3))]
    losses[0].backward(retain_graph=True)
    out: dict[str, Any] = {"second": error_text(lambda: losses[1].backward(retain_graph=True))}
    loss = models.reused_step(model, *models.reused_batch(1, rank))
    loss.backward()
    out["after"] = loss.item()
    out["live"] = cst.live_bytes(model)
    return out
