"""The ``"collsched"`` torch.distributed backend: every op and dtype against gloo and against a
reference computed here from every rank's inputs; unmodified FSDP2 and DDP loops on it against
the same loops on gloo and against plain PyTorch; subgroups and device meshes; a rank killed in
the middle of a collective."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import models
import pg_workers
from ranks import run, run_all

# Tolerances of a sum over a few ranks against one computed in float64 and rounded once: the
# kernels accumulate in f32 and round once; gloo sums in the type itself (two roundings at 3
# ranks).
TOL = {
    torch.float32: (1e-6, 1e-6),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float64: (1e-12, 1e-12),
    torch.int64: (0, 0),
}


def _tensor(plain: tuple[str, list]) -> torch.Tensor:
    dtype, values = plain
    return torch.tensor(values, dtype=getattr(torch, dtype))


def _reference(op: str, red: str, inputs: list[torch.Tensor], rank: int) -> torch.Tensor:
    """What ``op`` must give on ``rank``, from every rank's input, in float64 then rounded to
    the type once (shares no code with either backend)."""
    world = len(inputs)
    dtype = inputs[0].dtype
    if op.startswith("all_gather"):
        return torch.cat(inputs)
    if op == "broadcast":
        return inputs[world - 1]
    wide = torch.stack([x.double() for x in inputs])
    if red == "sum":
        total = wide.sum(0)
    elif red == "avg":
        total = wide.sum(0) / world
    elif red == "max":
        total = wide.max(0).values
    else:
        total = wide.min(0).values
    if op.startswith("reduce_scatter"):
        total = total.chunk(world)[rank]
    return total.to(dtype)


CASES = [
    (op, red, dt, numel)
    for op in ("all_reduce", "reduce_scatter", "reduce_scatter_list", "all_reduce_async")
    for red in ("sum", "avg", "max", "min")
    for dt in ("f32", "f16", "bf16")
    for numel in (1, 1000)
] + [
    # From 256 KiB, with every member's part whole: a reduce-scatter, then an all-gather.
    ("all_reduce", "sum", "f32", 3 << 17),
    ("all_reduce", "avg", "bf16", 3 << 17),
    ("all_reduce_async", "sum", "f16", 3 << 17),
    ("all_reduce", "sum", "f64", 33),
    ("all_reduce", "max", "f64", 33),
    ("all_gather", "", "f32", 257),
    ("all_gather", "", "bf16", 3),
    ("all_gather_in_place", "", "f32", 1000),
    ("all_gather_in_place", "", "f16", 3),
    ("all_gather_list", "", "f16", 5),
    ("broadcast", "", "f32", 4099),
    ("broadcast", "", "bf16", 1),
]


@pytest.mark.parametrize("world", [2, 3])
def test_every_op_and_dtype_against_gloo_and_a_reference(world):
    runs = run(pg_workers.every_op, world, CASES, init="collsched")
    assert len(runs) == world
    for rank, results in enumerate(runs):
        assert len(results) == len(CASES), f"rank {rank}: {len(results)} results for {len(CASES)} cases"
        for case, got in zip(CASES, results):
            op, red, _, _ = case
            want = _reference(op, red, [_tensor(x) for x in got["inputs"]], rank)
            mine, gloo = _tensor(got["collsched"]), _tensor(got["gloo"])
            assert mine.dtype == want.dtype and mine.shape == want.shape, (case, mine.shape, want.shape)
            assert not torch.isnan(mine).any(), f"rank {rank} {case}: NaN"
            rtol, atol = TOL[want.dtype]
            if op.startswith("all_gather") or op == "broadcast" or red in ("max", "min"):
                assert torch.equal(mine, want), f"rank {rank} {case}: not bit-exact"
                assert torch.equal(mine, gloo), f"rank {rank} {case}: differs from gloo"
            else:
                # One rounding from float64's result; gloo within its own two roundings of ours.
                torch.testing.assert_close(mine, want, rtol=rtol, atol=atol, msg=lambda m, c=case: f"{c}: {m}")
                torch.testing.assert_close(mine, gloo, rtol=2 * rtol, atol=2 * atol, msg=lambda m, c=case: f"{c}: {m}")


def test_ops_built_on_the_others_integers_and_what_is_refused():
    world = 3
    runs = run(pg_workers.more_ops, world, init="collsched")
    xs = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(world)]
    total = sum(xs)
    for rank, got in enumerate(runs):
        assert torch.equal(_tensor(got["premul_sum"]), total * 0.5)
        want = total if rank == world - 1 else xs[rank]
        assert torch.equal(_tensor(got["reduce"]), want), "reduce: the root gets the sum, others keep theirs"
        if rank == 0:
            assert torch.equal(_tensor(got["gather"]), torch.cat(xs))
        assert torch.equal(_tensor(got["scatter"]), torch.full((3,), 100.0 + rank))
        a2a = torch.cat([(torch.arange(2.0 * world) + 100 * q)[2 * rank : 2 * rank + 2] for q in range(world)])
        assert torch.equal(_tensor(got["all_to_all"]), a2a)
        ints = [torch.tensor([q + 1, -q, 7], dtype=torch.int64) for q in range(world)]
        stacked = torch.stack(ints)
        assert torch.equal(_tensor(got["int64_sum"]), stacked.sum(0))
        assert torch.equal(_tensor(got["int64_max"]), stacked.max(0).values)
        assert torch.equal(_tensor(got["int64_min"]), stacked.min(0).values)
        assert torch.equal(_tensor(got["int64_product"]), stacked.prod(0))
        assert torch.equal(_tensor(got["bool_sum"]), torch.tensor([True, False, True]))
        want = torch.stack([torch.full((3,), float(q)) for q in range(world)]).t()
        assert torch.equal(_tensor(got["noncontiguous"]).view(3, world), want)
        assert torch.equal(_tensor(got["future"]), torch.full((5,), float(sum(range(world)))))
        rows = got["all_gather_coalesced"]
        assert len(rows) == world and all(len(row) == 2 for row in rows), rows
        for q, (a, b) in enumerate(rows):
            assert torch.equal(_tensor(a), torch.full((2,), float(q))), (q, a)
            assert torch.equal(_tensor(b), torch.arange(3.0) * (q + 1)), (q, b)
        dense = torch.zeros(world, world + 1, 2)
        for q in range(world):
            dense[q, : q + 1] = torch.arange(2.0) + q + 1
        assert torch.equal(_tensor(got["sparse_sum"]).view(world + 1, 2), dense.sum(0))
        assert "reduced by SUM alone" in got["sparse_max"], got["sparse_max"]


def test_ranks_that_disagree_on_a_size_all_get_an_error_and_the_flight_records_say_so(monkeypatch, tmp_path):
    monkeypatch.setenv("COLLSCHED_FLIGHT_RECORDER", str(tmp_path))
    out = run(pg_workers.mismatched_sizes, 2, init="collsched", timeout=120)
    for rank, got in enumerate(out):
        assert got != "ran", f"rank {rank}: a mismatched all-gather ran"
        assert "MismatchError" in got and "mismatched" in got, f"rank {rank}: {got}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]
    verdict = _flight_verdict(tmp_path)
    assert verdict.startswith("ranks disagree at collective #0 of group [0, 1] on stream compute"), verdict
    assert "rank 0 all_gather(" in verdict and "4 x f32" in verdict and "8 x f32" in verdict, verdict


def _flight_verdict(path) -> str:
    """``collsched flight PATH``'s first line (the binary built beside the package, or on PATH)."""
    import os
    import shutil
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    exe = next(
        (p for p in (os.path.join(root, "target", k, "collsched") for k in ("release", "debug")) if os.path.exists(p)),
        shutil.which("collsched"),
    )
    if exe is None:
        pytest.skip("no collsched binary built (cargo build) to read the flight records with")
    out = subprocess.run([exe, "flight", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()[0]


def test_flight_record_on_request_lists_every_collective_in_order(tmp_path):
    out = run(pg_workers.recorded, 2, str(tmp_path), init="collsched")
    for rank, rec in enumerate(out):
        assert rec["rank"] == rank and rec["world"] == 2
        ops = [(e["op"], e["seq"], e["state"], e["group"]) for e in rec["entries"]]
        assert ops == [
            ("all_reduce", 0, "completed", [0, 1]),
            ("all_gather", 1, "completed", [0, 1]),
            ("all_reduce", 2, "completed", [0, 1]),
        ], ops
        assert all(e["stream"] == "compute" and e["ended_ns"] >= e["started_ns"] > 0 for e in rec["entries"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]
    assert _flight_verdict(tmp_path).startswith("no disagreement, missing collective or failure in 6 recorded")


def test_a_rank_that_never_launches_times_its_peer_out_and_the_flight_records_name_it(monkeypatch, tmp_path):
    monkeypatch.setenv("COLLSCHED_FLIGHT_RECORDER", str(tmp_path))
    out = run(pg_workers.one_rank_skips, 2, str(tmp_path), init="collsched", timeout=120)
    assert out[1] == "skipped"
    assert "PeerError" in out[0] and "not complete after waiting" in out[0], out[0]
    # Worded as torch's backends word it: torch's own suite matches " (Timed out|closed|timeout) ".
    assert re.search(" Timed out waiting 2000ms: ", out[0]), out[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0.json", "rank-1.json"]
    verdict = _flight_verdict(tmp_path)
    assert verdict.startswith("ranks [1] never launched collective #1 of group [0, 1] on stream compute"), verdict


def test_bitwise_reductions_unsorted_groups_uneven_all_to_all_and_failed_futures():
    """The bitwise reductions give gloo's results on every integer type and bool; a group of
    ranks in descending order (``sort_ranks=False``) is refused by name (its group ranks would
    not be the library's); an all-to-all of uneven splits gives gloo's rows; an async MAX of
    int64 (reduced locally) returns before its peer comes, so a send after it is not a
    deadlock; the future of an op whose peer never comes raises the timeout when waited for
    (it completed with the failure as its value before)."""
    runs = run(pg_workers.semantics, 2, init="collsched", timeout=120)
    for rank, got in enumerate(runs):
        bitwise = {k: v for k, v in got.items() if k.startswith(("band", "bor", "bxor"))}
        assert len(bitwise) == 12, sorted(bitwise)
        for case, v in bitwise.items():
            assert v["collsched"] == v["gloo"], f"rank {rank} {case}: {v}"
        assert "sort_ranks=False" in got["unsorted"] and "ascending" in got["unsorted"], got["unsorted"]
        uneven = got["all_to_all_uneven"]
        assert uneven["collsched"] == uneven["gloo"] and -1.0 not in uneven["collsched"][1], uneven
        assert got["async_local"] == ("int64", [2]), got["async_local"]
        empty = got["all_to_all_empty"]
        assert empty["collsched"] == empty["gloo"], empty
        assert "the sizes of the members disagree" in got["all_to_all_disagree"], got["all_to_all_disagree"]
    assert runs[1]["future"] == "skipped"
    assert runs[0]["future"].startswith("raised") and "PeerError" in runs[0]["future"], runs[0]["future"]


def test_a_world_s_timeout_must_be_positive():
    """``World(..., timeout_secs=...)`` (a process group's timeout): a value that is no time at
    all is refused by name, before anything is joined."""
    from collsched import _native

    for bad in (0.0, -1.0):
        with pytest.raises(Exception, match="timeout_secs") as e:
            _native.World(0, 1, "collsched-test-timeout", bad)
        assert "positive" in str(e.value), e.value


def test_subgroups_and_device_mesh_at_4_ranks():
    runs = run(pg_workers.subgroups, 4, init="collsched")
    for rank, got in enumerate(runs):
        same_parity = [r + 1 for r in range(4) if r % 2 == rank % 2]
        assert got["sub"] == [float(sum(same_parity))] * 4
        assert got["world"] == [float(sum(range(4)))] * 3
        # A (2, 2) mesh: tp pairs consecutive ranks, dp pairs ranks 2 apart.
        tp = [r for r in range(4) if r // 2 == rank // 2]
        dp = [r for r in range(4) if r % 2 == rank % 2]
        assert got["tp"] == [float(sum(tp))] * 2
        assert got["dp"] == [float(sum(dp))] * 2


def _assert_runs_close(a: dict, b: dict, rtol: float, atol: float, what: str) -> None:
    assert len(a["params"]) == len(b["params"]) > 0, what
    torch.testing.assert_close(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=rtol, atol=atol)
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"])):
        assert sorted(pa) == sorted(pb), f"{what} step {step}: parameter names differ"
        for n in pa:
            x, y = torch.tensor(pa[n]), torch.tensor(pb[n])
            assert x.shape == y.shape and not torch.isnan(x).any(), f"{what} step {step} {n}"
            torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=lambda m, s=step, n=n: f"{what} {s} {n}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_unmodified_fsdp2_loop_matches_gloo_and_plain_pytorch(world):
    # Against gloo: SGD and a gradient clip (the clip's norm is an all-reduce through DTensor's
    # functional collectives). gloo sums over 3 ranks in another order than rank order, and
    # Adam would blow the last-bit differences on gradients that are rounding noise (the key
    # bias's) up to a step of the learning rate; SGD keeps them last-bit.
    spec = {"model": "gpt", "steps": 4, "clip": 1.0, "opt": "sgd"}
    mine = run(pg_workers.fsdp2_train, world, spec, init="collsched")
    gloo = run(pg_workers.fsdp2_train, world, spec, init="gloo")
    assert mine[0]["backend"] == "collsched" and gloo[0]["backend"] == "gloo"
    for rank in range(world):
        _assert_runs_close(mine[rank], gloo[rank], 1e-5, 1e-6, f"rank {rank} collsched vs gloo")
        assert mine[rank]["params"] == mine[0]["params"], f"rank {rank}'s full parameters differ from rank 0's"
    # Against plain PyTorch, which sums the ranks' gradients in rank order as collsched does:
    # AdamW, every step, tight.
    spec = {"model": "gpt", "steps": 4}
    ref = models.reference(spec, world)
    mine = run(pg_workers.fsdp2_train, world, spec, init="collsched")
    for step in range(4):
        assert sorted(mine[0]["params"][step]) == sorted(ref["params"][step])
        for n, w in ref["params"][step].items():
            got = torch.tensor(mine[0]["params"][step][n])
            torch.testing.assert_close(got, w.flatten(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_unmodified_ddp_loop_matches_gloo(world):
    spec = {"model": "mlp", "steps": 4, "bucket_cap_mb": 0.0005}
    mine = run(pg_workers.ddp_train, world, spec, init="collsched")
    gloo = run(pg_workers.ddp_train, world, spec, init="gloo")
    for rank in range(world):
        _assert_runs_close(mine[rank], gloo[rank], 1e-5, 1e-6, f"rank {rank} collsched vs gloo")
        # DDP starts every rank from rank 0's values and keeps them equal.
        assert mine[rank]["params"] == mine[0]["params"], f"rank {rank} diverged from rank 0"


# 8 << 20 elements do not split in 3 (one all-reduce); 3 << 21 do (a reduce-scatter, then an
# all-gather: the second stage fails too, and the work gives its buffers back).
@pytest.mark.parametrize("numel", [8 << 20, 3 << 21])
def test_a_rank_killed_mid_collective_fails_the_others_within_seconds(monkeypatch, numel):
    # The backend's timeout is a minute: failing in seconds means the death was seen, not waited out.
    monkeypatch.setenv("COLLSCHED_TIMEOUT_SECS", "60")
    out = run_all(pg_workers.killed_mid_op, 3, numel, init="collsched", timeout=120)
    assert not out[2][0] and "died" in out[2][1], out[2]
    for rank in (0, 1):
        ok, got = out[rank]
        assert ok, got
        assert got["error"] is not None, f"rank {rank}: the collective with a dead member succeeded"
        assert got["error"].startswith(f"collsched.PeerError: rank {rank}: "), got["error"]
        # Rank 2 named as the one gone ("ranks [2] will never arrive: ..."), not just as a
        # member of the collective's group [0, 1, 2].
        gone = r"\branks \[2\] will never arrive\b|\brank 2 (exited|failed)\b"
        assert re.search(gone, got["error"]), f"rank {rank}: the error does not name rank 2 as gone: {got['error']}"
        assert got["seconds"] < 20, f"rank {rank}: took {got['seconds']:.1f} s to fail"


def test_init_process_group_finds_collsched_without_an_import(tmp_path):
    """The package's entry point in torch.distributed.backends: a script that never imports
    collsched gets the backend by its name."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        f"dist.init_process_group('collsched', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "t = torch.ones(3); dist.all_reduce(t)\n"
        "print(dist.get_backend(), 'collsched.torch' in sys.modules, t.tolist())\n"
        "dist.destroy_process_group()\n"
    )
    env = {**os.environ, "COLLSCHED_RUN_ID": f"pytest-entry-{os.getpid()}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "collsched True [1.0, 1.0, 1.0]", done.stdout


def test_monitored_barrier_names_the_rank_that_did_not_come():
    out = run(pg_workers.monitored, 3, init="collsched", timeout=120)
    assert [o["all"] for o in out] == ["passed"] * 3, out
    # gloo's words, which torch's own tests match.
    assert out[0]["skipped_by_last"] == "RuntimeError: Ranks 2 failed to pass monitoredBarrier in 2000 ms", out
    assert out[1]["skipped_by_last"].startswith(
        "RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors while waiting"
    ), out
    assert "skipped_by_last" not in out[2], out


def test_debug_detail_mode_runs_the_collectives(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    world = 3
    out = run(pg_workers.detail_mode, world, init="collsched", timeout=120)
    for rank, got in enumerate(out):
        assert got["debug"].endswith("DETAIL"), got["debug"]
        assert got["objects"] == [{"rank": q, "name": f"r{q}"} for q in range(world)], (rank, got)
        assert torch.equal(_tensor(got["sub"]), torch.full((4,), float(sum(range(1, world + 1))))), (rank, got)
        assert torch.equal(_tensor(got["default"]), torch.full((2,), float(sum(range(world))))), (rank, got)
