"""Comparison of a sharded run with the plain-PyTorch reference."""

from __future__ import annotations

from typing import Any

import torch

# The tolerances of a run on the CPU, by parameter dtype, as ``(rtol, atol)``.
#
# bf16: exact. A rank computes its micro-batches with the reference's own kernels on one thread
# (the same bf16 products, summed in the same order, as ``models.reference`` runs them). The
# library then rounds where the reference rounds: it accumulates no_sync micro-batches in the
# reduction dtype, sums the ranks' gradients in f32 in rank order (the reference's f32 sum, one
# rounding per addition), divides by the world and rounds once to the reduction dtype; the
# gradient is rounded to bf16 once, as the reference's ``.to(dtype)``; SGD updates the shards
# elementwise as the reference updates the full parameters. A bf16 reduction at 2 ranks is the
# kernels' f32 sum rounded once to bf16, which is the reference's bf16 addition (the exact sum
# rounded once), but for a double rounding that needs the two gradients 2**16 apart. Measured:
# every bf16 run on the CPU (2, 3 and 4 ranks, f32 and bf16 reductions, no_sync, hybrid,
# checkpoints) is the reference bit for bit. A tolerance hides what a small step changes: at
# 1e-2 relative (more than a bf16 ulp, 2**-7) an f32 reduction passed for a bf16 one (their
# runs differ by 1e-3 at most; test_fully_shard tells them apart).
#
# f32: a few ulps, for the runs that are not exact: clipping's norm is summed over the shards in
# another order than the reference's, and its last bit reaches every parameter.
RTOL = {torch.float32: 1e-6, torch.bfloat16: 0.0}
ATOL = {torch.float32: 1e-7, torch.bfloat16: 0.0}


def check(
    runs: list[dict[str, Any]],
    ref: dict[str, Any],
    dtype: torch.dtype = torch.float32,
    tol: tuple[float, float] | None = None,
) -> None:
    """Every rank's losses and full parameters after every step equal the reference's (a
    NaN, a missing or extra step, parameter or element fails). ``tol``: ``(rtol, atol)`` in
    place of the dtype's (a run whose kernels sum in another order than the CPU's)."""
    rtol, atol = tol or (RTOL[dtype], ATOL[dtype])
    steps = len(ref["params"])
    for rank, run in enumerate(runs):
        assert len(run["params"]) == steps, f"rank {rank}: {len(run['params'])} steps, reference {steps}"
        assert len(run["losses"]) == steps, f"rank {rank}: losses of {len(run['losses'])} steps, reference {steps}"
        for step in range(steps):
            want = ref["params"][step]
            got = run["params"][step]
            assert sorted(got) == sorted(want), f"rank {rank} step {step}: parameter names differ"
            for n, w in want.items():
                g = torch.tensor(got[n], dtype=torch.float32)
                torch.testing.assert_close(
                    g,
                    w.float().flatten(),
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m, n=n, s=step, r=rank: f"rank {r} step {s} {n}: {m}",
                )
            micros = ref["losses"][step]
            assert len(run["losses"][step]) == len(micros), f"rank {rank} step {step}: micro-batches differ"
            for micro, row in enumerate(micros):
                got_loss = torch.tensor(run["losses"][step][micro])
                torch.testing.assert_close(
                    got_loss,
                    torch.tensor(row[rank]),
                    rtol=rtol,
                    atol=atol,
                    msg=lambda m, s=step, i=micro, r=rank: f"rank {r} step {s} micro-batch {i} loss: {m}",
                )


def differing_elements(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many parameter elements differ between the steps of two runs or references (a
    NaN in either counts); the two must have the same steps, parameters and sizes."""
    assert len(a["params"]) == len(b["params"]), "different numbers of steps"
    n = 0
    for pa, pb in zip(a["params"], b["params"]):
        assert sorted(pa) == sorted(pb), "different parameters"
        for k in pa:
            x, y = (torch.as_tensor(p[k]).float().flatten() for p in (pa, pb))
            assert x.shape == y.shape, f"{k}: {x.numel()} and {y.numel()} elements"
            n += int((x != y).sum())
    return n
