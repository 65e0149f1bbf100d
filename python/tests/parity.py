"""Comparison of a sharded run with the plain-PyTorch reference."""

from __future__ import annotations

from typing import Any

import torch

RTOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
ATOL = {torch.float32: 1e-7, torch.bfloat16: 1e-3}


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
        assert len(run["losses"]) == steps
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
            for micro, row in enumerate(ref["losses"][step]):
                got_loss = torch.tensor(run["losses"][step][micro])
                torch.testing.assert_close(got_loss, torch.tensor(row[rank]), rtol=rtol, atol=atol)
