"""A sharded model's ``state_dict()`` and ``load_state_dict()`` as FSDP2 gives them: DTensors
(``Shard(0)``, the global shape, the rows ``torch.chunk`` gives each rank) whose full values are
the unsharded model's bit for bit, whatever the strategy; loads of full values and of DTensors;
torch.distributed.checkpoint's ``dcp.save``/``dcp.load`` into another world size and strategy,
``get_model_state_dict(full_state_dict)`` and ``set_model_state_dict(broadcast_from_rank0)``;
and what it refuses."""

from __future__ import annotations

import pytest
import sd_workers as w
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


@pytest.mark.parametrize(("strategy", "world"), [("even", 2), ("flat", 3), ("greedy", 3), ("hybrid:2", 2)])
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
