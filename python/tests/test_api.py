"""The package's surface: plans, errors, shards, trainability by hand, the example."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import collsched

import models
import parity
import plans
import workers
from ranks import run, run_all

REPO = Path(__file__).resolve().parents[2]
PARAMS = [
    {"name": "emb", "shape": [37, 24], "dtype": "f32"},
    {"name": "w", "shape": [24, 13], "dtype": "bf16", "trainable": False},
    {"name": "b", "shape": [13], "dtype": "f32"},
]


def covered(plan: dict, world: int) -> dict[str, list[int]]:
    """How many times each element of each parameter is held by some rank's gather shard."""
    numel = {p["name"]: p["numel"] for p in plan["params"]}
    seen = {n: [0] * k for n, k in numel.items()}
    for b in plan["buckets"]:
        if b["kind"] != "gather":
            continue
        assert len(b["shards"]) == world
        for shard in b["shards"]:
            for s in shard["segments"]:
                for i in range(s["param_offset"], s["param_offset"] + s["numel"]):
                    seen[s["param"]][i] += 1
    return seen


@pytest.mark.parametrize("strategy", ["even", "flat", "greedy"])
def test_plan_shards_every_element_once(strategy):
    plan = collsched.plan(PARAMS, 3, strategy=strategy, bucket_mb=0.001)
    assert plan["world"] == 3 and plan["strategy"] == strategy and len(plan["fingerprint"]) == 16
    assert [p["name"] for p in plan["params"]] == ["emb", "w", "b"]
    assert [p["numel"] for p in plan["params"]] == [37 * 24, 24 * 13, 13]
    for name, counts in covered(plan, 3).items():
        assert counts and all(c == 1 for c in counts), f"{strategy}: {name} held {set(counts)} times"


def test_plan_of_a_module_and_hybrid_replicas():
    plan = collsched.plan(models.build("mlp"), 4, strategy="hybrid:2")
    for counts in covered(plan, 4).values():
        assert all(c == 2 for c in counts)  # two replica groups


def cli() -> str | None:
    for p in (os.environ.get("COLLSCHED_BIN"), REPO / "target/debug/collsched", REPO / "target/release/collsched"):
        if p and Path(p).is_file():
            return str(p)
    return shutil.which("collsched")


# Buckets of several parameters, both dtypes, frozen ones between trainable ones, a scalar, a
# parameter over the cap, a bucket of exactly the cap (b, ln, s and k: 1048 bytes): what a wrong
# grouping, split or gradient bucket would show.
PLAN_CAP_MB = 1048 / 2**20
PLAN_PARAMS = [
    {"name": "emb", "shape": [37, 24], "dtype": "f32"},
    {"name": "w", "shape": [24, 13], "dtype": "bf16", "trainable": False},
    {"name": "b", "shape": [13], "dtype": "f32"},
    {"name": "ln", "shape": [24], "dtype": "f32", "trainable": False},
    {"name": "q", "shape": [5, 7], "dtype": "bf16"},
    {"name": "s", "shape": [], "dtype": "f32"},
    {"name": "v", "shape": [300], "dtype": "bf16"},
    {"name": "k", "shape": [224], "dtype": "f32"},
]


@pytest.mark.parametrize(
    "strategy, world, align", [("even", 3, 16), ("flat", 3, 16), ("flat", 4, 256), ("hybrid:2", 4, 16)]
)
def test_plan_is_what_the_rules_give(strategy, world, align):
    """The plan against one worked out in the test from the documented rules (plans.py):
    buckets, shards, segments and ops, element for element."""
    plan = collsched.plan(PLAN_PARAMS, world, strategy=strategy, bucket_mb=PLAN_CAP_MB, align=align)
    fingerprint = plan.pop("fingerprint")
    assert re.fullmatch(r"[0-9a-f]{16}", fingerprint), fingerprint
    want = plans.expected(PLAN_PARAMS, world, strategy, PLAN_CAP_MB, align)
    # The rules give buckets of several parameters here, split across them (else this test
    # would check little).
    assert max(len(b["params"]) for b in want["buckets"]) >= 3
    assert plan == want


def test_plan_is_what_the_cli_prints(tmp_path):
    """The bindings and `collsched plan --json` build the same plan from the same knobs (both
    write the schedule crate's plan JSON); that plan is the one the rules give."""
    exe = cli()
    if exe is None:
        pytest.skip("no collsched binary (cargo build) to compare with")
    f = tmp_path / "params.json"
    f.write_text(json.dumps({"params": PLAN_PARAMS}))
    args = ["--world", "3", "--strategy", "flat", "--bucket-mb", repr(PLAN_CAP_MB), "--align", "16", "--json"]
    out = subprocess.run([exe, "plan", "--params", str(f), *args], check=True, capture_output=True, text=True).stdout
    printed = json.loads(out)
    assert collsched.plan(PLAN_PARAMS, 3, strategy="flat", bucket_mb=PLAN_CAP_MB, align=16) == printed
    printed.pop("fingerprint")
    assert printed == plans.expected(PLAN_PARAMS, 3, "flat", PLAN_CAP_MB, 16)


@pytest.mark.parametrize(
    "params, world, kw, words",
    [
        ([{"name": "z", "shape": [4, 0], "dtype": "f32"}], 2, {}, ["z"]),
        ([("a", [3], "f32"), ("a", [3], "f32")], 2, {}, ["a"]),
        (PARAMS, 2, {"strategy": "diagonal"}, ["diagonal"]),
        (PARAMS, 0, {}, ["world"]),
        ([("q", [3], "complex64")], 2, {}, ["complex64"]),
        (PARAMS, 2, {"bucket_mb": -1}, ["bucket_mb"]),
    ],
)
def test_plan_errors_name_what_is_wrong(params, world, kw, words):
    with pytest.raises(collsched.CollschedError) as e:
        collsched.plan(params, world, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_shards_are_one_dimensional_views_the_gathers_read():
    runs = run(workers.shard_views, 2)
    plan = runs[0]["plan"]
    held = {r: {} for r in range(2)}
    for b in plan["buckets"]:
        if b["kind"] == "gather":
            for shard in b["shards"]:
                for s in shard["segments"]:
                    held[shard["rank"]].setdefault(s["param"], []).append((s["param_offset"], s["numel"]))
    ref = dict(models.build("mlp").named_parameters())
    for rank, r in enumerate(runs):
        for name, (dim, numel) in r["sizes"].items():
            assert dim == 1 and numel == sum(n for _, n in held[rank].get(name, [])), name
    # Each rank added rank + 1 to its own elements: the gathered values show exactly that.
    for name, p in ref.items():
        want = p.detach().flatten().clone()
        for rank in range(2):
            for off, n in held[rank].get(name, []):
                want[off : off + n] += rank + 1
        for r in runs:
            torch.testing.assert_close(torch.tensor(r["full"][name]), want, rtol=0, atol=0)


def test_tensors_are_read_by_their_own_account_of_their_device():
    """A CUDA tensor handed to a host world (the initial value of a block's parameter that
    fully_shard gathered on the GPU, a gradient, a saved state) is refused, named, where it was
    read as host memory (a crash on a GPU); so is a strided one."""
    for r in run(workers.tensors_by_their_device, 2):
        for key in ("init_on_cuda", "grad_on_cuda", "grad_dlpack_on_cuda", "save_on_cuda"):
            assert "on cuda:0" in r[key] and "host memory" in r[key], (key, r[key])
        assert "parameter b's initial value" in r["init_on_cuda"], r["init_on_cuda"]
        assert "parameter id 1's gradient" in r["grad_on_cuda"], r["grad_on_cuda"]
        assert "state m of parameter id 0" in r["save_on_cuda"], r["save_on_cuda"]
        assert "not contiguous" in r["init_strided"] and "parameter w's" in r["init_strided"], r["init_strided"]
        assert "not contiguous" in r["grad_strided"], r["grad_strided"]
        assert "1 initial values for 2 parameters" in r["init_count"], r["init_count"]


def test_the_emulated_device_s_memory_is_never_read_as_host_memory():
    for r in run(workers.emulated_regions, 2):
        assert r["kind"] == "emulated" and r["device"] == 0 and r["emulated"], r
        assert "emulated device has no host buffer" in r["host_read"], r["host_read"]
        assert r["view"] == ("cpu", r["want"]) and len(r["want"]) == 12, r


def test_a_region_is_a_dlpack_tensor_over_the_same_memory():
    for r in run(workers.dlpack_views, 2):
        numel = r["numel"]
        assert r["len"] == 4 * numel
        assert r["same_address"] and r["write_seen"] == 7.25
        assert r["bf16"] == ("torch.bfloat16", [2, numel], True)
        assert r["f16"] == ("torch.float16", [2 * numel])
        too_big, negative, dtype, bf16_big = r["errors"]
        assert "does not fit a region of" in too_big and f"[{numel + 1}]" in too_big, too_big
        assert "does not fit" in negative, negative
        assert "f64" in dtype and "bf16" in dtype, dtype
        assert "does not fit" in bf16_big, bf16_big
        assert r["second_take"] != "no error"
        assert r["outlives"] == 7.25
        # A reference to the region while a tensor or an untaken capsule lives, none after.
        assert r["refs"] == [1, 0, 1, 0], r["refs"]


def test_saved_tensor_hooks_keep_references_to_shown_parameters_only():
    """The native saved-tensor hooks: a view of a shown unit's parameter (at any offset, in
    another dtype) packs to a reference to that parameter; anything else passes through;
    unpacking views the parameter's value as last shown, or asks Python while its unit is
    hidden or the backward has not begun."""
    from collsched import _native

    asked = []

    def unpack_saved(saved):
        asked.append(saved.pid)
        return "from python"

    hooks = _native.Hooks(2, [0, 0, 1], unpack_saved)
    w0, w1, w2 = (torch.arange(12.0).view(3, 4) + 100 * i for i in range(3))
    hooks.set_spans(0, [(w.data_ptr(), w.nbytes, pid, w) for pid, w in ((0, w0), (1, w1))])
    hooks.set_spans(1, [(w2.data_ptr(), w2.nbytes, 2, w2)])
    activation = torch.ones(3)
    # Nothing is shown: everything passes through.
    view = w0.t()
    assert hooks.pack(view) is view
    hooks.show(0)
    saved = hooks.pack(w1[1:].t())
    assert type(saved) is _native.Saved and saved.pid == 1 and saved.offset == 4
    as_int = hooks.pack(w0.view(torch.int32)[2])
    assert type(as_int) is _native.Saved and as_int.pid == 0 and as_int.dtype == torch.int32
    assert hooks.pack(activation) is activation
    assert hooks.pack(w2) is w2  # unit 1 is hidden
    assert hooks.unpack(activation) is activation
    # Before the backward begins, Python is asked.
    assert hooks.unpack(saved) == "from python" and asked == [1]
    hooks.backward = True
    torch.testing.assert_close(hooks.unpack(saved), w1[1:].t(), rtol=0, atol=0)
    torch.testing.assert_close(hooks.unpack(as_int), w0.view(torch.int32)[2], rtol=0, atol=0)
    # The parameter moved: the new view is read.
    moved = w1 + 0.5
    hooks.set_spans(0, [(w0.data_ptr(), w0.nbytes, 0, w0), (moved.data_ptr(), moved.nbytes, 1, moved)])
    torch.testing.assert_close(hooks.unpack(saved), moved[1:].t(), rtol=0, atol=0)
    hooks.hide(0)
    assert hooks.unpack(saved) == "from python" and asked == [1, 1]
    assert hooks.take_seconds() > 0.0 and hooks.take_seconds() == 0.0
    with pytest.raises(collsched.CollschedError, match="unit 2 out of range"):
        hooks.show(2)
    with pytest.raises(collsched.CollschedError, match="parameter id 3 out of range"):
        hooks.set_spans(1, [(w2.data_ptr(), w2.nbytes, 3, w2)])
    with pytest.raises(collsched.CollschedError, match="unit 5 out of range"):
        _native.Hooks(2, [5], unpack_saved)


def test_trainability_refreshed_by_hand():
    frozen = {s: ["blocks.1."] for s in (1, 2)}
    spec = {"model": "mlp", "steps": 4, "frozen": frozen, "auto_refresh_trainable": False, "bucket_mb": 0.0005}
    runs = run(workers.train, 2, spec)
    parity.check(runs, models.reference(spec, 2))


@pytest.mark.parametrize(
    "case, words",
    [
        ("f64", ["count", "float64", "ignored_params"]),
        ("no_params", ["no parameters"]),
        ("prefetch", ["sometimes"]),
        ("strategy", ["hybrid:0"]),
        ("root_then_block", ["0.weight", "blocks first"]),
        ("half_after", ["blocks.0.weight", "torch.float16", "before fully_shard"]),
    ],
)
def test_fully_shard_errors_name_the_parameter_or_knob(case, words):
    (text,) = run(workers.bad_fully_shard, 1, case)
    assert text.startswith("collsched.CollschedError"), text
    for w in words:
        assert w in text, text


def test_the_example_trains_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "0"]
    cmd += [str(REPO / "python/examples/train.py"), "--steps", "10", "--layers", "2", "--dim", "64"]
    cmd += ["--flight-out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    losses = [float(line.split("validation loss")[1]) for line in p.stdout.splitlines() if "validation loss" in line]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses))), p.stdout
    assert losses[-1] < losses[0], p.stdout
    assert "reduce-scatters" in p.stdout
    # --flight-out: each rank's record with its compute spans, the workload of the root and the
    # two blocks, with the step's loss and update and the hooks' host time.
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert record["rank"] == rank and record["entries"] and record["compute"], sorted(record)
    workload = json.loads((tmp_path / "workload.json").read_text())
    assert [layer["name"] for layer in workload["layers"]] == ["unit 0", "unit 1", "unit 2"], workload["layers"]
    assert all(workload[k] > 0 for k in ("loss_flops", "update_flops", "hook_s")), workload


def test_sync_module_states_starts_every_rank_from_rank_0():
    runs = run(workers.sync_states, 3)
    want = {n: p.detach().flatten() for n, p in models.build("mlp", seed=0).named_parameters()}
    other = {n: p.detach().flatten() for n, p in models.build("mlp", seed=1).named_parameters()}
    for r in runs:
        assert sorted(r) == sorted(want)
        for n, w in want.items():
            assert not torch.equal(w, other[n])
            torch.testing.assert_close(torch.tensor(r[n]), w, rtol=0, atol=0)


def test_bench_measures_and_checks_a_collective():
    rows = collsched.bench("reduce_scatter", 2, min_bytes=1 << 16, max_bytes=1 << 18, factor=4, iters=3, check=True)
    assert [r["bytes"] for r in rows] == [1 << 16, 1 << 18]
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0 and r["busbw"] > 0 and r["memcpy"] > 0
    with pytest.raises(collsched.CollschedError, match="broadcast"):
        collsched.bench("broadcast", 2)


@pytest.mark.parametrize(
    "dtype, load_world, load_strategy",
    [
        (torch.float32, 2, "greedy"),
        (torch.float32, 3, "flat"),
        (torch.float32, 4, "hybrid:2"),
        (torch.bfloat16, 2, "hybrid:2"),
    ],
)
def test_checkpoint_saved_at_4_continues_in_another_layout(tmp_path, dtype, load_world, load_strategy):
    path = str(tmp_path / "ckpt")
    save = {"model": "gpt", "steps": 4, "split": 2, "save_world": 4, "dtype": dtype, "bucket_mb": 0.002}
    if dtype == torch.bfloat16:
        save.update(opt="sgd", reduce_dtype=torch.float32)
    first = run(workers.checkpointed, 4, {**save, "strategy": "even"}, path, "save")
    later = run(workers.checkpointed, load_world, {**save, "strategy": load_strategy}, path, "load")
    strategies = ["even", "even", load_strategy, load_strategy]
    ref = models.reference({**save, "worlds": [4, 4, load_world, load_world], "strategies": strategies}, 4)
    parity.check(first, {"params": ref["params"][:2], "losses": [row for row in ref["losses"][:2]]}, dtype)
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]}, dtype)


def test_a_tensor_learning_rate_comes_back_from_a_checkpoint_as_a_tensor(tmp_path):
    """AdamW with a tensor ``lr``, saved at 2 ranks and loaded at 1: the group's hyperparameters
    come back as the optimizer had them (a tensor, a tuple of betas), and the training goes on
    as plain PyTorch's."""
    path = str(tmp_path / "ckpt")
    save = {"model": "mlp", "steps": 4, "split": 2, "save_world": 2, "opt": "adamw-tensor-lr", "bucket_mb": 0.0005}
    first = run(workers.checkpointed, 2, save, path, "save")
    later = run(workers.checkpointed, 1, save, path, "load")
    ref = models.reference({**save, "worlds": [2, 2, 1, 1]}, 2)
    parity.check(first, {"params": ref["params"][:2], "losses": ref["losses"][:2]})
    parity.check(later, {"params": ref["params"][2:], "losses": ref["losses"][2:]})


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_save_full_loads_into_plain_pytorch(tmp_path, name):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = str(tmp_path / "model.safetensors")
    runs = run(workers.export_full, 3, {"model": name, "strategy": "flat", "bucket_mb": 0.002}, path)
    plain = models.build(name, seed=7)
    missing, unexpected = plain.load_state_dict(safetensors_torch.load_file(path), strict=False)
    assert not unexpected
    assert missing in ([], ["head.weight"])  # the tied head is the embedding
    ref = models.reference({"model": name, "steps": 2}, 3)["params"][-1]
    for n, p in plain.named_parameters():
        torch.testing.assert_close(p.detach().flatten(), ref[n].flatten(), rtol=1e-6, atol=1e-7)
        for r in runs:
            torch.testing.assert_close(torch.tensor(r[n]), ref[n].flatten(), rtol=1e-6, atol=1e-7)


def test_a_rank_killed_during_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    spec = {"model": "mlp", "steps": 3, "split": 1, "save_world": 2, "bucket_mb": 0.0005}
    run(workers.checkpointed, 2, spec, good, "save")
    out = run_all(workers.killed_during_save, 2, spec, good, bad, timeout=120)
    ok0, text0 = out[0]
    assert ok0 and text0.startswith("collsched.PeerError: rank 0: "), text0
    # Rank 1 named as the one gone ("rank 1 exited during an exchange", "ranks [1] ...").
    gone = r"\brank 1 (exited|failed)\b|\branks \[1\] (will never arrive|failed)\b"
    assert re.search(gone, text0), text0
    assert not out[1][0] and "exit code -9" in out[1][1]
    # The interrupted checkpoint is refused as incomplete on every rank; the previous one loads.
    for text in run(workers.load_fails, 2, spec, bad):
        assert text.startswith("collsched.CollschedError") and "did not finish" in text, text
    later = run(workers.checkpointed, 2, spec, good, "load")
    ref = models.reference({**spec, "worlds": [2, 2, 2]}, 2)
    parity.check(later, {"params": ref["params"][1:], "losses": ref["losses"][1:]})


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_sharded_states_are_freed_once_unreferenced(backend):
    for r in run(workers.states_are_freed, 2, backend):
        assert r["n"] == 2 + 2 * 12, r  # two block states and their parameters' masters
        assert all(r["blocks_and_masters_freed"]), r
        assert r["root_freed"], r


@pytest.mark.parametrize("backend", ["shm", "emulated"])
def test_training_forwards_without_a_backward_free_their_graphs(backend):
    from collsched.torch.shard import _VIEWS_KEPT

    for r in run(workers.forward_only_passes, 2, backend):
        for name in ("plain", "sharded"):
            counts = r[name]
            assert len(counts) == 10 and all(c > 0 for c in counts), r
            # A pass's graph kept would add its tensors every pass. What may grow: the views
            # of the library's buffers, at most _VIEWS_KEPT per parameter (a buffer that comes
            # back at another address), and nothing over the last passes.
            bound = counts[0] + _VIEWS_KEPT * r[f"{name}_params"]
            assert max(counts) <= bound, f"{name}: live tensors after each pass {counts}, bound {bound}"
            assert counts[-3:] == [counts[-1]] * 3, f"{name}: live tensors after each pass {counts}"
