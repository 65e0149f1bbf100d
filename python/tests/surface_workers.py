"""What each rank runs in ``test_surface.py`` (importable by the processes the tests start):
``fully_shard``'s prefetch knobs, ``world()``, ``clip_grad_norm_``'s options, checkpoints
without an optimizer, and the ``"collsched"`` process group's allocation, coalesced forms and
PREMUL_SUM. Every value goes back as plain Python values."""

from __future__ import annotations

from typing import Any

import torch

import models
import workers

FSDP_KEYS = ("strategy", "bucket_mb", "prefetch", "prefetch_mb", "max_inflight", "reduce_dtype")


def error_text(fn: Any) -> str:
    """``fn()``'s exception as ``module.Class: message``, or ``"no error"``."""
    try:
        fn()
    except Exception as e:  # the message is what the tests check
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return "no error"


def shard_with(model: torch.nn.Module, knobs: dict[str, Any]) -> torch.nn.Module:
    """``model``'s blocks, then the model, sharded with ``knobs`` (``fully_shard``'s arguments)."""
    import collsched.torch as cst

    cst.init()
    opts = {k: knobs[k] for k in FSDP_KEYS if k in knobs}
    for b in model.blocks:
        cst.fully_shard(b, **opts)
    return cst.fully_shard(model, **opts)


def train_each(rank: int, world: int, spec: dict[str, Any], knobsets: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each knob set (the spec's keys overridden by it): the spec's model from the same
    values, sharded with those knobs and trained as the reference trains it (one micro-batch a
    step); its losses, full parameters after every step, every step's counters and its plan."""
    import collsched.torch as cst

    out = []
    for knobs in knobsets:
        s = {**spec, **knobs}
        name, dtype = s["model"], s.get("dtype", torch.float32)
        model = shard_with(models.build(name, s.get("seed", 0), dtype), s)
        opt = models.optimizer(s.get("opt", "adamw"), model.parameters())
        losses, after, stats = [], [], []
        for step in range(s["steps"]):
            x, y = models.batch(name, s.get("seed", 0), step, 0, rank, dtype)
            loss = models.loss_fn(name, model(x), y)
            loss.backward()
            stats.append(cst.stats(model))
            opt.step()
            opt.zero_grad()
            losses.append([loss.item()])
            after.append(workers.snapshot(cst.full_parameters(model)))
        out.append({"losses": losses, "params": after, "stats": stats, "plan": cst.plan(model)})
    return out


def world_then_init(rank: int, world: int, backend: str | None) -> dict[str, Any]:
    """``world()`` before ``init()`` (its error), ``init(backend)`` (``None``: not called, a
    ``"collsched"`` process group made the world), then ``world()`` and a second ``init()``."""
    import collsched.torch as cst

    out: dict[str, Any] = {"before": error_text(cst.world)}
    joined = cst.init(backend) if backend is not None else None
    w = cst.world()
    out["after"] = (w.rank, w.world, w.kind)
    out["init_returns_world"] = joined is None or joined is w
    out["again_same"] = cst.init(backend or "shm") is w
    return out


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _put_grads(model: torch.nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """``grads`` (by name) as the shards' gradients; a shard of no element keeps none."""
    for n, p in model.named_parameters():
        p.grad = grads[n].clone() if n in grads else None


def clip_cases(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One backward of the spec's model on this rank's batch, then ``clip_grad_norm_`` by name
    from those same gradients: at each norm type (the norm returned and the clipped shards'
    gradients), and with a NaN or an infinity put into the last rank's first element of
    ``spec["poison"]`` with and without ``error_if_nonfinite`` (the error, or the norm and the
    gradients; and whether the gradients were left as they were after the error)."""
    import collsched.torch as cst

    name = spec["model"]
    model = shard_with(models.build(name), spec)
    x, y = models.batch(name, 0, 0, 0, rank)
    models.loss_fn(name, model(x), y).backward()
    clean = _grads(model)
    out: dict[str, Any] = {"plan": cst.plan(model), "norms": {}, "clipped": {}, "nonfinite": {}}
    for kind in spec["norm_types"]:
        _put_grads(model, clean)
        norm = cst.clip_grad_norm_(model.parameters(), spec["max_norm"], norm_type=kind)
        out["norms"][str(kind)] = (float(norm), str(norm.dtype), list(norm.shape))
        out["clipped"][str(kind)] = {n: g.tolist() for n, g in _grads(model).items()}
    for bad in (float("nan"), float("inf")):
        poisoned = {n: g.clone() for n, g in clean.items()}
        if rank == world - 1:
            poisoned[spec["poison"]][0] = bad
        for raise_ in (True, False):
            _put_grads(model, poisoned)
            case: dict[str, Any] = {}
            try:
                norm = cst.clip_grad_norm_(model.parameters(), spec["max_norm"], 2.0, error_if_nonfinite=raise_)
                case["norm"] = float(norm)
                case["error"] = None
            except Exception as e:
                case["norm"] = None
                case["error"] = f"{type(e).__module__}.{type(e).__name__}: {e}"
            after = _grads(model)
            case["untouched"] = sorted(after) == sorted(poisoned) and all(
                _same(after[n], g) for n, g in poisoned.items()
            )
            case["grads"] = {n: g.tolist() for n, g in after.items()}
            out["nonfinite"][f"{bad}-{raise_}"] = case
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element by element, a NaN equal to a NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(nan=0.0), b.nan_to_num(nan=0.0)))


def checkpoint_without_optimizer(rank: int, world: int, spec: dict[str, Any], path: str, phase: str) -> dict:
    """``save``: the spec's model, one SGD step, then ``save_checkpoint(model, None, path,
    step=spec["step"])``; ``load``: the model from other values (seed 12345), sharded with the
    spec's knobs, then ``load_checkpoint(model, None, path)``. Returns the index and the full
    parameters (after the save, or after the load; and, loading, before it)."""
    import collsched.torch as cst

    name, dtype = spec["model"], spec.get("dtype", torch.float32)
    out: dict[str, Any] = {}
    if phase == "save":
        model = shard_with(models.build(name, 0, dtype), spec)
        opt = models.optimizer("sgd", model.parameters())
        x, y = models.batch(name, 0, 0, 0, rank, dtype)
        models.loss_fn(name, model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out["index"] = cst.save_checkpoint(model, None, path, step=spec["step"])
    else:
        model = shard_with(models.build(name, 12345, dtype), spec)
        out["before"] = workers.snapshot(cst.full_parameters(model))
        out["index"] = cst.load_checkpoint(model, None, path)
    full = cst.full_parameters(model)
    out["dtypes"] = sorted({str(v.dtype) for v in full.values()})
    out["params"] = workers.snapshot(full)
    return out


# ---- the "collsched" process group ----------------------------------------------------------


def values(rank: int, numel: int, salt: int, small: bool) -> torch.Tensor:
    """This rank's input of a case, in float64: small integers (exact in every dtype and in
    every sum of a few of them, also times a power of two) or normal values."""
    g = torch.Generator().manual_seed(7919 * salt + rank)
    if small:
        return torch.randint(-16, 17, (numel,), generator=g).double()
    return torch.randn(numel, generator=g).double()


def plain(t: torch.Tensor) -> tuple[str, list]:
    return (str(t.dtype).removeprefix("torch."), t.flatten().tolist())


def pg_allocate(rank: int, world: int) -> dict[str, Any]:
    """The backend FSDP2 asks for memory (``group._get_backend(cpu)``): what it says it
    supports, tensors from ``allocate_tensor`` (their shape, dtype, and collectives that read
    and write them), a zero-size one, and one asked for on another device."""
    import torch.distributed as dist

    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    out: dict[str, Any] = {
        "name": backend.getBackendName() if hasattr(backend, "getBackendName") else type(backend).__name__,
        "supports_cpu": bool(backend.supports_tensor_alloc(torch.device("cpu"))),
        "supports_meta": bool(backend.supports_tensor_alloc(torch.device("meta"))),
    }
    shapes = {}
    for dt, n in (("float32", 1000), ("bfloat16", 7), ("float16", 3), ("int64", 5)):
        t = backend.allocate_tensor(n, dtype=getattr(torch, dt), device=torch.device("cpu"))
        shapes[dt] = (list(t.shape), str(t.dtype).removeprefix("torch."), t.is_contiguous(), str(t.device))
    out["shapes"] = shapes
    empty = backend.allocate_tensor(0, dtype=torch.float32, device=torch.device("cpu"))
    out["empty"] = (list(empty.shape), str(empty.dtype))
    out["meta"] = error_text(lambda: backend.allocate_tensor(4, dtype=torch.float32, device=torch.device("meta")))
    n = 1000
    alloc = backend.allocate_tensor
    cpu = torch.device("cpu")
    # All-gather from and into allocated tensors, FSDP2's in-place form too.
    inp = alloc(n, dtype=torch.float32, device=cpu)
    inp.copy_(values(rank, n, 1, False).float())
    gathered = alloc(n * world, dtype=torch.float32, device=cpu)
    dist.all_gather_into_tensor(gathered, inp)
    out["all_gather"] = plain(gathered)
    inplace = alloc(n * world, dtype=torch.bfloat16, device=cpu)
    inplace.narrow(0, rank * n, n).copy_(values(rank, n, 2, False).bfloat16())
    dist.all_gather_into_tensor(inplace, inplace.narrow(0, rank * n, n))
    out["all_gather_in_place"] = plain(inplace)
    # Reductions on allocated tensors: a reduce-scatter (FSDP2's gradients) and an all-reduce.
    rs_in = alloc(n * world, dtype=torch.float32, device=cpu)
    rs_in.copy_(values(rank, n * world, 3, True).float())
    rs_out = alloc(n, dtype=torch.float32, device=cpu)
    dist.reduce_scatter_tensor(rs_out, rs_in)
    out["reduce_scatter"] = plain(rs_out)
    ar = alloc(n, dtype=torch.float16, device=cpu)
    ar.copy_(values(rank, n, 4, True).half())
    dist.all_reduce(ar)
    out["all_reduce"] = plain(ar)
    return out


def pg_coalesced(rank: int, world: int) -> dict[str, Any]:
    """``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` under
    ``dist._coalescing_manager`` (the backend's ``*_coalesced`` methods), synchronous and with
    ``async_ops=True``, tensors of several sizes (and dtypes, for the gathers) per batch."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    sizes = (1, 257, 70000)
    ar = [values(rank, n, 10 + k, True).float() for k, n in enumerate(sizes)]
    with dist._coalescing_manager():
        for t in ar:
            dist.all_reduce(t)
    out["all_reduce"] = [plain(t) for t in ar]
    avg = [values(rank, n, 20 + k, True).bfloat16() for k, n in enumerate(sizes[:2])]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in avg:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
    cm.wait()
    out["all_reduce_avg_async"] = [plain(t) for t in avg]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    ins = [values(rank, n, 30 + k, False).to(dt) for k, (n, dt) in enumerate(zip(sizes, dtypes))]
    outs = [torch.empty(n * world, dtype=dt) for n, dt in zip(sizes, dtypes)]
    with dist._coalescing_manager():
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    out["all_gather"] = [plain(o) for o in outs]
    # FSDP2's form: each input is this rank's part of its output.
    bufs = [torch.empty(n * world, dtype=torch.float32) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for k, (b, n) in enumerate(zip(bufs, sizes)):
            b.narrow(0, rank * n, n).copy_(values(rank, n, 40 + k, False).float())
            dist.all_gather_into_tensor(b, b.narrow(0, rank * n, n))
    cm.wait()
    out["all_gather_in_place_async"] = [plain(b) for b in bufs]
    for red in ("sum", "avg"):
        rins = [values(rank, n * world, 50 + k, True).float() for k, n in enumerate(sizes)]
        routs = [torch.empty(n, dtype=torch.float32) for n in sizes]
        with dist._coalescing_manager():
            for o, i in zip(routs, rins):
                dist.reduce_scatter_tensor(o, i, op=getattr(dist.ReduceOp, red.upper()))
        out[f"reduce_scatter_{red}"] = [plain(o) for o in routs]
    return out


def pg_premul(rank: int, world: int, cases: list[tuple[str, str, float, int, bool]]) -> list[Any]:
    """Each case ``(op, dtype, factor, numel, small)``: ``op`` (``all_reduce``,
    ``reduce_scatter`` or ``reduce_scatter_coalesced``) with ``dist._make_nccl_premul_sum(factor)``
    on this rank's ``values(rank, ..., salt=case index, small)`` in ``dtype``; then a tensor
    factor, which the backend refuses."""
    import torch.distributed as dist

    out: list[Any] = []
    for k, (op, dt, factor, numel, small) in enumerate(cases):
        dtype = getattr(torch, dt)
        premul = dist._make_nccl_premul_sum(factor)
        if op == "all_reduce":
            t = values(rank, numel, 100 + k, small).to(dtype)
            dist.all_reduce(t, op=premul)
            out.append(plain(t))
        elif op == "reduce_scatter":
            t = values(rank, numel * world, 100 + k, small).to(dtype)
            got = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(got, t, op=premul)
            out.append(plain(got))
        else:
            t = values(rank, numel * world, 100 + k, small).to(dtype)
            halves = (t[: numel * world // 2].clone(), t[numel * world // 2 :].clone())
            gots = [torch.empty(h.numel() // world, dtype=dtype) for h in halves]
            with dist._coalescing_manager():
                for g, h in zip(gots, halves):
                    dist.reduce_scatter_tensor(g, h, op=premul)
            out.append([plain(g) for g in gots])
    tensor_factor = dist._make_nccl_premul_sum(torch.tensor(0.5))
    out.append(error_text(lambda: dist.all_reduce(torch.ones(4, dtype=torch.float16), op=tensor_factor)))
    return out


def fsdp2_allocating(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Two FSDP2 runs of the spec's model in this job, the second with
    ``set_allocate_memory_from_process_group_for_comm(True)`` on every module it shards (its
    communication buffers from the backend's ``allocate_tensor``, counted here): each run's
    losses and full parameters after every step."""
    from torch.distributed.fsdp import fully_shard

    from collsched.torch import distributed as cdist

    calls = {"n": 0, "bytes": 0}
    original = cdist._Backend.allocate_tensor

    def counted(self: Any, size: int, *, dtype: torch.dtype, device: Any) -> torch.Tensor:
        t = original(self, size, dtype=dtype, device=device)
        calls["n"] += 1
        calls["bytes"] += t.numel() * t.element_size()
        return t

    cdist._Backend.allocate_tensor = counted
    name = spec["model"]
    runs = []
    for from_group in (False, True):
        model = models.build(name, 0)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if from_group:
            for m in (*model.blocks, model):
                m.set_allocate_memory_from_process_group_for_comm(True)
        opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
        losses, after = [], []
        for step in range(spec["steps"]):
            x, y = models.batch(name, 0, step, 0, rank)
            loss = models.loss_fn(name, model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            after.append({n: p.full_tensor().detach().flatten().tolist() for n, p in model.named_parameters()})
        runs.append({"losses": losses, "params": after, "calls": dict(calls)})
    return {"plain": runs[0], "allocating": runs[1]}


class Keyed(torch.nn.Module):
    """A unit whose forward takes keyword-only arguments, and a method that reads the root's
    embedding other than through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, idx: torch.Tensor, *, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.lin(self.emb(idx)) * scale
        return h if mask is None else h * mask

    def encode(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx).sum(-1)


def module_face(rank: int, world: int) -> dict[str, Any]:
    """A sharded module's interface and hooks against an unsharded copy of it."""
    import inspect

    import collsched.torch as cst

    cst.init()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(Keyed(), torch.nn.Linear(6, 3))
    model = torch.nn.Sequential(Keyed(), torch.nn.Linear(6, 3))
    model.load_state_dict(ref.state_dict())
    keyed = model[0]
    cst.fully_shard(keyed)
    cst.fully_shard(model)
    seen: dict[str, Any] = {}
    keyed.register_forward_pre_hook(lambda m, a: seen.__setitem__("pre", tuple(m.lin.weight.shape)))
    keyed.register_forward_hook(lambda m, a, o: seen.__setitem__("post", tuple(m.lin.weight.shape)))
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1.0], [0.0], [1.0]])
    out: dict[str, Any] = {
        "signature": str(inspect.signature(keyed.forward)),
        "ref_signature": str(inspect.signature(ref[0].forward)),
        "class": (type(keyed).__name__, type(keyed).__qualname__, type(keyed).forward is Keyed.forward),
        "keyed": torch.equal(keyed(idx, scale=2.0, mask=mask), ref[0](idx, scale=2.0, mask=mask)),
        "whole": torch.equal(model(idx), ref(idx)),
        "hooks": dict(seen),
        "shard": tuple(keyed.lin.weight.shape),
        "encode_unregistered": error_text(lambda: keyed.encode(idx)),
    }
    cst.register_fsdp_forward_method(keyed, "encode")
    out["encode"] = torch.equal(keyed.encode(idx), ref[0].encode(idx))
    out["missing"] = error_text(lambda: cst.register_fsdp_forward_method(keyed, "decode"))

    def boom(m: torch.nn.Module, a: Any, o: Any) -> None:
        raise ValueError("boom")

    handle = model[1].register_forward_hook(boom)
    out["raised"] = error_text(lambda: model(idx).sum().backward())
    out["live_after_raise"] = cst.live_bytes(model)
    handle.remove()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(idx).sum().backward()
        o.step()
    full = cst.full_parameters(model)
    out["after_step"] = all(torch.allclose(full[n], p, rtol=0, atol=0) for n, p in ref.named_parameters())
    out["names"] = sorted(full) == sorted(n for n, _ in ref.named_parameters())
    return out


def resharding(rank: int, world: int, spec: dict[str, Any], mode: str) -> dict[str, Any]:
    """The spec's gpt trained with ``reshard_after_forward`` per ``mode``: ``default`` (not
    given), ``keep`` (False on every unit), ``release`` (True on the root, the blocks' not
    given), ``toggle`` (as ``release``, then ``set_reshard_after_forward(False)`` on the root
    after the first step).
    Losses, full parameters and counters per step, and the bytes gathered between each
    forward and its backward."""
    import collsched.torch as cst

    cst.init()
    model = models.build("gpt", spec.get("seed", 0))
    blocks_flag = {"keep": False}.get(mode)
    root_flag = {"keep": False, "release": True, "toggle": True}.get(mode)
    for b in model.blocks:
        cst.fully_shard(b, bucket_mb=spec["bucket_mb"], reshard_after_forward=blocks_flag)
    cst.fully_shard(model, bucket_mb=spec["bucket_mb"], reshard_after_forward=root_flag)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    out: dict[str, Any] = {"losses": [], "params": [], "stats": [], "between": [], "after": []}
    for step in range(spec["steps"]):
        if mode == "toggle" and step == 1:
            model.set_reshard_after_forward(False)
        x, y = models.batch("gpt", spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn("gpt", model(x), y)
        out["between"].append(cst.live_bytes(model))
        loss.backward()
        out["after"].append(cst.live_bytes(model))
        out["stats"].append(cst.stats(model))
        opt.step()
        opt.zero_grad()
        out["losses"].append([loss.item()])
        out["params"].append(workers.snapshot(cst.full_parameters(model)))
    out["plan"] = cst.plan(model)
    # FSDP2's int: the number of ranks resharded to (the world is True, 1 is False).
    state = model.__dict__["_collsched_state"]
    out["int"] = error_text(lambda: model.set_reshard_after_forward(world + 1))
    model.set_reshard_after_forward(world)
    out["int_world"] = [u.reshard for u in state.units]
    model.set_reshard_after_forward(1)
    out["int_one"] = [u.reshard for u in state.units]
    out["zero"] = error_text(lambda: cst.fully_shard(models.build("gpt", 0), reshard_after_forward=0))
    # Refused by fully_shard itself before anything changes: the module is left unsharded.
    other = models.build("gpt", 0)
    out["ctor_int"] = error_text(lambda: cst.fully_shard(other, reshard_after_forward=world + 1))
    out["ctor_int_unchanged"] = [tuple(p.shape) for p in other.parameters()] == [
        tuple(p.shape) for p in models.build("gpt", 0).parameters()
    ] and "_collsched_u" not in other.__dict__
    return out


def mixed_face(rank: int, world: int, path: str) -> dict[str, Any]:
    """FSDP2's own MixedPrecisionPolicy on an mlp: the dtypes a unit sees and gives, the
    parameters' and gradients' dtypes, the refusals."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import collsched.torch as cst

    cst.init()
    bf16, f32 = torch.bfloat16, torch.float32
    # torchtitan's way: the blocks compute in bf16, the root's output goes out in f32.
    model = models.build("mlp", 0)
    for b in model.blocks:
        cst.fully_shard(b, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    cst.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, output_dtype=f32))
    seen: dict[str, Any] = {}
    model.blocks[0].register_forward_pre_hook(lambda m, a: seen.__setitem__("input", str(a[0].dtype)))
    model.blocks[0].register_forward_hook(lambda m, a, o: seen.__setitem__("block_out", str(o.dtype)))
    x, y = models.batch("mlp", 0, 0, 0, rank)
    out = model(x)
    models.loss_fn("mlp", out, y).backward()
    out_dict: dict[str, Any] = {
        "seen": seen,
        "output": str(out.dtype),
        "params": sorted({str(p.dtype) for p in model.parameters()}),
        "grads": sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}),
        "full": sorted({str(v.dtype) for v in cst.full_parameters(model).values()}),
        "save_full": error_text(lambda: cst.save_full(model, path)),
        "half": error_text(lambda: model.half()),
        "after_half": sorted({str(p.dtype) for p in model.parameters()}),
    }
    for case, kw in {
        "not_a_policy": {"mp_policy": "bf16"},
        "int_dtype": {"mp_policy": cst.MixedPrecisionPolicy(param_dtype=torch.int8)},
        "conflict": {"mp_policy": cst.MixedPrecisionPolicy(bf16, reduce_dtype=f32), "reduce_dtype": bf16},
    }.items():
        out_dict[case] = error_text(lambda kw=kw: cst.fully_shard(models.build("mlp", 0), **kw))
    # Blocks in bf16 under a root without a policy.
    other = models.build("mlp", 0)
    for b in other.blocks:
        cst.fully_shard(b, mp_policy=cst.MixedPrecisionPolicy(param_dtype=bf16))
    out_dict["unit_policy"] = error_text(lambda: cst.fully_shard(other))
    return out_dict


def pass_edges(rank: int, world: int) -> dict[str, Any]:
    """What a pass leaves after a KeyboardInterrupt in a unit's forward, after an evaluation
    between a forward and its backward with units kept, and after the setting that keeps them
    changes with a frozen unit."""
    import collsched.torch as cst

    cst.init()
    model = models.build("gpt", 0)
    for b in model.blocks:
        cst.fully_shard(b, bucket_mb=0.002)
    cst.fully_shard(model, bucket_mb=0.002)
    state = model.__dict__["_collsched_state"]
    x, y = models.batch("gpt", 0, 0, 0, rank)

    def interrupt(m: torch.nn.Module, a: Any) -> None:
        raise KeyboardInterrupt

    handle = model.blocks[1].register_forward_pre_hook(interrupt)
    out: dict[str, Any] = {}
    try:
        model(x)
    except KeyboardInterrupt:
        out["interrupted"] = True
    handle.remove()
    out["after_interrupt"] = (len(state.frames), state.engine is None, cst.live_bytes(model))
    # Frozen first block, units kept into the backward from the second step, an evaluation
    # pass between a forward and its backward.
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.blocks[0].named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gathers = []
    for step in range(3):
        if step == 1:
            model.set_reshard_after_forward(False)
        loss = models.loss_fn("gpt", model(x), y)
        with torch.no_grad():
            model(x)
        loss.backward()
        gathers.append(cst.stats(model)["all_gathers"])
        opt.step()
        opt.zero_grad()
    out["gathers"] = gathers
    out["buckets"] = len([b for b in cst.plan(model)["buckets"] if b["kind"] == "gather"])
    out["frozen_same"] = all(torch.equal(p.detach(), before[n]) for n, p in model.blocks[0].named_parameters())
    out["live"] = cst.live_bytes(model)
    return out
