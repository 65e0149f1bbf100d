"""What each rank runs in ``test_post_forward.py``: a gpt whose units reshard to some of the ranks
after their forward (FSDP2's int ``reshard_after_forward``)."""

from __future__ import annotations

from typing import Any

import torch

import models
import workers
from surface_workers import error_text


def toggled(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's gpt, its blocks' ``reshard_after_forward`` set between steps to
    ``spec["flags"][step]`` (``set_reshard_after_forward``; the root released after its
    forward throughout: True, not FSDP2's default, which keeps it).
    Losses, full parameters and counters per step; each step's post-forward layout (this rank's
    elements of each parameter there) and the bytes gathered between forward and backward;
    the refusals of a size that is not a factor of the world."""
    import collsched.torch as cst

    cst.init()
    model = models.build("gpt", spec.get("seed", 0))
    for b in model.blocks:
        cst.fully_shard(b, bucket_mb=spec["bucket_mb"], reshard_after_forward=spec["flags"][0])
    cst.fully_shard(model, bucket_mb=spec["bucket_mb"], reshard_after_forward=True)
    state = model.__dict__["_collsched_state"]
    opt = models.optimizer("adamw", model.parameters())
    out: dict[str, Any] = {"losses": [], "params": [], "stats": [], "between": [], "layout": [], "plans": []}
    for step, flag in enumerate(spec["flags"]):
        for b in model.blocks:
            b.set_reshard_after_forward(flag, recurse=False)
        out["layout"].append(
            {
                size: {state.params[pid].name: int(shard.numel()) for pid, (shard, _) in post.shards.items()}
                for size, post in state.post.items()
            }
        )
        out["plans"].append({size: cst_plan(post) for size, post in state.post.items()})
        x, y = models.batch("gpt", spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn("gpt", model(x), y)
        out["between"].append(cst.live_bytes(model))
        loss.backward()
        out["stats"].append(cst.stats(model))
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item()])
        out["params"].append(workers.snapshot(cst.full_parameters(model)))
    out["plan"] = cst.plan(model)
    out["units"] = [(u.reshard, u.post) for u in state.units]
    out["not_factor"] = error_text(lambda: model.blocks[0].set_reshard_after_forward(3))
    out["ctor_not_factor"] = error_text(lambda: cst.fully_shard(models.build("gpt", 0), reshard_after_forward=3))
    out["live_after"] = cst.live_bytes(model)
    return out


def cst_plan(post: Any) -> dict[str, Any]:
    import json

    return json.loads(post.model.plan)


def raising(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A backward that raises in a unit resharded to some ranks, then steps as usual: the
    losses and parameters of the steps after it (the failed step's gradients dropped)."""
    import collsched.torch as cst

    cst.init()
    model = workers.shard(models.build("gpt", spec.get("seed", 0)), spec)
    opt = models.optimizer("adamw", model.parameters())
    out: dict[str, Any] = {"losses": [], "params": []}

    def boom(_g: torch.Tensor) -> None:
        raise ValueError("boom")

    def arm(_m: Any, _a: Any, o: torch.Tensor) -> None:
        o.register_hook(boom)

    # Raised inside block 1's backward: its unit fetched (from the post-forward layout) by then.
    armed = model.blocks[1].fc.register_forward_hook(arm)
    x, y = models.batch("gpt", spec.get("seed", 0), 0, 0, rank)
    loss = models.loss_fn("gpt", model(x), y)
    armed.remove()
    out["raised"] = error_text(loss.backward)
    opt.zero_grad()
    for step in range(spec["steps"]):
        out["losses"].append([train_step(model, opt, step, rank, spec)])
        out["params"].append(workers.snapshot(cst.full_parameters(model)))
        out.setdefault("post", []).append(cst.stats(model)["post_forward"][2]["all_gathers"])
    return out


def train_step(model: torch.nn.Module, opt: Any, step: int, rank: int, spec: dict[str, Any]) -> float:
    """One training step of the gpt on this rank's batch; its loss."""
    x, y = models.batch("gpt", spec.get("seed", 0), step, 0, rank)
    loss = models.loss_fn("gpt", model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def fsdp2(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """torch's own FSDP2 with ``reshard_after_forward=spec["reshard"]`` on every block and the
    root, on the job's process group: losses and full parameters after every step, and the
    sizes of the groups its post-forward meshes gather over."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = models.build("gpt", spec.get("seed", 0))
    for b in model.blocks:
        fully_shard(b, reshard_after_forward=spec["reshard"])
    fully_shard(model, reshard_after_forward=spec["reshard"])
    opt = models.optimizer("adamw", model.parameters())
    out: dict[str, Any] = {"losses": [], "params": []}
    for step in range(spec["steps"]):
        out["losses"].append([train_step(model, opt, step, rank, spec)])
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out["params"].append(workers.snapshot(full))
    state = model._get_fsdp_state()
    info = state._fsdp_param_group.post_forward_mesh_info
    out["post_group"] = None if info is None else dist.get_world_size(info.shard_process_group)
    return out


def tied_before(rank: int, world: int) -> str:
    """A gpt whose blocks share a weight tied before they are sharded one by one: the second
    block's fully_shard, as its error text."""
    import collsched.torch as cst

    cst.init()
    model = models.build("gpt", 0, tied=True)
    cst.fully_shard(model.blocks[0])
    return error_text(lambda: cst.fully_shard(model.blocks[1]))
