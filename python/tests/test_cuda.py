"""collsched.torch on the cuda backend (one GPU per process, NCCL): an unmodified training
loop against plain unsharded PyTorch, shards, gradients and the optimizer on the device,
gradient accumulation under no_sync kept in the device gradients, autocast, activation
checkpointing, checkpoints. These run with ``COLLSCHED_GPU=1`` on a machine with a CUDA device,
one rank per device (NCCL takes one rank per device), at 2 ranks where there are 2 devices and
at 1 where there is one; skipped otherwise. Against plain PyTorch on the same GPU, f32 parity
is to 1e-6 relative; against the CPU's kernels (which sum in another order), 1e-4.

Without a GPU (here): ``init(backend="cuda")`` and the native ``World.cuda`` are clear errors."""

from __future__ import annotations

import os

import pytest
import torch

from collsched.torch.world import hybrid_groups

import models
import parity
import workers
from ranks import run, run_all

GPU = os.environ.get("COLLSCHED_GPU") == "1"
needs_gpu = pytest.mark.skipif(not GPU, reason="no GPU here: set COLLSCHED_GPU=1 on a machine with CUDA devices")
# cuBLAS against the CPU's kernels, over a few AdamW steps.
TOL = (1e-4, 1e-5)
# The same in bf16 (parity.py's bf16 default is exact, for the CPU's own kernels): cuBLAS's bf16
# products round in another order, about a bf16 ulp (2**-7 relative).
TOL_BF16 = (1e-2, 1e-3)


def devices() -> int:
    return torch.cuda.device_count() if GPU else 0


def ranks() -> int:
    """Ranks of a GPU test: one per device, at most 2."""
    n = min(2, devices())
    assert n >= 1, "COLLSCHED_GPU=1 but torch sees no CUDA device"
    return n


# Against plain PyTorch on the same GPU (the same kernels on the same shapes): f32 to 1e-6.
TOL_SAME_GPU = (1e-6, 1e-7)


@needs_gpu
@pytest.mark.parametrize("strategy", ["even", "flat", "greedy"])
def test_fully_shard_on_cuda_matches_plain_pytorch_on_the_same_gpu(strategy):
    spec = {"model": "gpt", "steps": 3, "strategy": strategy, "bucket_mb": 0.002, "backend": "cuda"}
    spec["ref_device"] = "cuda"
    n = ranks()
    parity.check(run(workers.train, n, spec), models.reference(spec, n), tol=TOL_SAME_GPU)


@needs_gpu
def test_gathered_buckets_land_where_their_views_are_on_cuda():
    """The device pool hands a bucket gathered again the block it had (or one of the few it
    had, while its last one waits for its events; a parameter keeps views of 16): after the
    first steps no fetch makes a new tensor over a gathered buffer (each costs a DLPack export
    and import and the saved-tensor hooks' spans set again); and the training is plain
    PyTorch's. (On ``shm`` the same model's counts settle within 8-10 steps.)"""
    spec = {"model": "gpt", "steps": 12, "bucket_mb": 0.002, "backend": "cuda", "ref_device": "cuda"}
    n = ranks()
    runs = run(workers.train, n, spec)
    parity.check(runs, models.reference(spec, n), tol=TOL_SAME_GPU)
    for rank, r in enumerate(runs):
        made = [s["views_made"] for s in r["stats"]]
        assert made[0] > 0 and made[-2:] == [0, 0], f"rank {rank}: views made by step {made}"


@needs_gpu
def test_fully_shard_on_cuda_matches_plain_pytorch_on_the_cpu():
    """Against the CPU's kernels, with SGD: AdamW's first step moves every element by about its
    learning rate whatever the gradient's size, so a gradient that is zero but for rounding
    (the attention's key bias) takes either sign on the two devices (measured on an H100:
    0.004 apart after one step); SGD moves it by the gradient itself."""
    spec = {"model": "gpt", "steps": 3, "opt": "sgd", "bucket_mb": 0.002, "backend": "cuda"}
    n = ranks()
    parity.check(run(workers.train, n, spec), models.reference(spec, n), tol=TOL)


@needs_gpu
@pytest.mark.parametrize("recompute", [None, ("wrapper", False)], ids=["autocast", "autocast-recompute"])
def test_bf16_autocast_and_activation_checkpointing_on_cuda(recompute):
    """torch.autocast(bf16) over f32 parameters, no_sync micro-batches, and activation
    checkpointing: plain PyTorch under the same autocast on the same GPU."""
    spec = {
        "model": "gpt",
        "steps": 3,
        "micro": 2,
        "autocast": torch.bfloat16,
        "recompute": recompute,
        "bucket_mb": 0.002,
        "backend": "cuda",
        "ref_device": "cuda",
    }
    n = ranks()
    parity.check(run(workers.train, n, spec), models.reference(spec, n), tol=TOL_SAME_GPU)


@needs_gpu
def test_checkpoint_saved_and_loaded_on_cuda(tmp_path):
    n = ranks()
    path = str(tmp_path / "ckpt")
    spec = {"model": "gpt", "steps": 4, "split": 2, "save_world": n, "bucket_mb": 0.002, "backend": "cuda"}
    spec["ref_device"] = "cuda"
    first = run(workers.checkpointed, n, spec, path, "save")
    later = run(workers.checkpointed, n, spec, path, "load")
    ref = models.reference(spec, n)
    parity.check(first, {"params": ref["params"][:2], "losses": ref["losses"][:2]}, tol=TOL_SAME_GPU)
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]}, tol=TOL_SAME_GPU)


@needs_gpu
def test_no_sync_on_cuda_accumulates_in_the_device_gradients():
    spec = {"model": "mlp", "steps": 3, "micro": 3, "strategy": "even", "bucket_mb": 0.0005, "backend": "cuda"}
    n = ranks()
    runs = run(workers.train, n, spec)
    parity.check(runs, models.reference(spec, n), tol=TOL)
    for rank, r in enumerate(runs):
        synced = [s["reduce_scatters"] for s in r["stats"][2::3]]
        assert all(n > 0 for n in synced), f"rank {rank}: a synchronized micro-batch reduced nothing: {synced}"
        assert all(s["reduce_scatters"] == 0 for i, s in enumerate(r["stats"]) if i % 3 != 2), (
            f"rank {rank}: a no_sync micro-batch reduced"
        )


@needs_gpu
@pytest.mark.parametrize(
    "model, micro, bucket_mb",
    [("gpt", 1, 0.002), ("mlp", 3, 0.0005)],
    ids=["gpt", "mlp-no_sync-accumulated-in-f32"],
)
def test_bf16_parameters_reduced_in_f32_on_cuda(model, micro, bucket_mb):
    # With micro-batches, the no_sync ones accumulate in the reduction dtype (f32).
    spec = {
        "model": model,
        "steps": 3,
        "micro": micro,
        "dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "opt": "sgd",
        "bucket_mb": bucket_mb,
        "backend": "cuda",
    }
    n = ranks()
    runs = run(workers.train, n, spec)
    parity.check(runs, models.reference(spec, n), tol=TOL_BF16)


@needs_gpu
@pytest.mark.parametrize(
    "extra, tol",
    [({"micro": 2}, TOL), ({"dtype": torch.bfloat16, "reduce_dtype": torch.float32}, TOL_BF16)],
    ids=["f32-no_sync", "bf16-reduced-in-f32"],
)
def test_cpu_offload_on_cuda_matches_plain_pytorch_on_the_cpu(extra, tol):
    """``CPUOffloadPolicy`` on the cuda backend: the optimizer's shards in page-locked host
    memory (one tensor per dtype, moved by one copy a pass), gradients copied to them at the
    step's end; with SGD, against the CPU's kernels."""
    spec = {"model": "gpt", "steps": 3, "opt": "sgd", "bucket_mb": 0.002, "backend": "cuda", "offload": True, **extra}
    n = ranks()
    runs = run(workers.train, n, spec)
    parity.check(runs, models.reference(spec, n), tol=tol)
    for rank, r in enumerate(runs):
        assert {(dev, pinned) for dev, pinned, _at in r["places"]} == {("cpu", True)}, (rank, r["places"])
        assert len({at for _dev, _pin, at in r["places"]}) == 1, (rank, r["places"])


@needs_gpu
def test_empty_cache_returns_the_pool_s_free_blocks_between_steps_and_training_goes_on():
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "backend": "cuda", "empty_cache": True}
    spec["ref_device"] = "cuda"
    n = ranks()
    runs = run(workers.train, n, spec)
    parity.check(runs, models.reference(spec, n), tol=TOL_SAME_GPU)
    for rank, r in enumerate(runs):
        assert len(r["memory"]) == 3, r["memory"]
        for step, (before, freed, after) in enumerate(r["memory"]):
            where = f"rank {rank}, step {step}: {before} -> {freed} -> {after}"
            parts = before["in_use_bytes"] + before["deferred_bytes"] + before["free_bytes"]
            assert before["reserved_bytes"] == parts > 0 and before["in_use_bytes"] > 0, where
            assert after["free_bytes"] == after["deferred_bytes"] == 0, where
            assert after["reserved_bytes"] == before["reserved_bytes"] - freed, where
            assert after["in_use_bytes"] == before["in_use_bytes"], where
        # Every step after the first gathers into buffers the cache gave back: it allocated.
        assert r["memory"][1][0]["fresh_allocations"] > r["memory"][0][2]["fresh_allocations"], r["memory"]


@needs_gpu
def test_hybrid_on_cuda_at_4_ranks():
    if devices() < 4:
        pytest.skip(f"hybrid:2 needs 4 CUDA devices, this machine has {devices()}")
    spec = {"model": "gpt", "steps": 3, "strategy": "hybrid:2", "bucket_mb": 0.002, "backend": "cuda"}
    runs = run(workers.train, 4, spec)
    parity.check(runs, models.reference(spec, 4), tol=TOL)


@pytest.mark.skipif(GPU, reason="checks the error of a machine without a GPU")
def test_init_cuda_without_a_gpu_is_a_clear_error():
    out = run_all(workers.init_cuda, 1)
    ok, msg = out[0]
    assert ok, msg
    assert msg.startswith("CollschedError") and "init(backend='cuda')" in msg, msg
    assert "no CUDA device" in msg or "built without the cuda backend" in msg, msg


@pytest.mark.skipif(GPU, reason="checks the error of a machine without a GPU")
def test_the_native_cuda_world_without_a_driver_is_every_ranks_error_not_a_hang():
    out = run_all(workers.world_cuda, 2)
    for rank in (0, 1):
        ok, msg = out[rank]
        assert ok, msg
        assert msg.startswith("CollschedError: World.cuda:"), msg
        # Each rank names every rank that failed, and why (no driver, here).
        assert "rank 0: " in msg and "rank 1: " in msg and "CUDA" in msg, msg


def test_the_store_exchange_gathers_every_rank_and_carries_the_cuda_world_s_report():
    out = run(workers.world_cuda_through_the_store, 3, init="torch")
    for rank, got in enumerate(out):
        for k in range(2):
            assert got["rounds"][k] == [f"rank {r} round {k}" * (r + 1) for r in range(3)], (rank, got)
        assert got["rounds"][2] == ["", "", ""], got
        # World.cuda met the others through the exchange: one more round.
        assert got["calls"] == 4, got
        # Only the last round's keys are left in the store.
        assert got["kept"] == [[False] * 3] * 3 + [[True] * 3], got["kept"]
        if not GPU:
            msg = got["error"]
            assert msg.startswith("CollschedError: World.cuda:"), msg
            assert all(f"rank {r}: " in msg for r in range(3)) and "CUDA" in msg, msg


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_the_test_models_make_no_tensor_on_the_cpu_in_forward(name):
    """The models' forward on the meta device, as the GPU tests run them on a GPU: a tensor
    made on the CPU inside (a mask, positions) is refused there as on a GPU."""
    x, _ = models.batch(name, 0, 0, 0, 0, torch.float32)
    want = models.build(name, 0)(x)
    out = models.build(name, 0).to("meta")(x.to("meta"))
    assert out.device.type == "meta" and out.shape == want.shape, (out.device, out.shape, want.shape)


def test_hybrid_groups_are_the_shard_then_the_replica_groups():
    assert hybrid_groups(4, 2) == [[0, 1], [2, 3], [0, 2], [1, 3]]
    assert hybrid_groups(6, 3) == [[0, 1, 2], [3, 4, 5], [0, 3], [1, 4], [2, 5]]
    # One group of everyone is the world itself: not declared again.
    assert hybrid_groups(4, 4) == [[0], [1], [2], [3]]
    with pytest.raises(Exception, match="must divide"):
        hybrid_groups(6, 4)
