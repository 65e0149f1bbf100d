"""FSDP2's API beyond the training loop, each point against plain unsharded PyTorch: a sharded
model's ``state_dict()`` and ``load_state_dict()`` as FSDP2 gives them (DTensors: ``Shard(0)``,
the global shape, the rows ``torch.chunk`` gives each rank, the unsharded values bit for bit,
whatever the strategy; loads of full values and of DTensors), an optimizer's state dict
likewise, torch.distributed.checkpoint (``dcp.save``/``dcp.load`` into another world size and
strategy, ``get/set_model_state_dict``, ``get/set_optimizer_state_dict``), meta-device init,
``mesh=``, ``ignored_params``, ``unshard``/``reshard``, ``CPUOffloadPolicy``, a torchtitan-style
run, ``memory_stats``/``empty_cache``; and what each refuses."""

from __future__ import annotations

import math

import fsdp2_workers as w
import pytest
import torch

import models
import parity
import workers
from ranks import run


def rows(shape: list[int], world: int, rank: int) -> list[int]:
    """The local shape of ``Shard(0)`` on ``rank`` of ``world`` (torch.chunk's cut)."""
    n = -(-shape[0] // world)
    lo, hi = min(shape[0], rank * n), min(shape[0], (rank + 1) * n)
    return [hi - lo, *shape[1:]]


def check_dtensors(rows_by_key: dict, keys: list[str], world: int, rank: int, what: str) -> None:
    assert sorted(rows_by_key) == sorted(keys), f"{what}: keys {sorted(rows_by_key)} != {sorted(keys)}"
    for k, r in rows_by_key.items():
        assert r["type"] == "DTensor", f"{what}: {k} is a {r['type']}"
        assert r["placements"] == ["S(0)"], f"{what}: {k} placed {r['placements']}"
        assert r["local"] == rows(r["shape"], world, rank), f"{what}: {k} local {r['local']} of {r['shape']}"
        assert r["equal"] is True, f"{what}: {k}'s full value differs from the unsharded model's"


@pytest.mark.parametrize(("strategy", "world"), [("even", 2), ("flat", 3), ("greedy", 3), ("hybrid:2", 4)])
def test_state_dict_is_dtensors_of_the_unsharded_values(strategy, world):
    """Before and after a step, of the root and of one block alone; then loads of another
    model's full values and of DTensors of a model sharded otherwise, bit for bit."""
    for rank, r in enumerate(run(w.dtensors, world, strategy, init="collsched")):
        keys = r["ref_keys"]
        check_dtensors(r["before"], keys, world, rank, "before")
        check_dtensors(r["after"], keys, world, rank, "after a step")
        check_dtensors(r["block"], [k for k in keys if k.startswith("blocks.1.")], world, rank, "one block")
        assert r["loaded_full"] == [], f"rank {rank}: full values not loaded: {r['loaded_full']}"
        assert r["loaded_dtensor"] == [], f"rank {rank}: DTensors not loaded: {r['loaded_dtensor']}"
        assert r["still_trains"] is True
        assert r["optim_states"] > 0, "AdamW kept no state"
        assert r["optim_back"] == [], f"rank {rank}: optimizer states not loaded back: {r['optim_back']}"


def test_mixed_precision_state_dict_is_the_f32_masters():
    for rank, r in enumerate(run(w.mixed, 2, init="collsched")):
        assert r["sd"], "empty state dict"
        for k, row in r["sd"].items():
            assert row["dtype"] == "torch.float32", f"rank {rank}: {k} is {row['dtype']}"
            assert row["equal"] is True, f"rank {rank}: {k} is not the f32 value"
        assert r["loaded"] == [], r["loaded"]


def test_state_dict_refusals_name_what_to_do():
    for r in run(w.refusals, 2, init="collsched"):
        assert "blocks.0.weight is (1, 7)" in r["shape"] and "full value (shape (13, 7))" in r["shape"], r["shape"]
        assert "head.weight" in r["local"] and "load_checkpoint" in r["local"], r["local"]
        assert "assign=True" in r["assign"] and "load without assign" in r["assign"], r["assign"]
        assert r["unchanged"] is True, "a refused load changed the parameters"
        assert "between synchronized steps" in r["in_pass"] and "inside a pass" in r["in_pass"], r["in_pass"]
        assert "init_process_group" in r["no_group"] and "full_state_dict" in r["no_group"], r["no_group"]


def test_dcp_save_and_load_into_another_world_and_strategy(tmp_path):
    """``dcp.save`` at 3 ranks (even), ``dcp.load`` at 2 (flat) into a model of other values:
    every parameter back bit for bit; the full state dict and a broadcast from rank 0 too."""
    path = str(tmp_path / "dcp")
    saved = run(w.dcp_round, 3, path, "save", "even", init="collsched")
    loaded = run(w.dcp_round, 2, path, "load", "flat", init="collsched")
    want = saved[0]["params"]
    assert all(s["params"] == want for s in saved), "the saving ranks' parameters differ"
    for rank, r in enumerate(saved + loaded):
        assert r["get_full"] is True, f"{rank}: get_model_state_dict(full_state_dict) is not the parameters"
        assert r["broadcast"] == [], f"{rank}: set_model_state_dict(broadcast_from_rank0) missed {r['broadcast']}"
    for rank, r in enumerate(loaded):
        assert r["before"] != want, "the model loaded into already had the saved values"
        assert sorted(r["params"]) == sorted(want)
        for k, v in want.items():
            assert r["params"][k] == v, f"rank {rank}: {k} differs from the saved values"


@pytest.mark.parametrize("mp", [False, True], ids=["f32", "bf16-params"])
def test_dcp_of_model_and_optimizer_resumes_as_plain_pytorch(tmp_path, mp):
    """torchtitan's checkpoint: ``get_model_state_dict`` and ``get_optimizer_state_dict`` saved
    with ``dcp.save`` after two steps at 3 ranks (even), loaded with ``dcp.load`` and the
    ``set_*`` functions at 2 (flat) into a model and optimizer of other values; the run goes on
    as plain PyTorch's across the change (AdamW's moments and step resumed: a lost moment
    changes the next updates). Under a bf16 MixedPrecisionPolicy the f32 masters go on."""
    path = str(tmp_path / "dcp")
    save = {"model": "gpt", "steps": 4, "split": 2, "bucket_mb": 0.002, "opt": "adamw", "via": "dcp"}
    if mp:
        save["mp"] = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    first = run(workers.checkpointed, 3, save, path, "save", init="collsched")
    later = run(workers.checkpointed, 2, {**save, "strategy": "flat"}, path, "load", init="collsched")
    ref = models.reference({**save, "worlds": [3, 3, 2, 2], "strategies": ["even", "even", "flat", "flat"]}, 3)
    parity.check(first, {"params": ref["params"][:2], "losses": ref["losses"][:2]})
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]})


@pytest.mark.parametrize(
    ("world", "spec"),
    [
        (2, {"strategy": "even"}),
        (3, {"strategy": "flat", "mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}}),
        (4, {"strategy": "even", "reshard_after_forward": 2}),
    ],
    ids=["even-2", "flat-3-bf16", "even-4-reshard-2"],
)
def test_meta_device_init_then_broadcast_from_rank0_trains_as_plain_pytorch(world, spec):
    """A model built on the meta device is sharded without any rank making its full values
    (shards of zeros), ``to_empty`` keeps the shards, ``set_model_state_dict`` broadcasts rank
    0's values; the run is plain PyTorch's from those values (with ``reshard_after_forward=2``
    too: the post-forward layout made empty with the shards). A half-meta model and
    ``sync_module_states`` on a meta model are refused by name."""
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "opt": "adamw", **spec}
    runs = run(w.meta_init, world, spec, init="collsched")
    ref = models.reference(spec, world)
    parity.check(runs, ref)
    for r in runs:
        assert r["zeros"] is True, "a meta model's shards are not zeros before the load"
        # Under an int, the last backward gathered from the post-forward layout (a pair's).
        want = {2} if spec.get("reshard_after_forward") == 2 else set()
        assert set(r["post"]) == want and all(n >= 3 for n in r["post"].values()), r["post"]
        assert "blocks.0.weight is on the meta device and head.weight is not" in r["mixed"], r["mixed"]
        assert "sync_module_states=True on a model built on the meta device" in r["synced"], r["synced"]


def test_ignored_params_and_integer_parameters_stay_as_they_were():
    for rank, r in enumerate(run(w.ignoring, 3)):
        assert r["kept"] is True and r["q"] is True, r
        assert "blocks.1.weight" not in r["sharded"] and "blocks.0.q" not in r["sharded"], r["sharded"]
        assert sorted(r["params"]) == sorted(r["sharded"]) and len(r["sharded"]) == 7, r["sharded"]
        assert r["kept_grad"] is True, f"rank {rank}: the ignored weight's gradient is not this rank's own"
        assert r["kept_after"] is True, f"rank {rank}: the ignored weight did not step on its own gradient"
        for n, diff in r["params"].items():
            assert diff <= 2e-7, f"rank {rank}: {n} differs from the reference by {diff}"
        assert "not a parameter of Mlp" in r["not_param"], r["not_param"]
        assert "not a parameter of Mlp" in r["foreign"], r["foreign"]


def test_unshard_and_reshard_between_steps():
    for rank, r in enumerate(run(w.unsharding, 2)):
        assert r["handle"] == "UnshardHandle", r["handle"]
        assert r["full"] is True, f"rank {rank}: unshard() did not put the full values in the block"
        assert r["live_unsharded"] > 0, r["live_unsharded"]
        assert r["after_reshard"][1] == 0 and len(r["after_reshard"][0]) == 1, r["after_reshard"]
        assert sorted(r["params"]) == [
            "blocks.0.bias",
            "blocks.0.weight",
            "blocks.1.bias",
            "blocks.1.weight",
            "blocks.2.bias",
            "blocks.2.weight",
            "head.bias",
            "head.weight",
        ]
        for n, diff in r["params"].items():
            assert diff <= 2e-7, f"rank {rank}: {n} differs from the reference by {diff}"
        assert r["live_end"] == 0, r["live_end"]
        assert "reshard_after_backward: 0; expected True" in r["not_bool"], r["not_bool"]
        assert r["held"][0] > 0 and len(r["held"][1]) == 2, r["held"]
        assert "set_reshard_after_backward(False) holds it" in r["held_state_dict"], r["held_state_dict"]
        assert r["released"][0] == 0 and len(r["released"][1]) == 1, r["released"]
        assert r["after_hold"] <= 1e-6, r["after_hold"]


def test_a_torchtitan_style_run_resumes_into_another_world_as_plain_pytorch(tmp_path):
    """torchtitan's recipe with collsched.torch for FSDP2: at 4 ranks on a 2x2 (replicate,
    shard) mesh (HSDP), a meta-device model, bf16 parameters with f32 reduction, rank 0's
    values broadcast, two steps, DCP save; at 2 ranks on a 1-D mesh, DCP load, two more steps:
    losses and parameters as plain PyTorch's across the change."""
    path = str(tmp_path / "dcp")
    mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    spec = {"model": "gpt", "steps": 4, "split": 2, "bucket_mb": 0.002, "opt": "adamw", "mp": mp}
    spec["mesh"] = {"save": [2, 2], "load": [2]}
    first = run(w.titan, 4, spec, path, "save", init="collsched")
    later = run(w.titan, 2, spec, path, "load", init="collsched")
    ref = models.reference({**spec, "worlds": [4, 4, 2, 2], "strategies": ["hybrid:2"] * 2 + ["even"] * 2}, 4)
    parity.check(first, {"params": ref["params"][:2], "losses": ref["losses"][:2]})
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]})
    for r in first:
        assert r["strategy"] == "hybrid:2", r["strategy"]
        assert r["part_world"] == 2, r["part_world"]
    assert all(r["strategy"] == "even" for r in later)


@pytest.mark.parametrize(
    "spec",
    [
        {"strategy": "even", "micro": 2},
        {"strategy": "flat", "mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}},
        {"strategy": "even", "backend": "emulated", "micro": 2},
    ],
    ids=["even-no_sync", "flat-bf16", "emulated-no_sync"],
)
def test_cpu_offload_trains_as_plain_pytorch(spec):
    """``CPUOffloadPolicy``: the module's shards are tensors of their own (host memory), copied
    into the library's at each pass, gradients delivered to them; the run is plain PyTorch's."""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "adamw", "offload": True, **spec}
    runs = run(w.offloaded, 2, spec)
    parity.check(runs, models.reference(spec, 2))
    for r in runs:
        assert r["apart"] is True, "an offloaded shard is the library's memory"
        # Every shard (one dtype: the f32 masters) a view of one host tensor: one copy a pass.
        assert {dev for dev, _pin, _at in r["places"]} == {"cpu"}, r["places"]
        assert len({at for _dev, _pin, at in r["places"]}) == 1, r["places"]
        assert r["policy"] == "no error", r["policy"]
        assert "expected a CPUOffloadPolicy" in r["bad"], r["bad"]


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_memory_stats_and_empty_cache_on_host_memory_are_empty_and_change_nothing(backend):
    """``cst.memory_stats()`` / ``cst.empty_cache()`` (``torch.cuda.memory_stats`` /
    ``empty_cache`` for collsched's device pool): on host memory there is no pool: ``{}`` and
    0 bytes, and training between the calls is plain PyTorch's. (On a GPU: ``test_cuda.py``.)"""
    spec = {"model": "mlp", "steps": 2, "bucket_mb": 0.002, "backend": backend, "empty_cache": True}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))
    for r in runs:
        assert r["memory"] == [({}, 0, {}), ({}, 0, {})], r["memory"]


@pytest.mark.parametrize("divide", [1.0, 3.0], ids=["sum", "by-3"])
def test_gradient_divide_factor_on_the_blocks_trains_as_plain_pytorch_and_as_fsdp2(divide):
    """``set_gradient_divide_factor`` (with ``set_force_sum_reduction_for_comms`` and
    ``set_requires_all_reduce``) on each block, not the root: the blocks' gradients are the sum
    over the ranks divided by the factor, the root's the mean; as plain PyTorch computes it,
    and as torch's FSDP2 with the same calls (on the ``"collsched"`` process group)."""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "sgd", "divide": divide}
    ref = models.reference(spec, 2)
    ours = run(workers.train, 2, spec)
    parity.check(ours, ref)
    theirs = run(w.divided, 2, spec, init="collsched")
    parity.check(theirs, ref)
    # The factor changed the blocks' first update alone: the root's own gradients kept the mean.
    mean = models.reference({k: v for k, v in spec.items() if k != "divide"}, 2)
    differ = {n for n, v in mean["params"][0].items() if not torch.equal(v, ref["params"][0][n])}
    assert differ == {n for n in differ if n.startswith("blocks.")} and len(differ) > 2, differ


@pytest.mark.parametrize(
    "extra",
    [{"divide_on": "root"}, {"divide_early": True}, {"strategy": "hybrid:2", "divide_early": True}],
    ids=["root-alone", "blocks-before-the-root", "hybrid-blocks"],
)
def test_gradient_divide_factor_per_unit_and_set_before_the_root_trains_as_plain_pytorch(extra):
    """The factor on the root alone leaves the blocks' mean (it is not recursive); set on the
    blocks before the root's ``fully_shard``, the root's plan keeps it; under ``hybrid:2`` at 4
    ranks it divides the two stages' sum once."""
    world = 4 if "strategy" in extra else 2
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "opt": "sgd", "divide": 1.5, **extra}
    parity.check(run(workers.train, world, spec), models.reference(spec, world))


def test_gradient_divide_factor_refusals_name_the_value_and_the_strategy():
    out = run(w.divide_refusals, 2)[0]
    assert "finite factor > 0" in out["zero"], out
    assert "finite factor > 0" in out["nan"], out
    assert out["hybrid"] == "no error", out
    assert out["deferred"] == 0 and out["reduced"] > 0, out


@pytest.mark.parametrize(
    ("strategy", "world", "how"),
    [
        ("hybrid:2", 4, "all_reduce"),
        ("hybrid:1", 2, "all_reduce"),
        ("hybrid:2", 4, "sync"),
        ("hybrid:2", 4, "inside_no_sync"),
    ],
    ids=["hsdp", "ddp", "hsdp-gradient-sync-ends-it", "hsdp-set-inside-no-sync"],
)
def test_set_requires_all_reduce_false_defers_the_reduction_and_trains_as_plain_pytorch(strategy, world, how):
    """FSDP2's HSDP gradient accumulation: ``set_requires_all_reduce(False)`` on every
    micro-batch but the last of three (``workers.train``'s ``defer_all_reduce``: ended by
    ``set_requires_all_reduce(True)`` or, as FSDP2's sets both, ``set_requires_gradient_sync(True)``;
    or set inside a ``no_sync()`` around the first, which must not end it). The deferred ones
    reduce nothing (their library steps count no reduce-scatter), the last reduces the sum; the
    model trains as plain PyTorch on the three micro-batches."""
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "opt": "sgd", "strategy": strategy, "micro": 3}
    ours = run(workers.train, world, {**spec, "defer_all_reduce": how})
    parity.check(ours, models.reference(spec, world))
    for r in ours:
        counts = [s["reduce_scatters"] for s in r["stats"]]
        assert len(counts) == 2 * 3, counts
        for step in range(2):
            assert counts[3 * step : 3 * step + 2] == [0, 0] and counts[3 * step + 2] > 0, counts


def test_fsdp2_s_other_methods_are_taken_or_refused_by_name():
    """The module methods FSDP2 has for its own process-group calls: those whose effect
    collsched has already (a post-optimizer event, no unsharding in backward, allocation
    hints) are taken and change nothing; hooks into FSDP2's collectives are refused, saying
    why; ``shard_placement_fn`` takes ``Shard(0)`` and ``None`` and refuses another
    placement, naming the parameter."""
    for r in run(w.fsdp2_methods, 2):
        assert "shard_placement_fn gives weight the placement Shard(dim=1)" in r["placement"], r["placement"]
        assert r["accepted"] == ["no error"] * 8, r["accepted"]
        for text, name in zip(
            r["refused"], ["set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook"]
        ):
            assert f"CollschedError: {name}: collsched.torch runs its own collectives" in text, text
        o = r["other"]
        assert "set_keep_unsharded_storage(True)" in o["keep"] and "leave it False" in o["keep"], o
        assert "set_reduce_scatter_max_input_buffers: 0; give an int >= 1" in o["buffers_0"], o
        assert "set_reduce_scatter_max_input_buffers: True; give an int >= 1" in o["buffers_bool"], o
        assert "dp_mesh_dims=('dp',) needs mesh= the whole SPMD DeviceMesh" in o["dp_mesh_dims"], o
        assert "requires manual backward finalization" in o["not_manual"], o
        assert o["fsdp_module"] == [True, True], o
        assert "sharded by collsched.torch, which keeps no FSDP2 state" in o["fsdp_state"], o
        assert "its communication context (_comm_ctx) alone, not _fsdp_param_group" in o["fsdp_state"], o
        assert o["share_comm_ctx"] == "no error" and o["shared"] is True, o
        assert "must be called on the root module" in o["manual_on_block"], o
        assert o["init_again"] == ["no error"] * 2, o
        assert "init(backend='emulated'): this process joined its job on 'shm' already" in o["init_other"], o
        assert "must be called on the root module" in o["finalize_on_block"], o
        assert o["before_forward"] == "no error" and o["after_backward"] == "no error", o
        assert "between a forward and its backward" in o["before_backward"], o
        assert r["grads"] is True, "the backward after a refused finalization delivered no gradients"


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"last_synced": True},
        {"strategy": "flat", "opt": "sgd"},
        {"backend": "emulated"},
        {"backend": "emulated", "opt": "sgd", "mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}},
        {"backend": "emulated", "last_synced": True},
    ],
    ids=["all-unsynced", "last-synced", "flat-sgd", "device", "device-bf16-f32", "device-last-synced"],
)
def test_manual_finalization_as_pipelining_drives_it_trains_as_plain_pytorch_and_as_fsdp2(extra):
    """``set_manual_backward_finalization(True)``, micro-batches under
    ``set_requires_gradient_sync(False)``, then ``finalize_backward(async_op=True).wait()`` with
    synchronization on (torch.distributed.pipelining's calls on an FSDP2 stage): the
    accumulated gradients reduced once, the same steps as plain PyTorch and as torch's FSDP2
    making the same calls. On a device backend the gradients accumulate outside the library
    (in ``.grad``, or in ``reduce_dtype`` under mixed precision) until the finalization."""
    spec = {"model": "gpt", "steps": 2, "micro": 3, "bucket_mb": 0.002, **extra}
    ref = models.reference(spec, 2)
    parity.check(run(w.finalized, 2, spec), ref)
    if not {"strategy", "backend"} & set(extra):
        parity.check(run(w.finalized, 2, {**spec, "fsdp2": True}, init="collsched"), ref)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception_drops_the_failed_pass_and_the_accumulation(where):
    """A ``no_sync`` micro-batch, then a pass that raises in a block's forward or midway
    through the backward, then ``reset_iter_state()``: the following steps are plain PyTorch's
    from the same start (nothing of the dropped micro-batch or the failed pass reaches them)."""
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "where": where}
    runs = run(w.reset_after, 2, spec, init="collsched")
    for r in runs:
        assert "RuntimeError: injected failure" in r["raised"], r["raised"]
        assert "reset_iter_state must be called on the root module" in r["on_block"], r["on_block"]
    parity.check(runs, models.reference({k: v for k, v in spec.items() if k != "where"}, 2))


# FSDP2's module methods collsched.torch does not provide (README.md's table says so, and why).
NOT_PROVIDED: set[str] = set()


def test_every_method_of_fsdp2_s_modules_is_provided_or_named_in_the_readme():
    """Each public method of this torch's ``FSDPModule`` is a method of collsched's modules,
    or one of ``NOT_PROVIDED``, each named in README.md's FSDP2 table."""
    import inspect
    import pathlib

    from torch.distributed.fsdp import FSDPModule

    from collsched.torch import CollschedModule

    theirs = {m for m in dir(FSDPModule) if not m.startswith("_")}
    ours = {m for m in dir(CollschedModule) if not m.startswith("_")}
    assert theirs - ours <= NOT_PROVIDED, sorted(theirs - ours - NOT_PROVIDED)
    assert NOT_PROVIDED <= theirs, sorted(NOT_PROVIDED - theirs)
    # A call written for FSDP2 binds to ours: every parameter of theirs is one of ours.
    for m in sorted(theirs & ours):
        want = [p for p in inspect.signature(getattr(FSDPModule, m)).parameters if p != "self"]
        got = inspect.signature(getattr(CollschedModule, m)).parameters
        assert all(p in got for p in want), f"{m}: FSDP2's parameters {want}, ours {list(got)}"
    # And fully_shard's: a keyword FSDP2 takes is one of ours (taken, or refused by name).
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    import collsched.torch as cst

    want = list(inspect.signature(fsdp2_fully_shard).parameters)
    got = inspect.signature(cst.fully_shard).parameters
    assert all(p in got for p in want), f"fully_shard: FSDP2's parameters {want}, ours {list(got)}"
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert all(f"`{m}`" in readme for m in NOT_PROVIDED), [m for m in NOT_PROVIDED if f"`{m}`" not in readme]


BF16_F32 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


@pytest.mark.parametrize(
    ("group", "extra"),
    [
        ("ends", {}),
        ("tied", {}),
        ("ends", {"backend": "emulated", "micro": 3}),
        ("ends", {"backend": "emulated", "micro": 3, "mp": BF16_F32, "opt": "sgd"}),
        ("tied", {"micro": 2}),
    ],
    ids=["ends", "tied", "ends-device-no-sync", "ends-device-no-sync-bf16-f32", "tied-no-sync"],
)
def test_a_list_of_modules_as_one_unit_trains_as_plain_pytorch_and_as_fsdp2(group, extra):
    """``fully_shard([model.ln, model.head], reshard_after_forward=False)`` (torchtitan's
    grouping of the last layers) or ``fully_shard([model.tok, model.head])`` (the embedding and
    the head sharing its weight, apart in the forward): one unit, the same steps as plain
    PyTorch and, for the second, as torch's FSDP2 grouping them alike (FSDP2 refuses the first:
    the head's weight is the root's embedding's, which collsched fetches in both units). With
    micro-batches accumulated under ``no_sync`` (on a device backend, where the gradients wait
    beside the library), the list's unit hands each gradient once all of this backward's are in."""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "group": group, **extra}
    ref = models.reference(spec, 2)
    ours = run(w.grouped, 2, spec)
    parity.check(ours, ref)
    if group == "tied":
        parity.check(run(w.grouped, 2, {**spec, "fsdp2": True}, init="collsched"), ref)
    for r in ours:
        assert r["returned"] == (["LayerNorm", "Linear"] if group == "ends" else ["Embedding", "Linear"]), r
        # The root, two blocks and the list: four units.
        assert r["units"] == 4, r["units"]


def test_a_list_of_modules_refusals_name_the_module():
    out = run(w.group_refusals, 1)[0]
    assert "Linear is twice in the list" in out["twice"], out
    assert "Linear is inside Block, both in one list" in out["nested"], out
    assert "reshard_after_forward=2 for a list of modules" in out["int"], out
    assert "not sharded yet: call fully_shard on the root module" in out["unplanned"], out
    assert "is in a group given to fully_shard([...]) already" in out["member_as_root"], out
    assert "was given to fully_shard already; a module is in one unit" in out["regrouped"], out
    assert out["again"] is True, out


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_an_f16_reduction_divides_before_and_after_the_sum_and_trains_as_plain_pytorch(backend):
    """``reduce_dtype=torch.float16``: the mean's factor split as FSDP2 splits it for f16 (at 2
    ranks all of it before the sum: NCCL sums f16 in f16, where large gradients overflow), the
    steps plain PyTorch's f16 mean (the same at 2 ranks: halving commutes with rounding, but
    for subnormals); a factor applied twice or not at all would double or halve them."""
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "opt": "sgd", "reduce_dtype": torch.float16}
    runs = run(workers.train, 2, {**spec, "backend": backend})
    parity.check(runs, models.reference(spec, 2))
    for r in runs:
        # Every step reduced every gradient bucket once, in f16 (2 bytes an element).
        plan = r["plan"]
        grads = sum(b["shard_numel"] * plan["world"] for b in plan["buckets"] if b["kind"] == "grad")
        assert [st["reduced_bytes"] for st in r["stats"]] == [grads * 2] * 2, r["stats"]


def reused_reference(steps: int, world: int) -> dict:
    """Plain PyTorch on one :class:`models.Reused`: each rank's step computed in turn, the
    gradients averaged over the ranks, SGD."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = models.Reused()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, params = [], []
    for step in range(steps):
        grads, row = [], []
        for rank in range(world):
            loss = models.reused_step(model, *models.reused_batch(step, rank))
            row.append(loss.item())
            grads.append(torch.autograd.grad(loss, list(model.parameters())))
        for p, *gs in zip(model.parameters(), *grads):
            total = gs[0].clone()
            for g in gs[1:]:
                total += g
            p.grad = total / world
        opt.step()
        opt.zero_grad()
        losses.append([row])
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "params": params}


@pytest.mark.parametrize("head_unit", [False, True])
def test_modules_run_twice_and_a_chunked_loss_after_the_forward_train_as_plain_pytorch(head_unit):
    """A unit called twice in one forward, and a head applied chunk by chunk to the root's
    output after the root's forward (a chunked loss): the head a module of the root's unit,
    which FSDP2's default keeps fetched from the root's forward into its backward (released,
    it would be 1-D shards there), or a unit of its own, fetched for each chunk. Each
    parameter's gradient is handed over once all its uses are in: the same steps as plain
    PyTorch, exactly, and as torch's FSDP2 on the same model."""
    spec = {"steps": 3, "head_unit": head_unit}
    ref = reused_reference(3, 2)
    parity.check(run(w.reused, 2, spec), ref)
    parity.check(run(w.reused, 2, {**spec, "fsdp2": True}, init="collsched"), ref)


def test_a_second_backward_through_a_head_run_after_the_forward_is_refused():
    """A chunked loss's chunks run backward one at a time (``retain_graph``): the first ends
    the step and releases the root's unit, which the head (a module of it run after the
    root's forward) saved its full weight from. The second backward raises autograd's
    in-place error instead of reading a released buffer (FSDP2 raises too: its storage is
    freed), and the next step runs, nothing left gathered after it."""
    for r in run(w.retained, 2):
        assert "modified by an inplace operation" in r["second"], r
        assert math.isfinite(r["after"]) and r["live"] == 0, r
