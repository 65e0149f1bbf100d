"""Train a small GPT-like model sharded with collsched, one process per rank:

    torchrun --nproc-per-node 2 python/examples/train.py [--steps 20 --micro 2] [--backend cuda]

Each block is a unit (its parameters are gathered together), the model is the root; AdamW
runs on each rank's shards; all micro-batches but the last accumulate under ``no_sync``;
an evaluation pass under ``torch.no_grad()`` runs every few steps. Rank 0 prints the loss
and collsched's counters of the last step. ``--backend cuda`` trains on one GPU per process.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch import nn
from torch.nn import functional as F

import collsched.torch as cst


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).triu(1)
        x = self.embed(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x, mask)
        return self.out(self.norm(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--strategy", default="even", help="even, flat, greedy or hybrid:G")
    p.add_argument("--backend", default="shm", help="shm (CPU tensors) or cuda (one GPU per process)")
    p.add_argument("--eval-every", type=int, default=5, help="steps between evaluation passes (0: none)")
    p.add_argument(
        "--flight-out",
        metavar="DIR",
        help="at the end, each rank's flight record (collectives, and on the CPU each unit's compute) into DIR "
        "and the workload (each span's time the largest over the ranks) as DIR/workload.json, for `collsched "
        "flight DIR --trace-out` and `collsched sim --workload DIR/workload.json --tflops 1 --against`",
    )
    args = p.parse_args()

    hybrid = {"hybrid_group_size": int(args.strategy[7:])} if args.strategy.startswith("hybrid:") else {}
    world = cst.init(args.backend, **(hybrid if args.backend == "cuda" else {}))  # reads torchrun's environment
    device = torch.device("cuda", torch.cuda.current_device()) if args.backend == "cuda" else torch.device("cpu")
    torch.manual_seed(0)  # the same initial values on every rank
    model = Model(args.vocab, args.dim, 4, args.layers, args.seq).to(device)
    for block in model.blocks:
        cst.fully_shard(block)
    cst.fully_shard(model, strategy=args.strategy)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A learnable toy task: each sequence counts up from a random start.
        g = torch.Generator().manual_seed(step * 1000 + micro * 10 + world.rank)
        start = torch.randint(0, args.vocab, (8, 1), generator=g)
        seq = (start + torch.arange(args.seq + 1)) % args.vocab
        return seq[:, :-1].to(device), seq[:, 1:].to(device)

    for step in range(args.steps):
        for micro in range(args.micro):
            x, y = batch(step, micro)
            last = micro + 1 == args.micro
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1))
                loss.backward()
        opt.step()
        opt.zero_grad()
        if args.eval_every > 0 and (step % args.eval_every == args.eval_every - 1 or step + 1 == args.steps):
            with torch.no_grad():
                x, y = batch(10**6 + step, 0)
                val = F.cross_entropy(model(x).reshape(-1, args.vocab), y.reshape(-1)).item()
            if world.rank == 0:
                print(f"step {step + 1:3}: train loss {loss.item():.4f}, validation loss {val:.4f}", flush=True)
        elif args.eval_every == 0 and world.rank == 0 and step + 1 == args.steps:
            print(f"step {step + 1:3}: train loss {loss.item():.4f}", flush=True)
    if args.flight_out:
        cst.flight_record(args.flight_out)
        if args.backend != "cuda":
            # Collective (each span's time the largest over the ranks); written by rank 0.
            cst.workload_record(model, f"{args.flight_out}/workload.json" if world.rank == 0 else None)
    if world.rank == 0:
        s = cst.stats(model)
        print(
            f"last step on rank 0: {s['all_gathers']} all-gathers ({s['gathered_bytes'] / 2**20:.1f} MiB), "
            f"{s['reduce_scatters']} reduce-scatters ({s['reduced_bytes'] / 2**20:.1f} MiB), prefetch hits "
            f"{s['prefetch_hits']} misses {s['prefetch_misses']}, waited {s['wait_ms']:.1f} ms, peak gathered "
            f"{s['peak_gathered_bytes'] / 2**20:.1f} MiB"
        )


if __name__ == "__main__":
    main()
