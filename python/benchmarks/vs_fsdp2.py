"""collsched.torch.fully_shard against PyTorch FSDP2 (fully_shard on gloo), in one run.

    torchrun --nproc-per-node 2 python/benchmarks/vs_fsdp2.py [--dim 512 --blocks 8 ...]
    torchrun --nproc-per-node G python/benchmarks/vs_fsdp2.py --device cuda   # one GPU a rank

Both train the same GPT-like model (by default about 25M parameters, 8 blocks) from the same
initial values on the same data for the same steps (AdamW), each block a unit and the model
the root; each implementation runs in processes of its own that every torchrun rank starts
(a gloo group on a file store). Printed per implementation: median step time (the slowest
rank's); peak RSS per rank (VmHWM of its process: shared pages count whole in every process
that touched them) and PSS at the end of the run (shared pages shared out); bytes
all-gathered and reduce-scattered per step (full-size buffers: collsched's counters; FSDP2's
collectives counted by wrapping torch.distributed's); the host time of the hooks per unit
(median of the timed steps: collsched's ``host_us_per_unit``, and FSDP2's hooks timed the same
way, see ``Fsdp2HookTime``); collsched's peak gathered bytes; every step's loss; the ratios. A third run
trains the model unsharded with no communication at all (each rank alone): its forward and
backward time plus its optimizer time divided by the ranks is the floor under any sharded
step on this machine, printed beside the two. With ``--ac`` every block of all three runs is
under activation checkpointing (``checkpoint_wrapper``, wrapped before sharding). With
``--offload`` FSDP2 and collsched both shard under ``CPUOffloadPolicy()`` (shards, gradients and
the AdamW step in pinned host memory where CUDA is), the unsharded floor as before.

With ``--device cuda`` (rank r on GPU ``LOCAL_RANK``): FSDP2 on NCCL, collsched on its cuda
backend (NCCL on its own streams, ``init(backend="cuda")``), the model, batches and optimizer
on the GPU, every timed region closed by ``torch.cuda.synchronize()``; memory is the GPU's:
torch's peak allocated bytes and the device's used bytes at the end (``mem_get_info``, which
counts collsched's own pool, outside torch's allocator).

Every rank's losses of every step are compared between FSDP2 and collsched: a NaN, a missing
step or a difference beyond ``--loss-rtol`` (relative) on any rank fails the run (exit 1),
after the report says which.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from exchange import all_gather_json, from_rank0  # noqa: E402


class Gpt(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, blocks: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(blocks)
        )
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for b in self.blocks:
            x = b(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.ln(x))


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pss_mib() -> float:
    """Proportional set size now: shared pages (collsched's buffers, which every rank maps and
    touches) count a share per process instead of whole in each, as RSS counts them."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class CommCounter:
    """Counts the bytes of FSDP2's all-gathers and reduce-scatters (full-size side)."""

    def __init__(self) -> None:
        self.gathered = 0
        self.reduced = 0
        # FSDP2 calls all_gather_single / reduce_scatter_single (torch 2.15) or
        # all_gather_into_tensor / reduce_scatter_tensor (earlier): each name torch has is
        # wrapped, and a call made inside another wrapped one is not counted again.
        self.depth = 0
        for name in ("all_gather_single", "all_gather_into_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), gather=True))
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(getattr(dist, name), gather=False))

    def _wrap(self, fn: Any, gather: bool) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            if self.depth == 0:
                if gather:
                    out = k.get("output_tensor", a[0] if a else None)
                    self.gathered += out.numel() * out.element_size()
                else:
                    inp = k.get("input", k.get("input_tensor", a[1] if len(a) > 1 else None))
                    self.reduced += inp.numel() * inp.element_size()
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1

        return counted


class Fsdp2HookTime:
    """FSDP2's host time per unit, by collsched's measure (``host_us_per_unit``): wall time in
    its hooks (pre- and post-forward, pre- and post-backward, the final callback) minus the time
    in its collective functions (``unshard`` and ``wait_for_unshard``: the all-gather, its wait
    and its copies in and out; ``reshard``: freeing the gathered parameters; ``foreach_reduce``:
    the reduce-scatter and its copies; waits on a ``Work``), what collsched does in calls into
    the library; per unit forward. Wraps the
    methods of torch's FSDP2 (torch 2.15's ``_fully_shard`` modules) before ``fully_shard``
    registers them; ``ok`` is False where they are not found."""

    def __init__(self) -> None:
        self.hook_s = 0.0
        self.excluded_s = 0.0
        self.units = 0
        self.depth = 0
        # Inside an excluded call (the calls it makes are excluded with it).
        self.inside = False
        self.ok = False
        try:
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
            from torch.distributed.fsdp._fully_shard import _fsdp_state as st
        except ImportError:
            return
        hooks = [
            (st.FSDPState, "_pre_forward"),
            (st.FSDPState, "_post_forward"),
            (st.FSDPState, "_pre_backward"),
            (st.FSDPState, "_root_post_backward_final_callback"),
            (pg.FSDPParamGroup, "post_backward"),
        ]
        library = [
            (pg.FSDPParamGroup, "unshard"),
            (pg.FSDPParamGroup, "wait_for_unshard"),
            (pg.FSDPParamGroup, "reshard"),
            (pg, "foreach_reduce"),
            (dist.Work, "wait"),
        ]
        if not all(hasattr(owner, name) for owner, name in hooks + library):
            return
        for owner, name in hooks:
            setattr(owner, name, self._hook(getattr(owner, name), count=name == "_pre_forward"))
        for owner, name in library:
            setattr(owner, name, self._library(getattr(owner, name)))
        self.ok = True

    def _hook(self, f: Callable[..., Any], count: bool) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if count:
                self.units += 1
            if self.depth:
                return f(*a, **k)
            self.depth += 1
            excluded, t0 = self.excluded_s, time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self.hook_s += time.perf_counter() - t0 - (self.excluded_s - excluded)
                self.depth -= 1

        return timed

    def _library(self, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **k: Any) -> Any:
            if not self.depth or self.inside:
                return f(*a, **k)
            t0 = time.perf_counter()
            self.inside = True
            try:
                return f(*a, **k)
            finally:
                self.inside = False
                self.excluded_s += time.perf_counter() - t0

        return timed

    def take_us_per_unit(self) -> float:
        """The host time per unit since the last call."""
        out = 1e6 * self.hook_s / max(self.units, 1)
        self.hook_s = self.excluded_s = 0.0
        self.units = 0
        return out


def build(args: argparse.Namespace) -> Gpt:
    """The model from ``args.seed``; with ``--ac`` each block in a ``checkpoint_wrapper``
    (activation checkpointing, not reentrant), applied before sharding as torchtitan does. Made
    on the rank's device (a large model's initialization on the GPU takes no host time), with the
    same values in every run (the same seed on the same device)."""
    torch.manual_seed(args.seed)
    with device(args):
        model = Gpt(args.vocab, args.dim, args.heads, args.blocks, args.seq)
    if args.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in model.blocks)
    return model


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device(args))
    return idx[:, :-1], idx[:, 1:]


def device(args: argparse.Namespace) -> torch.device:
    """This rank's device: the CPU, or GPU ``LOCAL_RANK`` with ``--device cuda``."""
    if getattr(args, "device", "cpu") == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def sync(args: argparse.Namespace) -> None:
    """Waits for the GPU's queued work (a timed region ends when the device is done)."""
    if getattr(args, "device", "cpu") == "cuda":
        torch.cuda.synchronize()


def train(
    args: argparse.Namespace,
    model: nn.Module,
    rank: int,
    probe: Callable[[], float] | None = None,
    autocast: bool = False,
    snapshot: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Trains ``args.warmup + args.steps`` steps; medians over the timed ones (and of
    ``probe()``, called after every step, as ``probe``, when given). ``autocast``: the forward
    under ``torch.autocast`` to bf16 (the floor's mixed precision). ``snapshot()``, when given,
    is called after the last timed step, before any traced or profiled one, as ``snapshot``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, passes, opts, losses, probed = [], [], [], [], []
    phases: list[float] = []
    before = 0.0
    on_gpu = getattr(args, "device", "cpu") == "cuda"
    for step in range(args.warmup + args.steps):
        x, y = batch(args, step, rank)
        sync(args)
        dist.barrier()
        # The last step's peak allocated memory by phase (torch's allocator; on a GPU).
        last = on_gpu and step == args.warmup + args.steps - 1
        if last:
            before = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast(device(args).type, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = nn.functional.cross_entropy(out.reshape(-1, args.vocab), y.reshape(-1))
        if last:
            phases.append(torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync(args)
        t1 = time.perf_counter()
        if last:
            phases.append(torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad()
        sync(args)
        t2 = time.perf_counter()
        if last:
            phases.append(torch.cuda.max_memory_allocated() / 2**20)
        probed_now = probe() if probe is not None else None
        if step >= args.warmup:
            times.append(t2 - t0)
            passes.append(t1 - t0)
            opts.append(t2 - t1)
            if probed_now is not None:
                probed.append(probed_now)
        losses.append(loss.item())
    after = {} if snapshot is None else {"snapshot": snapshot()}
    if getattr(args, "trace", None) and getattr(args, "impl", None) in ("collsched", "fsdp2"):
        trace_step(args, model, opt, rank, autocast)
    if getattr(args, "pyprofile", 0) and getattr(args, "impl", None) in ("collsched", "fsdp2"):
        profile_steps(args, model, opt, rank, autocast)
    return {
        "median_s": statistics.median(times),
        "passes_s": statistics.median(passes),
        "opt_s": statistics.median(opts),
        "losses": losses,
        "phase_peaks": phases,
        "peak_before_last": before,
        **({"probe": statistics.median(probed)} if probed else {}),
        **after,
    }


def one_step(
    args: argparse.Namespace,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    x: Any,
    y: Any,
    autocast: bool,
    wait: bool = True,
) -> None:
    """One untimed training step on ``x``, ``y`` (forward, loss, backward, optimizer), waited
    for (``wait``)."""
    with torch.autocast(device(args).type, dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    loss = nn.functional.cross_entropy(out.reshape(-1, args.vocab), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    if wait:
        sync(args)


def sync_sites(
    args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, rank: int, autocast: bool
) -> list[str]:
    """On a GPU, one more untimed step under ``torch.cuda.set_sync_debug_mode("warn")``: the
    Python lines where the step's host waited for the device in a torch call (a copy to the
    host, ``item()``, ...), most first, as ``N file:line``; the library's own waits are its
    ``wait_ms``, not these."""
    import warnings

    x, y = batch(args, args.warmup + args.steps + 4, rank)
    sync(args)
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            one_step(args, model, opt, x, y, autocast, wait=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(args)
    sites: dict[str, int] = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{os.path.basename(w.filename)}:{w.lineno}"
            sites[where] = sites.get(where, 0) + 1
    return [f"{n} {where}" for where, n in sorted(sites.items(), key=lambda kv: -kv[1])]


def profile_steps(
    args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, rank: int, autocast: bool
) -> None:
    """Three more steps, untimed, under ``cProfile`` (the host's Python functions and the C calls
    they make, each with its own time): rank 0 prints the ``args.pyprofile`` functions with the
    most time of their own, then as many by time with what they call, to stderr."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for step in range(3):
        x, y = batch(args, args.warmup + args.steps + 1 + step, rank)
        sync(args)
        dist.barrier()
        prof.enable()
        one_step(args, model, opt, x, y, autocast)
        prof.disable()
    sites = sync_sites(args, model, opt, rank, autocast) if device(args).type == "cuda" else None
    if rank == 0:
        if sites is not None:
            total = sum(int(s.split()[0]) for s in sites)
            print(f"pyprofile {args.impl}: host syncs in torch calls in one step: {total}", file=sys.stderr)
            for s in sites[:12]:
                print(f"pyprofile {args.impl}:   {s}", file=sys.stderr)
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text).strip_dirs()
        stats.sort_stats("tottime").print_stats(args.pyprofile)
        stats.sort_stats("cumulative").print_stats(args.pyprofile)
        for line in text.getvalue().splitlines():
            print(f"pyprofile {args.impl}: {line}", file=sys.stderr, flush=True)


def trace_step(
    args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer, rank: int, autocast: bool
) -> None:
    """One more step, untimed, under ``torch.profiler`` (the host's calls and, on a GPU, every
    kernel and copy on every stream, the library's own included), written as a Chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    x, y = batch(args, args.warmup + args.steps, rank)
    sync(args)
    with profile(activities=activities) as prof:
        one_step(args, model, opt, x, y, autocast)
    os.makedirs(args.trace, exist_ok=True)
    path = os.path.join(args.trace, f"{args.impl}-rank{rank}.json")
    prof.export_chrome_trace(path)
    print(f"trace: {path}", file=sys.stderr, flush=True)


def run_collsched(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    import collsched.torch as cst

    cst.init(args.device if args.device == "cuda" else "shm")
    model = build(args).to(device(args))
    mp = (
        {"mp_policy": cst.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if args.mp
        else {}
    )
    if args.offload:
        mp["offload_policy"] = cst.CPUOffloadPolicy()
    for b in model.blocks:
        cst.fully_shard(b, **mp)
    cst.fully_shard(
        model,
        **mp,
        strategy=args.strategy,
        bucket_mb=args.bucket_mb,
        prefetch_mb=args.prefetch_mb,
        max_inflight=args.max_inflight,
    )

    def probe() -> float:
        return cst.stats(model)["host_us_per_unit"]

    # The host time of one step swings 2x with the machine's noise: the median of the steps;
    # the library's counters of the last timed step (not of a traced or profiled one after it).
    out = train(args, model, rank, probe=probe, snapshot=lambda: cst.stats(model))
    st = out.pop("snapshot")
    out.update(
        gathered=st["gathered_bytes"],
        reduced=st["reduced_bytes"],
        host_us=out.pop("probe"),
        hits=st["prefetch_hits"],
        misses=st["prefetch_misses"],
        peak_gathered=st["peak_gathered_bytes"],
        native_us=st.get("native_us_per_unit"),
        wait_ms=st.get("wait_ms"),
        views=st.get("views_made"),
        # The library's device pool at the end (cuda; {} on host memory).
        pool=cst.memory_stats(),
    )
    return out


def run_plain(args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """The model unsharded and alone on each rank: no hooks, no collectives."""
    model = build(args).to(device(args))
    return train(args, model, rank, autocast=bool(args.mp))


def run_fsdp2(args: argparse.Namespace, rank: int, counter: CommCounter) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    hooks = Fsdp2HookTime()
    model = build(args).to(device(args))
    mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if args.mp else {}
    if args.offload:
        # Pinned pages need CUDA (FSDP2's default pins).
        mp["offload_policy"] = CPUOffloadPolicy(pin_memory=args.device == "cuda")
    for b in model.blocks:
        fully_shard(b, **mp)
    fully_shard(model, **mp)
    if args.device == "cpu":
        # gloo's AVG reduce-scatter can silently sum (pytorch#162338): reduce with SUM, divide after.
        model.set_force_sum_reduction_for_comms(True)
    g0, r0 = counter.gathered, counter.reduced
    # The bytes of the trained steps (not of a traced or profiled one after them).
    probe = hooks.take_us_per_unit if hooks.ok else None
    out = train(args, model, rank, probe=probe, snapshot=lambda: {"g": counter.gathered, "r": counter.reduced})
    total, moved = args.warmup + args.steps, out.pop("snapshot")
    out.update(gathered=(moved["g"] - g0) // total, reduced=(moved["r"] - r0) // total)
    out["host_us"] = out.pop("probe", None)
    return out


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--strategy", default="even", help="collsched's sharding strategy")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="collsched's bucket cap")
    p.add_argument("--prefetch-mb", type=float, default=None, help="collsched's prefetch budget")
    p.add_argument("--max-inflight", type=int, default=None, help="collsched's buckets ahead")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ac", action="store_true", help="activation checkpointing of every block, in all three runs")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    p.add_argument(
        "--mp",
        choices=["bf16"],
        default=None,
        help="mixed precision: bf16 parameters in forward and backward, gradients reduced in f32 "
        "(MixedPrecisionPolicy(bf16, f32), the same for FSDP2 and collsched); the floor runs under "
        "torch.autocast(bf16)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="CPUOffloadPolicy() for FSDP2 and collsched (each its own class): shards, gradients and the "
        "optimizer step in host memory; the floor stays on the device",
    )
    p.add_argument(
        "--loss-rtol", type=float, default=1e-5, help="largest relative loss difference FSDP2/collsched that passes"
    )
    p.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="after the timed steps, one more step of FSDP2 and of collsched under torch.profiler (CPU and "
        "CUDA activity), written as Chrome traces DIR/fsdp2-rankR.json and DIR/collsched-rankR.json "
        "(python/benchmarks/trace_svg.py draws one)",
    )
    p.add_argument(
        "--pyprofile",
        metavar="N",
        type=int,
        default=0,
        help="after the timed steps, three more steps of FSDP2 and of collsched under cProfile; rank 0 prints "
        "the N functions with the most time of their own and the N with the most time in all, per "
        "implementation (lines starting 'pyprofile IMPL:', on stderr); on a GPU, then one step under "
        "torch.cuda.set_sync_debug_mode('warn'), the lines where the host waited for the device",
    )
    p.add_argument("--impl", choices=["collsched", "fsdp2", "plain"], help=argparse.SUPPRESS)
    return p.parse_args()


def child(args: argparse.Namespace) -> None:
    """One implementation on this rank, in a process of its own (its peak RSS is its own)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = os.environ["COLLSCHED_BENCH_STORE"]
    if args.device == "cuda":
        torch.cuda.set_device(device(args))
    # FSDP2 on a GPU runs on NCCL; the CPU runs and every barrier on gloo.
    backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    if args.impl == "collsched":
        out = run_collsched(args, rank)
    elif args.impl == "plain":
        out = run_plain(args, rank)
    else:
        out = run_fsdp2(args, rank, CommCounter())
    out["rss"] = peak_rss_mib()
    out["pss"] = pss_mib()
    if args.device == "cuda":
        free, total = torch.cuda.mem_get_info()
        # The whole run's peak: the phases of the last step reset torch's counter.
        out["gpu_peak_torch"] = max(
            torch.cuda.max_memory_allocated() / 2**20, out["peak_before_last"], *out["phase_peaks"]
        )
        out["gpu_used_end"] = (total - free) / 2**20
        out["gpu_reserved_end"] = torch.cuda.memory_reserved() / 2**20
    dist.barrier()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    args = parse()
    if args.impl:
        child(args)
        return
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tmp = from_rank0(tempfile.mkdtemp(prefix="collsched-bench-") if rank == 0 else None)
    slowest = ("median_s", "passes_s", "opt_s")
    results: dict[str, dict[str, Any]] = {}
    try:
        for name in ("fsdp2", "collsched", "plain"):
            env = dict(os.environ, COLLSCHED_BENCH_STORE=os.path.join(tmp, name))
            proc = subprocess.run(
                [sys.executable, __file__, *sys.argv[1:], "--impl", name], env=env, capture_output=True, text=True
            )
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            # The child's profile (--pyprofile), passed on.
            for x in proc.stderr.splitlines():
                if x.startswith("pyprofile "):
                    print(x, file=sys.stderr, flush=True)
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"rank {rank}: the {name} run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            mine = json.loads(lines[-1][len("RESULT ") :])
            every = all_gather_json(mine)
            results[name] = {
                **{k: v for k, v in every[0].items() if k not in (*slowest, "rss", "pss")},
                **{k: max(r[k] for r in every) for k in slowest},
                "rss_all": [r["rss"] for r in every],
                "pss_all": [r["pss"] for r in every],
                "losses_all": [r["losses"] for r in every],
                "pool_all": [r.get("pool") or {} for r in every],
                "gpu_all": [
                    (r["gpu_peak_torch"], r["gpu_used_end"], r["gpu_reserved_end"], r["phase_peaks"])
                    for r in every
                    if "gpu_used_end" in r
                ],
            }
    finally:
        # The file stores of the runs, on success or failure.
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    problems = compare_losses(
        "FSDP2", results["fsdp2"]["losses_all"], "collsched", results["collsched"]["losses_all"], args.loss_rtol
    )
    if rank == 0:
        report(args, world, results)
        for p in problems:
            print(f"LOSS MISMATCH: {p}")
    dist.destroy_process_group()
    if problems:
        raise SystemExit(1)


def compare_losses(a_name: str, a: list[list[float]], b_name: str, b: list[list[float]], rtol: float) -> list[str]:
    """What differs between two runs' losses (``a``, ``b``: every rank's, every step's): a
    NaN or infinity, a missing or extra step or rank, a relative difference beyond ``rtol``."""
    out = []
    if len(a) != len(b) or not a:
        return [f"{len(a)} ranks reported {a_name} losses, {len(b)} {b_name}'s"]
    for rank, (ra, rb) in enumerate(zip(a, b)):
        if len(ra) != len(rb) or not ra:
            out.append(f"rank {rank}: {len(ra)} {a_name} steps, {len(rb)} {b_name} steps")
        for step, (x, y) in enumerate(zip(ra, rb)):
            if not (math.isfinite(x) and math.isfinite(y)):
                out.append(f"rank {rank} step {step}: loss {a_name} {x}, {b_name} {y}")
            elif abs(x - y) > rtol * abs(x):
                out.append(f"rank {rank} step {step}: loss {a_name} {x!r}, {b_name} {y!r} (beyond rtol {rtol})")
    return out


def report(args: argparse.Namespace, world: int, results: dict[str, dict[str, Any]]) -> None:
    with torch.device("meta"):
        n = sum(p.numel() for p in Gpt(args.vocab, args.dim, args.heads, args.blocks, args.seq).parameters())
    print(
        f"model: {n / 1e6:.1f}M parameters, {args.blocks} blocks, dim {args.dim}; {world} ranks; "
        f"batch {args.batch}x{args.seq}; {args.steps} timed steps after {args.warmup}; "
        f"{'activation checkpointing of every block; ' if args.ac else ''}"
        f"{'bf16 parameters, f32 reduction (MixedPrecisionPolicy); ' if args.mp else 'f32; '}"
        f"{'CPUOffloadPolicy(); ' if args.offload else ''}"
        f"device {args.device}{' ' + torch.cuda.get_device_name() if args.device == 'cuda' else ''}; "
        f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
        "each implementation in processes of its own"
    )
    for name in ("fsdp2", "collsched"):
        r = results[name]
        host = "n/a" if r.get("host_us") is None else f"{r['host_us']:.0f}"
        extra = f"  host {host} us/unit" + (
            f" (and in the library {r['native_us']:.0f} us/unit, host waits {r['wait_ms']:.2f} ms, "
            f"views made {r['views']}: the last step), "
            f"prefetch hits {r['hits']} misses {r['misses']}, peak gathered {r['peak_gathered'] / 2**20:.1f} MiB"
            if name == "collsched"
            else ""
        )
        rss = " ".join(f"{x:.0f}" for x in r["rss_all"])
        pss = " ".join(f"{x:.0f}" for x in r["pss_all"])
        print(
            f"{name:10} median step {r['median_s'] * 1e3:8.1f} ms  peak RSS/rank MiB [{rss}]  "
            f"PSS at the end/rank MiB [{pss}]  "
            f"all-gathered {r['gathered'] / 2**20:7.1f} MiB/step  reduce-scattered "
            f"{r['reduced'] / 2**20:7.1f} MiB/step{extra}"
        )
    for name in ("fsdp2", "collsched"):
        print(f"{name:10} losses (rank 0) " + " ".join(f"{x:.5f}" for x in results[name]["losses"]))
    for name in ("fsdp2", "collsched", "plain"):
        for i, (peak, used, reserved, phases) in enumerate(results[name]["gpu_all"]):
            print(
                f"{name:10} rank {i} GPU: torch's peak allocated {peak:.0f} MiB (the last step's forward, "
                f"backward, optimizer: {' / '.join(f'{x:.0f}' for x in phases)}); at the end torch reserves "
                f"{reserved:.0f} MiB, the device has {used:.0f} MiB in use ({used - reserved:.0f} outside torch's "
                "allocator: the CUDA context, NCCL's and collsched's buffers)"
            )
    for i, pool in enumerate(results["collsched"]["pool_all"]):
        if pool:
            mib = {k: v / 2**20 for k, v in pool.items() if k.endswith("_bytes")}
            print(
                f"collsched  rank {i} pool at the end: reserved {mib['reserved_bytes']:.0f} MiB = in use "
                f"{mib['in_use_bytes']:.0f} + deferred {mib['deferred_bytes']:.0f} + free {mib['free_bytes']:.0f}; "
                f"{pool['fresh_allocations']} blocks allocated"
            )
    pairs = [
        (a, b)
        for fr, cr in zip(results["fsdp2"]["losses_all"], results["collsched"]["losses_all"])
        for a, b in zip(fr, cr)
    ]
    diff = max((abs(a - b) for a, b in pairs), default=float("nan"))
    print(f"losses compared: {len(pairs)} (every rank's every step), largest difference {diff:.2e}")
    c, f, p = results["collsched"], results["fsdp2"], results["plain"]
    floor = p["passes_s"] + p["opt_s"] / world
    print(
        f"floor      forward+backward {p['passes_s'] * 1e3:.1f} ms + optimizer {p['opt_s'] * 1e3:.1f} ms / {world} "
        f"ranks = {floor * 1e3:.1f} ms  (the model unsharded on each rank, nothing communicated)"
    )
    print(
        f"ratio collsched/fsdp2: step time {c['median_s'] / f['median_s']:.2f}x, "
        f"peak RSS {max(c['rss_all']) / max(f['rss_all']):.2f}x; largest loss difference {diff:.2e}; "
        f"floor/fsdp2 {floor / f['median_s']:.2f}x, collsched/floor {c['median_s'] / floor:.2f}x"
    )


if __name__ == "__main__":
    main()
