"""The scenarios engine users hit, one named test each, against plain PyTorch."""

from __future__ import annotations

import re

import pytest
import torch
from test_surface import gathers_per_step, root_buckets

import models
import parity
import workers
from ranks import run, run_all


def grad_buckets(plan: dict) -> int:
    return sum(1 for b in plan["buckets"] if b["kind"] == "grad")


def gather_buckets(plan: dict) -> int:
    return sum(1 for b in plan["buckets"] if b["kind"] == "gather")


@pytest.mark.parametrize("world", [2, 5])
def test_freeze_a_block_then_unfreeze_with_accumulation_fairscale_369(world):
    # blocks.0 frozen for steps 2, 3, 4 (set after step 1, cleared at step 5), two
    # micro-batches a step: nothing of the change is lost, gradients go where they should.
    frozen = {s: ["blocks.0."] for s in (2, 3, 4)}
    spec = {"model": "gpt", "steps": 6, "micro": 2, "frozen": frozen, "bucket_mb": 0.002}
    runs = run(workers.train, world, spec)
    parity.check(runs, models.reference(spec, world))


def test_gradcache_chunked_backward_reduces_once_per_bucket_deepspeed_no_sync():
    spec = {"model": "gpt", "steps": 3, "micro": 3, "bucket_mb": 0.002}
    runs = run(workers.gradcache, 2, spec)
    # Reference: the same chunked steps in plain PyTorch.
    torch.set_num_threads(1)
    model = models.build("gpt")
    params = dict(model.named_parameters())
    opt = models.optimizer("adamw", model.parameters())
    ref_after = []
    for step in range(spec["steps"]):
        acc = [dict.fromkeys(params) for _ in range(2)]
        for r in range(2):
            batches = [models.batch("gpt", 0, step, c, r) for c in range(spec["micro"])]
            with torch.no_grad():
                reps = [model(x) for x, _ in batches]
            reps = [x.detach().requires_grad_(True) for x in reps]
            loss = sum(models.loss_fn("gpt", z, y) for z, (_, y) in zip(reps, batches))
            grads = torch.autograd.grad(loss, reps)
            for (x, _), g in zip(batches, grads):
                pg = torch.autograd.grad(model(x), list(params.values()), g)
                for n, v in zip(params, pg):
                    acc[r][n] = v if acc[r][n] is None else acc[r][n] + v
        for n, p in params.items():
            p.grad = (acc[0][n] + acc[1][n]) / 2
        opt.step()
        opt.zero_grad()
        ref_after.append({n: p.detach().clone() for n, p in params.items()})
    for rank, r in enumerate(runs):
        n_grad = grad_buckets(r["plan"])
        assert n_grad > 1
        for step, per_chunk in enumerate(r["stats"]):
            assert len(per_chunk) == spec["micro"]
            for c, st in enumerate(per_chunk[:-1]):
                assert st["reduce_scatters"] == 0, f"rank {rank} step {step} chunk {c}: {st}"
                assert st["accumulated_grads"] > 0
            assert per_chunk[-1]["reduce_scatters"] == n_grad, f"rank {rank} step {step}: {per_chunk[-1]}"
        for step, want in enumerate(ref_after):
            for n, w in want.items():
                torch.testing.assert_close(torch.tensor(r["params"][step][n]), w.flatten(), rtol=1e-6, atol=1e-7)


def test_validate_then_fit_two_wrappings_and_evaluation_between_micro_batches_lightning_17523():
    spec = {"model": "gpt", "steps": 3, "micro": 2, "validate_first": True, "eval_between": True, "bucket_mb": 0.002}
    runs = run(workers.train, 2, spec)
    ref = models.reference(spec, 2)
    parity.check(runs, ref)
    for rank, r in enumerate(runs):
        assert len(r["evals"]) == len(ref["evals"][rank]) == spec["steps"]
        torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"][rank]), rtol=1e-6, atol=1e-7)


def test_one_all_gather_per_bucket_per_pass_and_prefetch_hits_bf16_deepspeed_1453():
    spec = {
        "model": "gpt",
        "steps": 4,
        "dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "opt": "sgd",
        "bucket_mb": 0.002,
    }
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2), torch.bfloat16)
    for rank, r in enumerate(runs):
        n = gather_buckets(r["plan"])
        assert n > 2
        for step, st in enumerate(r["stats"]):
            # One gather per bucket in the forward, one in the backward (the root's kept between).
            want = gathers_per_step(r["plan"])
            assert st["all_gathers"] == want, f"rank {rank} step {step}: {st['all_gathers']} gathers, {want} wanted"
            if step > 0:
                assert st["prefetch_hits"] > 0, f"rank {rank} step {step}: no prefetch hit: {st}"
                assert st["prefetch_misses"] < st["prefetch_hits"]
            assert st["peak_gathered_bytes"] > 0
            assert st["reduce_scatters"] == grad_buckets(r["plan"])


@pytest.mark.parametrize("where", models.RECOMPUTE)
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_recomputes_with_the_units_gathered(where, reentrant):
    """torch.utils.checkpoint around the blocks' calls, a checkpoint_wrapper around each block
    (torchtitan's order: wrap, then shard), or around a block's MLP inside it; reentrant or
    not; with no_sync micro-batches. The recomputation in the backward reads the gathered
    parameters: the same losses and parameters as plain PyTorch without checkpointing, one
    all-gather per bucket per pass (the root's once a step: kept into the backward), nothing
    left gathered."""
    spec = {"model": "gpt", "steps": 3, "micro": 2, "bucket_mb": 0.002, "recompute": (where, reentrant)}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))
    for rank, r in enumerate(runs):
        want = gathers_per_step(r["plan"])
        assert [st["all_gathers"] for st in r["stats"]] == [want] * 6, f"rank {rank}: {want} a pass wanted"
        assert r["live"] == 0, f"rank {rank}: {r['live']} bytes still gathered"


@pytest.mark.parametrize(
    ("world", "strategy", "norm"), [(2, "even", 2.0), (4, "hybrid:2", 2.0), (3, "greedy", float("inf"))]
)
def test_gradient_clipping_takes_the_norm_over_every_rank(world, strategy, norm):
    """An unmodified loop's torch.nn.utils.clip_grad_norm_(model.parameters(), ...) on the
    shards: the norm of the whole model's gradient (hybrid replicas counted once), every rank
    scaled alike, as plain PyTorch clips the unsharded model. SGD: AdamW's step turns the
    last-bit difference of the clip factor (the norm summed in another order) into visible ones
    on gradients that are zero but for rounding (the attention's key bias)."""
    spec = {
        "model": "gpt",
        "steps": 3,
        "strategy": strategy,
        "bucket_mb": 0.002,
        "clip": 0.05,
        "clip_norm": norm,
        "opt": "sgd",
    }
    runs = run(workers.train, world, spec)
    ref = models.reference(spec, world)
    assert len(ref["norms"]) == spec["steps"] and all(n > spec["clip"] for n in ref["norms"]), ref["norms"]
    parity.check(runs, ref)
    for rank, r in enumerate(runs):
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0, msg=f"rank {rank}"
        )


def test_clipping_refuses_shards_mixed_with_other_tensors():
    for message in run(workers.clip_mixed, 2):
        assert "shards of collsched.torch.fully_shard and other tensors" in message, message
        assert "(3, 2)" in message, message


def test_forward_only_passes_leave_nothing_in_flight():
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002}
    runs = run(workers.forward_only, 2, spec)
    parity.check(runs, models.reference(spec, 2))
    for r in runs:
        assert r["live"] == [0] * (2 * spec["steps"])


@pytest.mark.parametrize("nested", [False, True])
def test_a_unit_hands_its_gradients_over_and_is_released_when_its_backward_is_done(nested):
    spec = {"bucket_mb": 0.0005, "nested": nested}
    for r in run(workers.post_backward_order, 2, spec):
        # The later blocks' gradients are in and their units released before the backward
        # reaches the first block; the first block's (its input needs no gradient) and the
        # root's go at the end. With `nested`, the blocks' input is inside a dict.
        assert r["handed"] == ["blocks.1.bias", "blocks.1.weight", "blocks.2.bias", "blocks.2.weight"], r
        block = "_DictIn" if nested else "Linear"
        assert r["units"][2:] == [block, block], r["units"]
        assert r["released"][2:] == [True, True] and not r["released"][0], r["released"]


def test_a_rank_that_raises_in_its_forward_is_named_by_the_others():
    out = run_all(workers.raise_in_forward, 3, {"model": "gpt", "bucket_mb": 0.002}, timeout=120)
    ok1, text1 = out[1]
    assert not ok1 and "rank 1 failed in its forward" in text1
    for r in (0, 2):
        ok, text = out[r]
        assert not ok, f"rank {r} finished although rank 1 failed"
        first = text.splitlines()[0]
        assert "collsched" in first and "Error" in first, first
        assert re.search(r"ranks? \[?1\b", text), text


def test_init_through_torch_distributed():
    spec = {"model": "mlp", "steps": 2, "bucket_mb": 0.0005}
    runs = run(workers.train, 2, spec, init="torch")
    parity.check(runs, models.reference(spec, 2))


@pytest.mark.parametrize("lists", [False, True])
def test_explicit_prefetch_hits_from_the_first_step(lists):
    """Explicit rules (the defaults, or the same given as lists): from the first step every
    gather is a prefetch hit but the root's in the forward, which nothing prefetches; the
    root, kept into its backward, fires its backward rule there (the last block ahead)."""
    spec = {"model": "gpt", "steps": 3, "prefetch": "explicit", "bucket_mb": 0.002, "explicit_lists": lists}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))
    for r in runs:
        for step, st in enumerate(r["stats"]):
            assert st["all_gathers"] == gathers_per_step(r["plan"]), f"step {step}: {st}"
            assert st["prefetch_misses"] == len(root_buckets(r["plan"])), f"step {step}: {st}"
            assert st["prefetch_hits"] == st["all_gathers"] - st["prefetch_misses"], f"step {step}: {st}"
