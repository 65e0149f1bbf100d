"""What each rank runs in test_spans.py: a sharded gpt trained a few steps, then its flight
record (collectives and compute spans) and its simulator workload."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import models
from workers import shard, snapshot


def traced(rank: int, world: int, spec: dict[str, Any], out: str) -> dict[str, Any]:
    """Trains like ``workers.train`` (losses and parameters for the parity check), then writes
    this rank's flight record into ``out`` and the workload as ``out/workload-R.json``."""
    import collsched.torch as cst

    name = spec["model"]
    recompute = spec.get("recompute")
    model = shard(models.build(name, 0, torch.float32, recompute and tuple(recompute)), spec)
    opt = models.optimizer("adamw", model.parameters())
    losses, after = [], []
    for step in range(spec["steps"]):
        x, y = models.batch(name, 0, step, 0, rank)
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item()])
        after.append(snapshot(cst.full_parameters(model)))
    if spec.get("eval_after"):
        # An evaluation pass after the last step adds no compute span.
        with torch.no_grad():
            model(models.batch(name, 9, 0, 0, rank)[0])
    record = cst.flight_record(out)
    workload = cst.workload_record(model, f"{out}/workload-{rank}.json")
    stats = cst.stats(model)
    # The plain model's parameters (a tied one once), as the workload should name them.
    shapes = {n: list(p.shape) for n, p in models.build(name).named_parameters()}
    return {"losses": losses, "params": after, "record": record, "workload": workload, "shapes": shapes, "stats": stats}


def raised_in_backward(rank: int, world: int) -> list[dict[str, Any]]:
    """Three steps, the second's backward raising in blocks.0's (caught, then ``zero_grad``):
    this rank's compute spans."""
    import collsched.torch as cst

    model = shard(models.build("gpt"), {"bucket_mb": 0.002})
    opt = models.optimizer("adamw", model.parameters())

    def fail(_grad: torch.Tensor) -> None:
        raise ValueError("injected failure in the backward of blocks.0")

    def hook(_module: torch.nn.Module, _args: Any, out: torch.Tensor) -> None:
        out.register_hook(fail)

    for step in range(3):
        x, y = models.batch("gpt", 0, step, 0, rank)
        arm = model.blocks[0].register_forward_hook(hook) if step == 1 else None
        try:
            models.loss_fn("gpt", model(x), y).backward()
            opt.step()
            assert arm is None, "the injected failure did not propagate"
        except ValueError as e:
            assert arm is not None and "injected failure" in str(e), e
        finally:
            if arm is not None:
                arm.remove()
        opt.zero_grad()
    return cst.flight_record()["compute"]


def raised_in_forward(rank: int, world: int) -> list[dict[str, Any]]:
    """Three steps, the second's first forward raising in blocks.1 (caught, the step's forward
    then run again): this rank's compute spans."""
    import collsched.torch as cst

    model = shard(models.build("gpt"), {"bucket_mb": 0.002})
    opt = models.optimizer("adamw", model.parameters())
    armed = {"on": False}

    def fail(_module: torch.nn.Module, _args: Any) -> None:
        if armed["on"]:
            armed["on"] = False
            raise ValueError("injected failure in blocks.1")

    model.blocks[1].register_forward_pre_hook(fail)
    for step in range(3):
        x, y = models.batch("gpt", 0, step, 0, rank)
        if step == 1:
            armed["on"] = True
            try:
                model(x)
                raise AssertionError("the injected failure did not propagate")
            except ValueError as e:
                assert "injected failure" in str(e), e
        models.loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return cst.flight_record()["compute"]


def refused(rank: int, world: int) -> str:
    """``workload_record`` before any training pass: the error's text."""
    import collsched.torch as cst

    model = shard(models.build("gpt"), {"bucket_mb": 0.002})
    try:
        cst.workload_record(model)
    except cst.CollschedError as e:
        return str(e)
    return "no error"


def accumulated(rank: int, world: int) -> list[dict[str, Any]]:
    """Two steps of two micro-batches, the first under ``no_sync``: this rank's compute spans."""
    import collsched.torch as cst

    model = shard(models.build("gpt"), {"bucket_mb": 0.002})
    opt = models.optimizer("adamw", model.parameters())
    for step in range(2):
        for micro in range(2):
            x, y = models.batch("gpt", 0, step, micro, rank)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                models.loss_fn("gpt", model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return cst.flight_record()["compute"]
