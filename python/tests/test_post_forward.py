"""FSDP2's ``reshard_after_forward`` as an int below the shard group's size, at 4 ranks resharding
to 2: after its forward each block keeps half of its parameters on each rank (its pair of ranks
covering each parameter once), its backward gathers them within the pair and nothing across the
world, and training is plain PyTorch's, with no_sync micro-batches, activation checkpointing
(whose reentrant form captures nothing and gathers as usual), mixed precision, the emulated
device path, a flat plan, settings changed between steps and a backward that raises."""

from __future__ import annotations

import importlib

import post_forward_workers as pw
import pytest
import torch
from test_surface import buckets, unit_of

import collsched

import models
import parity
import workers
from ranks import run

WORLD = 4


def gathers(plan: dict) -> tuple[int, int]:
    """The plan's gather buckets: all, and the root's (unit 0's)."""
    gather = buckets(plan, "gather")
    root = [b for b in gather if {unit_of(n) for n in b["params"]} == {0}]
    assert 0 < len(root) < len(gather), plan
    return len(gather), len(root)


@pytest.mark.parametrize(
    "extra",
    [
        {"micro": 2, "eval_between": True},
        {"recompute": ("call", False)},
        {"recompute": ("call", True)},
        {"recompute": ("wrapper", True)},
        {"mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, "opt": "sgd"},
        {"backend": "emulated"},
        {"strategy": "flat"},
        {"prefetch": "explicit"},
        {"tied": True},
        {"offload": True, "mp": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}, "opt": "sgd"},
        {"world": 8, "strategy": "hybrid:4"},
    ],
    ids=[
        "no_sync",
        "recompute",
        "reentrant",
        "wrapper",
        "mixed",
        "emulated",
        "flat",
        "explicit",
        "tied",
        "offload",
        "hybrid-4-of-8",
    ],
)
def test_units_resharded_to_some_ranks_train_as_plain_pytorch(extra):
    """``reshard_after_forward=2`` on every unit at 4 ranks: the losses and parameters of plain
    PyTorch; every step gathers each bucket once across the world (the forward) and, in the
    backward, the post-forward layout's buckets within pairs (under explicit prefetch rules
    too: nothing prefetched across the world for them); a forward under ``no_grad`` (a
    reentrant checkpoint around a block's call) keeps nothing, and that block's backward
    gathers across the world as usual, as do blocks that share a parameter (tied). At 8 ranks
    under ``hybrid:4`` (the pairs are consecutive ranks, so within each group of 4)."""
    extra = dict(extra)  # the parameter's dict is shared by reruns
    world = extra.pop("world", WORLD)
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "adamw", "reshard_after_forward": 2, **extra}
    runs = run(workers.train, world, spec)
    ref = models.reference(spec, world)
    parity.check(runs, ref, torch.float32)
    for rank, r in enumerate(runs):
        g, root = gathers(r["plan"])
        assert len(r["stats"]) == 3 * spec.get("micro", 1), r["stats"]
        for i, st in enumerate(r["stats"]):
            where = f"rank {rank} backward {i}: {st}"
            assert set(st["post_forward"]) == {2}, where
            post = st["post_forward"][2]["all_gathers"]
            main = st["all_gathers"] - post
            if extra.get("recompute") == ("call", True):
                # The blocks' forwards ran under no_grad: nothing kept, their backward gathered
                # across the world again; the root's from its pairs.
                assert main == 2 * g - root and post > 0, where
            elif extra.get("tied"):
                # The blocks share a parameter: likewise, but for its bucket, which the second
                # block to use it in a pass gathers again where the first released it already
                # (up to twice a step, as the prefetch finds it).
                assert 2 * g - root <= main <= 2 * g - root + 2 and post > 0, where
            else:
                # Every unit resharded to pairs (the root too): the backward's gathers are all
                # the post-forward layout's, at least one per unit.
                assert main == g and post >= 3, where
            # Reduced over the world in the synchronized backward (accumulated before it).
            synced = (i + 1) % spec.get("micro", 1) == 0
            assert (st["reduce_scatters"] > 0) == synced, where
        assert r["live"] == 0, f"rank {rank}: {r['live']} bytes left gathered"
    if "eval_between" in extra:
        for rank, r in enumerate(runs):
            assert len(r["evals"]) == len(ref["evals"][rank]) == 3, r["evals"]
            torch.testing.assert_close(torch.tensor(r["evals"]), torch.tensor(ref["evals"][rank]), rtol=1e-6, atol=1e-7)


def test_set_reshard_after_forward_int_between_steps():
    """The blocks' setting changed between steps (2, 2, True, False, 2): each step's gathers are
    those of its setting (the post-forward layout made anew when it changes), the layout holds
    half of each block parameter per rank, each pair covering it once, and none of the root's;
    sizes that are not factors of the world are refused by name."""
    flags = [2, 2, True, False, 2]
    spec = {"model": "gpt", "steps": len(flags), "bucket_mb": 0.002, "flags": flags}
    runs = run(pw.toggled, WORLD, spec)
    parity.check(runs, models.reference(spec, WORLD))
    names = [n for n in runs[0]["params"][0] if unit_of(n) > 0]
    numel = {n: len(v) for n, v in runs[0]["params"][0].items()}
    assert names, runs[0]["params"][0].keys()
    for step, flag in enumerate(flags):
        layouts = [r["layout"][step] for r in runs]
        if isinstance(flag, bool):
            assert all(not lay for lay in layouts), (step, layouts)
            continue
        for lay in layouts:
            assert sorted(lay) == [2] and sorted(lay[2]) == sorted(names), (step, lay)
        for pair in ((0, 1), (2, 3)):
            for n in names:
                held = [layouts[r][2][n] for r in pair]
                assert sum(held) == numel[n], f"step {step} ranks {pair} {n}: {held} of {numel[n]}"
                assert max(held) <= (numel[n] + 1) // 2 + 64, f"step {step} {n}: {held} of {numel[n]}: not halves"
        for plan in (r["plans"][step][2] for r in runs):
            assert plan["world"] == WORLD, plan
    for rank, r in enumerate(runs):
        g, root = gathers(r["plan"])
        for step, (flag, st) in enumerate(zip(flags, r["stats"])):
            where = f"rank {rank} step {step} ({flag}): {st}"
            post = st.get("post_forward", {}).get(2, {}).get("all_gathers")
            if flag is True:
                assert post is None and st["all_gathers"] == 2 * g, where
            elif flag is False:
                assert post is None and st["all_gathers"] == g + root, where
            else:
                assert post >= 2 and st["all_gathers"] == g + root + post, where
            # Nothing gathered held between the forward and its backward while the order is
            # recorded (the first step of a setting), but the kept blocks under False.
            recording = step == 0 or flags[step - 1] != flag
            if recording and flag is not False:
                assert r["between"][step] == 0, where
        assert r["units"][1:] == [(True, 2)] * (len(r["units"]) - 1) and r["units"][0] == (True, 0), r["units"]
        for key in ("not_factor", "ctor_not_factor"):
            assert "reshard_after_forward=3: the parameters are sharded over 4 ranks" in r[key], r[key]
            assert "a factor of 4" in r[key] and "[1, 2, 4]" in r[key], r[key]
        assert r["live_after"] == 0, r["live_after"]


def test_a_raising_backward_in_a_resharded_unit_leaves_the_next_steps_plain():
    """A backward raising inside a block fetched from its post-forward layout: the error is the
    caller's, and the steps after it train as plain PyTorch from the same start."""
    spec = {"model": "gpt", "steps": 2, "bucket_mb": 0.002, "opt": "adamw", "reshard_after_forward": 2}
    runs = run(pw.raising, WORLD, spec)
    parity.check(runs, models.reference(spec, WORLD))
    for r in runs:
        assert r["raised"] == "builtins.ValueError: boom", r["raised"]
        # The steps after it gathered their backward within the pairs again.
        assert len(r["post"]) == 2 and min(r["post"]) >= 3, r["post"]


def test_fsdp2_resharding_to_pairs_gives_the_same_training():
    """torch's FSDP2 with ``reshard_after_forward=2`` at 4 ranks (on the ``"collsched"`` process
    group: its subgroups for the pairs) trains as plain PyTorch and as collsched.torch with the
    same setting. (On gloo its sums over ranks run in another order, and AdamW turns those ulps
    into steps of the learning rate's size where a gradient is near 0: no tight comparison.)"""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "adamw", "reshard_after_forward": 2, "reshard": 2}
    theirs = run(pw.fsdp2, WORLD, spec, init="collsched")
    ours = run(workers.train, WORLD, spec)
    ref = models.reference(spec, WORLD)
    for r in theirs:
        assert r["post_group"] == 2, r["post_group"]
    parity.check(theirs, ref)
    # FSDP2's run as the reference of collsched.torch's: every rank's losses, rank 0's parameters.
    fsdp2_ref = {
        "losses": [[[r["losses"][step][0] for r in theirs]] for step in range(spec["steps"])],
        "params": [{n: torch.tensor(v) for n, v in ps.items()} for ps in theirs[0]["params"]],
    }
    parity.check(ours, fsdp2_ref)


def test_a_cuda_world_without_the_groups_is_refused_by_name(monkeypatch):
    """On the cuda backend the groups' communicators are made at init: a size the world was not
    made with is refused where the setting is taken, naming the init call that would do."""
    from types import SimpleNamespace

    build = importlib.import_module("collsched.torch.build")
    world = importlib.import_module("collsched.torch.world")

    st = SimpleNamespace(shard_group=8, world=SimpleNamespace(kind="cuda", world=8))
    for declared in (None, 4):
        monkeypatch.setattr(world, "CUDA_GROUP_SIZE", declared)
        with pytest.raises(collsched.CollschedError) as e:
            build.after_forward(2, st, "fully_shard")
        assert f"this world was made with hybrid_group_size={declared}" in str(e.value), e.value
        assert "collsched.torch.init('cuda', hybrid_group_size=2)" in str(e.value), e.value
    monkeypatch.setattr(world, "CUDA_GROUP_SIZE", 2)
    assert build.after_forward(2, st, "fully_shard") == 2
    assert build.after_forward(8, st, "fully_shard") is True and build.after_forward(1, st, "fully_shard") is False


def test_a_parameter_tied_before_its_units_are_sharded_is_refused_by_name():
    """Tied across two blocks, then each block sharded alone: the second would shard its own copy
    (two parameters where the model has one): refused, naming both and what to do."""
    for text in run(pw.tied_before, 2):
        assert "parameter fc.weight of Block is fc.weight of Block, which an earlier fully_shard sharded" in text, text
        assert "tie it again after sharding" in text, text
