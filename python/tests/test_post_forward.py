"""FSDP2's ``reshard_after_forward`` as an int below the shard group's size, at 4 ranks resharding
to 2: after its forward each block keeps half of its parameters on each rank (its pair of ranks
covering each parameter once), its backward gathers them within the pair and nothing across the
world, and training is plain PyTorch's, with no_sync micro-batches, activation checkpointing
(whose reentrant form captures nothing and gathers as usual), mixed precision, the emulated
device path, a flat plan, settings changed between steps and a backward that raises."""

from __future__ import annotations

import post_forward_workers as pw
import pytest
import torch
from test_surface import buckets, unit_of

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
    ],
    ids=["no_sync", "recompute", "reentrant", "wrapper", "mixed", "emulated", "flat"],
)
def test_units_resharded_to_some_ranks_train_as_plain_pytorch(extra):
    """``reshard_after_forward=2`` on every unit at 4 ranks: the losses and parameters of plain
    PyTorch; every step gathers each bucket once across the world (the forward) and, in the
    backward, the post-forward layout's buckets within pairs; a forward under ``no_grad`` (a
    reentrant checkpoint around a block's call) keeps nothing, and that block's backward
    gathers across the world as usual."""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "adamw", "reshard_after_forward": 2, **extra}
    runs = run(workers.train, WORLD, spec)
    ref = models.reference(spec, WORLD)
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
