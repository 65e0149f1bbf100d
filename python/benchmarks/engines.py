"""Training engines nobody here wrote, unmodified, on the "collsched" torch.distributed backend
against "gloo": the same script, the same seeds, one string changed.

    python python/benchmarks/engines.py [--nproc 2] [--steps 6] [--engines deepspeed,accelerate]

Each engine's worker runs under ``torchrun`` once per backend (``DS_ACCELERATOR=cpu``):

- ``deepspeed``: DeepSpeed ZeRO-3 (``deepspeed.init_distributed(dist_backend=...)``, every
  parameter partitioned: ``stage3_param_persistence_threshold`` 0; two micro-batches of
  gradient accumulation per step; torch's SGD through ``zero_allow_untested_optimizer``).
- ``accelerate``: Hugging Face Accelerate's loop (``Accelerator(cpu=True)``, ``prepare``,
  ``accumulate``, ``backward``) on a process group made first with the backend. On a machine
  without an accelerator device Accelerate runs DistributedDataParallel: its FSDP2 path is
  taken only for device distributed types (``accelerate/state.py`` sets ``DistributedType.FSDP``
  for MULTI_GPU, MULTI_XPU, ... and not for MULTI_CPU), so it cannot run on a CPU.

Every rank's loss of every micro-batch on "collsched" is compared with the same rank's on
"gloo": a NaN, a missing step or a rank that differs by more than ``--loss-rtol`` (0: at 2
ranks both backends sum two values, which rounds alike in either order) fails the run. The
table says which backend class each run used.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

ENGINES = ("deepspeed", "accelerate")
BACKENDS = ("gloo", "collsched")


def model() -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, 64)]
    for _ in range(3):
        layers += [nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64)]
    return nn.Sequential(*layers, nn.GELU(), nn.Linear(64, 4))


def batch(step: int, micro: int, rank: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def backend_class() -> str:
    import torch
    import torch.distributed as dist

    return type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__


def deepspeed_worker(backend: str, steps: int) -> dict[str, Any]:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend=backend)
    rank = int(os.environ["RANK"])
    net = model()
    cfg = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
    losses = []
    for step in range(steps):
        for micro in range(2):
            x, y = batch(step, micro, rank)
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return {"losses": losses, "backend": backend_class()}


def accelerate_worker(backend: str, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    dist.init_process_group(backend)
    rank = int(os.environ["RANK"])
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net, opt = acc.prepare(net, opt)
    losses = []
    for step in range(steps):
        for micro in range(2):
            with acc.accumulate(net):
                x, y = batch(step, micro, rank)
                loss = ((net(x) - y) ** 2).mean()
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
    return {"losses": losses, "backend": backend_class(), "wrapped": type(net).__name__}


def worker(engine: str, backend: str, out: str, steps: int) -> None:
    if backend == "collsched":
        import collsched.torch  # noqa: F401  (registers "collsched")
    got = {"deepspeed": deepspeed_worker, "accelerate": accelerate_worker}[engine](backend, steps)
    with open(os.path.join(out, f"{engine}-{backend}-{os.environ['RANK']}.json"), "w") as f:
        json.dump(got, f)


def compare(engine: str, runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> list[str]:
    """Every rank's losses on collsched against gloo's: the problems found (none: equal)."""
    bad = []
    want_len = 2 * args.steps
    for rank in range(args.nproc):
        a, b = runs["gloo"][rank]["losses"], runs["collsched"][rank]["losses"]
        for name, losses in (("gloo", a), ("collsched", b)):
            if len(losses) != want_len:
                bad.append(f"{engine} rank {rank} {name}: {len(losses)} losses, expected {want_len}")
            if any(not math.isfinite(v) for v in losses):
                bad.append(f"{engine} rank {rank} {name}: a loss is not finite: {losses}")
        for i, (x, y) in enumerate(zip(a, b)):
            if abs(x - y) > args.loss_rtol * abs(x) or math.isnan(y):
                bad.append(f"{engine} rank {rank} micro-batch {i}: collsched {y!r}, gloo {x!r}")
    # A loss of 0 divides by the smallest normal; no losses at all (flagged above) print nan.
    worst = max(
        (
            abs(x - y) / max(abs(x), sys.float_info.min)
            for r in range(args.nproc)
            for x, y in zip(runs["gloo"][r]["losses"], runs["collsched"][r]["losses"])
        ),
        default=math.nan,
    )
    print(f"{engine}: every rank's losses compared, largest relative difference {worst:.3g}")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--loss-rtol", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--worker", nargs=3, metavar=("ENGINE", "BACKEND", "OUTDIR"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker, args.steps)
        return
    engines = [e for e in args.engines.split(",") if e]
    unknown = sorted(set(engines) - set(ENGINES))
    if unknown:
        sys.exit(f"engines.py: unknown engine(s) {unknown}; known: {', '.join(ENGINES)}")
    problems: list[str] = []
    print(f"{'engine':<11} {'backend':<10} {'ranks':>5} {'losses':>6}  backend class      rank 0's last loss")
    with tempfile.TemporaryDirectory() as out:
        for engine in engines:
            runs: dict[str, list[dict[str, Any]]] = {}
            for backend in BACKENDS:
                cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}"]
                cmd += ["--standalone", os.path.abspath(__file__), "--steps", str(args.steps)]
                cmd += ["--worker", engine, backend, out]
                env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
                done = subprocess.run(cmd, env=env, timeout=args.timeout, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(
                        f"engines.py: {engine} on {backend} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                        f"{done.stderr[-4000:]}\nengines.py: {engine} on {backend} failed"
                    )
                ranks = []
                for rank in range(args.nproc):
                    with open(os.path.join(out, f"{engine}-{backend}-{rank}.json")) as f:
                        ranks.append(json.load(f))
                runs[backend] = ranks
                r0 = ranks[0]
                print(
                    f"{engine:<11} {backend:<10} {args.nproc:>5} {len(r0['losses']):>6}  "
                    f"{r0['backend']:<18} {r0['losses'][-1]!r}"
                )
            problems += compare(engine, runs, args)
    if problems:
        print("\n".join(problems))
        sys.exit(f"engines.py: {len(problems)} differences between collsched and gloo")
    print(f"every rank's {2 * args.steps} losses equal on collsched and gloo (rtol {args.loss_rtol}) for: {engines}")


if __name__ == "__main__":
    main()
