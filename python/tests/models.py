"""The models the tests train, their data, and the plain-PyTorch reference they are compared
with. Nothing here uses collsched."""

from __future__ import annotations

import contextlib
import copy
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 37
SEQ = 6


class Mlp(nn.Module):
    """An MLP with odd sizes; ``blocks`` are its units."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(7, 13), nn.Linear(13, 11), nn.Linear(11, 9)])
        self.head = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(3 * dim, dim)
        # The MLP under activation checkpointing: None, or torch.utils.checkpoint's use_reentrant.
        self.recompute_mlp: bool | None = None

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(self.ln2(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        if self.recompute_mlp is None:
            return x + self.mlp(x)
        return x + torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=self.recompute_mlp)


class Gpt(nn.Module):
    """A small GPT: token and position embeddings, ``blocks``, a final layer norm, and a head
    tied to the token embedding."""

    def __init__(self, dim: int = 24, heads: int = 3, layers: int = 2, vocab: int = VOCAB, seq: int = SEQ) -> None:
        super().__init__()
        # The blocks' calls under activation checkpointing: None, or torch.utils.checkpoint's
        # use_reentrant.
        self.recompute: bool | None = None
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            if self.recompute is None:
                x = b(x)
            else:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=self.recompute)
        return self.head(self.ln(x))


# Where a gpt's activation checkpointing goes (``recompute``): around each block's call in the
# model's forward ("call"), in a ``checkpoint_wrapper`` around each block, as torchtitan applies
# it before sharding ("wrapper"), or around each block's MLP inside the block ("inner").
RECOMPUTE = ("call", "wrapper", "inner")


def build(
    name: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    recompute: tuple[str, bool] | None = None,
    tied: bool = False,
) -> nn.Module:
    """Model ``name`` with ``seed``'s values; ``recompute`` (a gpt's): ``(where, use_reentrant)``
    of its activation checkpointing (``RECOMPUTE``); ``tied`` (a gpt's): its second block's MLP
    input weight is the first block's (a parameter of two units)."""
    torch.manual_seed(seed)
    model = {"mlp": Mlp, "gpt": Gpt}[name]()
    if tied:
        model.blocks[1].fc.weight = model.blocks[0].fc.weight
    if recompute is not None:
        where, reentrant = recompute
        if where == "call":
            model.recompute = reentrant
        elif where == "inner":
            for b in model.blocks:
                b.recompute_mlp = reentrant
        else:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

            impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
            model.blocks = nn.ModuleList(checkpoint_wrapper(b, checkpoint_impl=impl) for b in model.blocks)
    return model.to(dtype)


def batch(name: str, seed: int, step: int, micro: int, rank: int, dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 10_007 + micro * 101 + rank)
    if name == "mlp":
        return torch.randn(4, 7, generator=g).to(dtype), torch.randn(4, 5, generator=g).to(dtype)
    idx = torch.randint(0, VOCAB, (3, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def autocast(spec: dict[str, Any], device: str = "cpu") -> Any:
    """The forward's mixed precision: ``torch.autocast`` to the spec's ``autocast`` dtype on
    ``device``'s type ("cpu" or "cuda"), or nothing."""
    dtype = spec.get("autocast")
    return torch.autocast(device, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def loss_fn(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "mlp":
        return ((out.float() - target.float()) ** 2).mean()
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))


def optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    if name == "adamw-tensor-lr":
        # A tensor learning rate (as schedulers under torch.compile keep it).
        return torch.optim.AdamW(params, lr=torch.tensor(1e-2), weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.05)


def reference(spec: dict[str, Any], world: int) -> dict[str, Any]:
    """Plain unsharded PyTorch on one model: every rank's micro-batches, gradients averaged
    over ranks as DDP and FSDP do (each rank's micro-batch gradients summed in order, in the
    reduction dtype, then the ranks' sums added in rank order and divided by the world), the
    same optimizer (after ``clip_grad_norm_`` with ``clip``). Returns the losses (by step,
    micro-batch, rank) and the parameters after every step (and, with ``eval_between``, every
    rank's evaluation losses; with ``clip``, every step's gradient norm). ``worlds`` gives
    each step's world, for a run that changes its world size at a checkpoint. ``ref_device``
    ("cuda"): the reference runs on the GPU (the sharded run's own kernels), parameters
    returned on the CPU."""
    # The ranks compute with one thread each; so does the reference (a kernel's summation
    # order can depend on its thread count).
    torch.set_num_threads(1)
    name, dtype = spec["model"], spec.get("dtype", torch.float32)
    # Mixed precision (``mp``, a MixedPrecisionPolicy's fields): each step computes on a copy
    # of the model in ``param_dtype`` (floating inputs cast to it), gradients reduced in
    # ``reduce_dtype`` (else ``dtype``, as torch 2.15's FSDP2) and applied to the model, its
    # master, in ``dtype``.
    mp = spec.get("mp") or {}
    pdtype = mp.get("param_dtype")
    rdtype = spec.get("reduce_dtype") or mp.get("reduce_dtype") or dtype
    # Activation checkpointing (``recompute``) changes what is kept, not what is computed: the
    # reference runs without it.
    device = torch.device(spec.get("ref_device", "cpu"))
    model = build(name, spec.get("seed", 0), dtype, tied=spec.get("tied", False)).to(device)
    params = dict(model.named_parameters())
    opt = optimizer(spec.get("opt", "adamw"), model.parameters())
    losses, after, evals, norms = [], [], [[] for _ in range(world)], []
    worlds = spec.get("worlds", [world] * spec["steps"])
    for step in range(spec["steps"]):
        world = worlds[step]
        frozen = spec.get("frozen", {}).get(step, [])
        for n, p in params.items():
            p.requires_grad_(not any(n.startswith(f) for f in frozen))
        live = {n: p for n, p in params.items() if p.requires_grad}
        compute = model if pdtype is None else copy.deepcopy(model).to(pdtype)
        cparams = dict(compute.named_parameters())
        acc = [dict.fromkeys(live) for _ in range(world)]
        step_losses = []
        for micro in range(spec.get("micro", 1)):
            row = []
            for r in range(world):
                x, y = batch(name, spec.get("seed", 0), step, micro, r, dtype)
                x, y = x.to(device), y.to(device)
                if pdtype is not None and x.is_floating_point():
                    x = x.to(pdtype)
                with autocast(spec, device.type):
                    out = compute(x)
                loss = loss_fn(name, out, y)
                grads = torch.autograd.grad(loss, [cparams[n] for n in live], allow_unused=True)
                for n, g in zip(live, grads):
                    g = torch.zeros_like(live[n]) if g is None else g
                    g = g.to(rdtype)
                    acc[r][n] = g if acc[r][n] is None else acc[r][n] + g
                row.append(loss.item())
            step_losses.append(row)
            if spec.get("eval_between") and micro + 1 < spec.get("micro", 1):
                with torch.no_grad():
                    for r in range(world):
                        ex, ey = batch(name, 99, step, 0, r, dtype)
                        ex, ey = ex.to(device), ey.to(device)
                        ex = ex.to(pdtype) if pdtype is not None and ex.is_floating_point() else ex
                        evals[r].append(loss_fn(name, compute(ex), ey).item())
        # Hybrid sharding (HSDP) reduces in two stages: within each group of G consecutive
        # ranks, then the group sums across groups.
        strategy = spec.get("strategies", [spec.get("strategy", "even")] * spec["steps"])[step]
        group = int(strategy.split(":")[1]) if strategy.startswith("hybrid:") else world
        for n, p in live.items():
            total = None
            for first in range(0, world, group):
                part = acc[first][n]
                for r in range(first + 1, first + group):
                    part = part + acc[r][n]
                total = part if total is None else total + part
            # ``divide``: FSDP2's gradient divide factor, set on the blocks (the root keeps the mean).
            # ``divide_on="root"``: the root's own parameters instead.
            on_blocks = spec.get("divide_on", "blocks") == "blocks"
            factor = spec["divide"] if "divide" in spec and n.startswith("blocks.") == on_blocks else world
            p.grad = (total / factor).to(dtype)
        if spec.get("clip"):
            kind = spec.get("clip_norm", 2.0)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"], kind)))
        opt.step()
        opt.zero_grad()
        losses.append(step_losses)
        after.append({n: p.detach().cpu().clone() for n, p in params.items()})
    return {"losses": losses, "params": after, "evals": evals, "norms": norms}


class Reused(nn.Module):
    """Modules run more than once a step: ``inp``, then ``block`` twice (one unit called twice
    in the forward), returning hidden states; the caller applies ``head`` after the forward,
    chunk by chunk (a chunked loss)."""

    def __init__(self, dim: int = 8, out: int = 5) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.block = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.block(torch.tanh(self.inp(x)))))


def reused_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int = 3) -> torch.Tensor:
    """A step's loss on :class:`Reused`: the forward, then the head on each of ``chunks`` row
    chunks of its output, the chunks' squared errors summed."""
    h = model(x)
    return sum(((model.head(c) - t) ** 2).sum() for c, t in zip(h.chunk(chunks), y.chunk(chunks)))


def reused_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(6, 8, generator=g), torch.randn(6, 5, generator=g)
