"""collsched.torch.fully_shard against plain unsharded PyTorch: losses and full parameters
after every step, at 2, 3 and 4 ranks, every strategy, f32 and bf16."""

from __future__ import annotations

import pytest
import torch
from test_surface import root_buckets

import models
import parity
import workers
from ranks import run


@pytest.mark.parametrize("world", [2, 3])
def test_mlp_odd_sizes_even(world):
    spec = {"model": "mlp", "steps": 3, "strategy": "even", "bucket_mb": 0.0005}
    runs = run(workers.train, world, spec)
    parity.check(runs, models.reference(spec, world))


@pytest.mark.parametrize("strategy", ["even", "flat", "greedy", "hybrid:2"])
def test_gpt_every_strategy_at_4_ranks(strategy):
    spec = {"model": "gpt", "steps": 3, "strategy": strategy, "bucket_mb": 0.002}
    runs = run(workers.train, 4, spec)
    parity.check(runs, models.reference(spec, 4))


@pytest.mark.parametrize("micro", [1, 2])
def test_the_backward_on_another_thread_as_autograd_runs_it_on_cuda(micro):
    """On CUDA, autograd runs backward functions and saved-tensor hooks on its own device
    thread: the package's native objects (made on the thread that sharded the model) are used
    from it. Here every backward runs on a new thread, with activation checkpointing (whose
    recomputation fetches from that thread) and no_sync micro-batches."""
    spec = {
        "model": "gpt",
        "steps": 2,
        "micro": micro,
        "bucket_mb": 0.002,
        "backward_thread": True,
        "recompute": ("wrapper", False),
    }
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))


@pytest.mark.parametrize("strategy", ["even", "flat", "greedy"])
def test_the_device_paths_run_on_the_emulated_device(strategy):
    """What fully_shard does on a GPU, run on the CPU by the emulated device (the shm backend
    seen as a device, ``init("emulated")``): blocks then the root sharded (the root reads the
    blocks' gathered values), gradients given in the reduction dtype and packed on the compute
    stream, reduced shards read from library memory that refuses host reads, releases after
    the compute stream's event; against plain PyTorch, exactly."""
    spec = {"model": "gpt", "steps": 3, "strategy": strategy, "bucket_mb": 0.002, "backend": "emulated"}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))


@pytest.mark.parametrize(
    "dtype, reduce_dtype",
    [(torch.float32, None), (torch.bfloat16, torch.float32)],
    ids=["f32", "bf16-reduced-in-f32"],
)
def test_no_sync_on_the_emulated_device_accumulates_in_the_full_gradients(dtype, reduce_dtype):
    """As on CUDA: no_sync micro-batches keep their gradients (in the reduction dtype) out of
    the library, the synchronized one hands the sum over; one reduction per step."""
    spec = {
        "model": "mlp",
        "steps": 3,
        "micro": 3,
        "bucket_mb": 0.0005,
        "backend": "emulated",
        "dtype": dtype,
        "reduce_dtype": reduce_dtype,
        "opt": "sgd",
    }
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2), dtype)
    for rank, r in enumerate(runs):
        counts = [s["reduce_scatters"] for s in r["stats"]]
        assert all(n > 0 for n in counts[2::3]), f"rank {rank}: a synchronized micro-batch reduced nothing: {counts}"
        assert all(n == 0 for i, n in enumerate(counts) if i % 3 != 2), f"rank {rank}: a no_sync one reduced: {counts}"


def test_bf16_parameters_reduced_in_f32():
    spec = {
        "model": "gpt",
        "steps": 3,
        "dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "opt": "sgd",
        "bucket_mb": 0.002,
    }
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2), torch.bfloat16)


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_bf16_parameters_with_no_sync_tell_an_f32_reduction_from_a_bf16_one(backend):
    """bf16 parameters, three micro-batches per step (two under no_sync), at 2 ranks: with
    ``reduce_dtype=torch.float32`` the micro-batches' gradients are accumulated and reduced in
    f32, with ``None`` in bf16 (each addition rounded). Plain PyTorch accumulating in each
    dtype gives two references that differ; each run is its own reference bit for bit, so a
    run that reduced in the other dtype fails (an f32 run is 1e-3 from the bf16 reference at
    most: a tolerance would hide it)."""
    base = {"model": "mlp", "steps": 3, "micro": 3, "bucket_mb": 0.0005, "dtype": torch.bfloat16, "opt": "sgd"}
    specs = {rd: {**base, "backend": backend, "reduce_dtype": rd} for rd in (torch.float32, None)}
    refs = {rd: models.reference(spec, 2) for rd, spec in specs.items()}
    differ = parity.differing_elements(refs[torch.float32], refs[None])
    assert differ > 0, "the f32 and bf16 references are equal: this test cannot tell the two reductions apart"
    for rd, spec in specs.items():
        runs = run(workers.train, 2, spec)
        parity.check(runs, refs[rd], torch.bfloat16)
        other = refs[None if rd is torch.float32 else torch.float32]
        for rank, r in enumerate(runs):
            assert parity.differing_elements(r, other) > 0, f"rank {rank}: reduce_dtype={rd} ran the other reduction"


@pytest.mark.parametrize("recompute", [None, ("wrapper", False)])
def test_autocast_bf16_forward_of_f32_parameters(recompute):
    """The forward under torch.autocast (bf16 on the CPU), with no_sync micro-batches, and with
    activation checkpointing: the same as plain PyTorch under the same autocast."""
    spec = {
        "model": "gpt",
        "steps": 3,
        "micro": 2,
        "autocast": torch.bfloat16,
        "bucket_mb": 0.002,
        "recompute": recompute,
    }
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))


@pytest.mark.parametrize(("name", "reduce"), [("gpt", None), ("mlp", torch.bfloat16)])
def test_mixed_precision_gathers_in_param_dtype_and_steps_f32_masters(name, reduce):
    """MixedPrecisionPolicy(param_dtype=bf16): the plan gathers bf16, the optimizer steps f32
    shards, gradients are reduced in reduce_dtype (else f32) and land in f32; losses and the
    f32 parameters (the masters, gathered) as plain PyTorch computing on a bf16 copy of an f32
    model, with no_sync micro-batches."""
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": reduce}
    spec = {"model": name, "steps": 3, "micro": 2, "bucket_mb": 0.002, "opt": "sgd", "mp": mp}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2), torch.float32)
    # Without the policy the run is another: the check above can tell.
    plain = models.reference({**spec, "mp": None}, 2)
    assert parity.differing_elements(runs[0], plain) > 0
    for r in runs:
        plan = r["plan"]
        assert {(b["kind"], b["dtype"]) for b in plan["buckets"]} == {("gather", "bf16"), ("grad", "bf16")}, plan
        # The synchronized micro-batch reduces every gradient bucket (its every rank's shard)
        # once, in reduce_dtype.
        grads = sum(b["shard_numel"] * plan["world"] for b in plan["buckets"] if b["kind"] == "grad")
        width = 2 if reduce == torch.bfloat16 else 4
        assert [st["reduced_bytes"] for st in r["stats"][1::2]] == [grads * width] * 3, r["stats"]


def test_mixed_precision_checkpoint_keeps_the_f32_masters(tmp_path):
    """Saved at 2 ranks under the policy, loaded at 3 (flat): the run goes on from the f32
    masters, not from their bf16 casts."""
    path = str(tmp_path / "ckpt")
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    save = {"model": "gpt", "steps": 4, "split": 2, "save_world": 2, "bucket_mb": 0.002, "opt": "sgd", "mp": mp}
    first = run(workers.checkpointed, 2, save, path, "save")
    later = run(workers.checkpointed, 3, {**save, "strategy": "flat"}, path, "load")
    ref = models.reference({**save, "worlds": [2, 2, 3, 3], "strategies": ["even", "even", "flat", "flat"]}, 3)
    parity.check(first, {"params": ref["params"][:2], "losses": ref["losses"][:2]})
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]})


@pytest.mark.parametrize(
    "keep, forward, backend, recompute",
    [
        ("last", None, "shm", None),
        ("never", None, "shm", None),
        ("last", False, "shm", None),
        ("never", False, "emulated", None),
        ("last", None, "shm", ("wrapper", False)),
    ],
)
def test_reshard_after_backward_false_keeps_units_between_micro_batches(keep, forward, backend, recompute):
    """FSDP2's ``set_reshard_after_backward(False)`` with no_sync micro-batches: a unit stays
    gathered from a backward that does not synchronize into the next forward, which gathers
    nothing for it (nor its backward, with ``reshard_after_forward=False``); after the
    synchronized backward everything is released (``never``: the flag stays False, and the
    next step still gathers the optimizer's new values). An evaluation pass between
    micro-batches reads the held values; activation checkpointing recomputes on them. Against
    plain PyTorch, exactly."""
    spec = {
        "model": "gpt",
        "steps": 3,
        "micro": 3,
        "bucket_mb": 0.002,
        "opt": "adamw",
        "reshard_after_backward": keep,
        "reshard_after_forward": forward,
        "eval_between": True,
        "backend": backend,
        "recompute": recompute,
    }
    runs = run(workers.train, 2, spec)
    ref = models.reference(spec, 2)
    parity.check(runs, ref)
    for rank, r in enumerate(runs):
        assert len(r["evals"]) == len(ref["evals"][rank]) == 2 * 3, r["evals"]
        torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"][rank]), rtol=1e-6, atol=1e-7)
        gather = [b for b in r["plan"]["buckets"] if b["kind"] == "gather"]
        g = len(gather)
        assert g > 2, r["plan"]
        counts = [s["all_gathers"] for s in r["stats"]]
        assert len(counts) == len(r["held"]) == 9, (rank, counts, r["held"])
        # The first micro-batch of a step gathers in its forward and again in its backward
        # (once, kept into the backward, with reshard_after_forward=False, and the root by
        # default, as FSDP2 keeps it); the next ones find the units held.
        root = len(root_buckets(r["plan"]))
        first = g if forward is False else 2 * g - root
        later = 0 if forward is False else g - root
        assert counts == [first, later, later] * 3, f"rank {rank}: all-gathers per micro-batch {counts}, {g} buckets"
        for i, b in enumerate(r["held"]):
            synced = i % 3 == 2
            assert (b == 0) if synced else b > 0, f"rank {rank} micro-batch {i}: {b} bytes held: {r['held']}"
        assert r["held"][0] == r["held"][1], r["held"]
