"""What each rank runs in the tests (importable by the processes the tests start)."""

from __future__ import annotations

import contextlib
from typing import Any

import models
import torch


def shard(model: torch.nn.Module, spec: dict[str, Any]) -> torch.nn.Module:
    import collsched.torch as cst

    cst.init()
    opts = {k: spec[k] for k in ("strategy", "bucket_mb", "prefetch", "reduce_dtype") if k in spec}
    for b in model.blocks:
        cst.fully_shard(b, **opts)
    return cst.fully_shard(model, **opts)


def snapshot(values: dict[str, torch.Tensor]) -> dict[str, list]:
    return {n: v.float().flatten().tolist() for n, v in values.items()}


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Trains the spec's model sharded, as the reference does; returns losses, the full
    parameters after every step, and every step's counters."""
    import collsched.torch as cst

    name, dtype = spec["model"], spec.get("dtype", torch.float32)
    model = shard(models.build(name, spec.get("seed", 0), dtype), spec)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    losses, after, stats, evals = [], [], [], []
    micro_n = spec.get("micro", 1)
    for step in range(spec["steps"]):
        frozen = spec.get("frozen", {}).get(step, [])
        for n, p in model.named_parameters():
            p.requires_grad_(not any(n.startswith(f) for f in frozen))
        row = []
        for micro in range(micro_n):
            x, y = models.batch(name, spec.get("seed", 0), step, micro, rank, dtype)
            ctx = model.no_sync() if micro + 1 < micro_n else contextlib.nullcontext()
            with ctx:
                loss = models.loss_fn(name, model(x), y)
                loss.backward()
            stats.append(cst.stats(model))
            row.append(loss.item())
            if spec.get("eval_between") and micro + 1 < micro_n:
                with torch.no_grad():
                    ex, ey = models.batch(name, 99, step, 0, rank, dtype)
                    evals.append(models.loss_fn(name, model(ex), ey).item())
        opt.step()
        opt.zero_grad()
        losses.append(row)
        after.append(snapshot(cst.full_parameters(model)))
    plan = cst.plan(model)
    return {"losses": losses, "params": after, "stats": stats, "evals": evals, "plan": plan}
