"""What each rank runs in the tests (importable by the processes the tests start)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import models


def shard(model: torch.nn.Module, spec: dict[str, Any]) -> torch.nn.Module:
    import collsched.torch as cst

    backend = spec.get("backend", "shm")
    strategy = spec.get("strategy", "even")
    hybrid = int(strategy.split(":")[1]) if strategy.startswith("hybrid:") else None
    cst.init(backend, **({"hybrid_group_size": hybrid} if backend == "cuda" else {}))
    if backend == "cuda":
        model.to(torch.device("cuda", torch.cuda.current_device()))
    keys = ("strategy", "bucket_mb", "prefetch", "reduce_dtype", "auto_refresh_trainable", "reshard_after_forward")
    opts = {k: spec[k] for k in keys if k in spec}
    if spec.get("mp"):
        opts["mp_policy"] = cst.MixedPrecisionPolicy(**spec["mp"])
    if spec.get("offload"):
        opts["offload_policy"] = cst.CPUOffloadPolicy()
    for b in model.blocks:
        cst.fully_shard(b, **opts)
    if spec.get("tied"):
        # Tied once the blocks are sharded (a model's tie_weights() after wrapping): one shard
        # in two units, as the reference's parameter built tied (models.build's ``tied``).
        model.blocks[1].fc.weight = model.blocks[0].fc.weight
    # FSDP2's gradient reduction policy (``divide``) on the blocks alone, the root's own keeping
    # the mean, set after the root's fully_shard or (``divide_early``) before it; or on the root
    # alone (``divide_on="root"``).
    on_blocks = "divide" in spec and spec.get("divide_on", "blocks") == "blocks"
    for b in model.blocks if on_blocks and spec.get("divide_early") else []:
        b.set_gradient_divide_factor(spec["divide"])
    root = cst.fully_shard(model, **opts)
    for b in model.blocks if on_blocks else []:
        b.set_gradient_divide_factor(spec["divide"])
        b.set_force_sum_reduction_for_comms(True)
        b.set_requires_all_reduce(True)
    if "divide" in spec and not on_blocks:
        root.set_gradient_divide_factor(spec["divide"])
    return root


def on_thread(fn: Any) -> Any:
    """``fn()`` on a new thread, joined; its exception raised here."""
    import threading

    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            out["error"] = e

    t = threading.Thread(target=body, name="collsched-test-backward")
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")


def snapshot(values: dict[str, torch.Tensor]) -> dict[str, list]:
    # A checkpoint_wrapper's module adds a level to the names; the reference has none.
    return {n.replace("._checkpoint_wrapped_module", ""): v.float().flatten().tolist() for n, v in values.items()}


def train(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Trains the spec's model sharded, as the reference does; returns losses, the full
    parameters after every step, and every step's counters."""
    import collsched.torch as cst

    name, dtype = spec["model"], spec.get("dtype", torch.float32)
    recompute = spec.get("recompute")
    model = shard(models.build(name, spec.get("seed", 0), dtype, recompute and tuple(recompute)), spec)
    if spec.get("validate_first"):
        # A validation trainer wraps the model and evaluates; a fitting trainer wraps it again.
        with torch.no_grad():
            x, y = models.batch(name, 98, 0, 0, rank, dtype)
            models.loss_fn(name, model(x), y)
        again = shard(model, spec)
        assert again is model, "a second fully_shard of the root returned another module"
    if spec.get("explicit_lists"):
        # FSDP2's spelling: each block names the next (forward) and the previous (backward).
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    losses, after, stats, evals, norms, held, memory = [], [], [], [], [], [], []
    micro_n = spec.get("micro", 1)
    # FSDP2's set_reshard_after_backward: False on the whole model ("never"), or False but
    # on the last micro-batch ("last", FSDP2's gradient accumulation).
    keep = spec.get("reshard_after_backward")
    if keep == "never":
        model.set_reshard_after_backward(False)
    for step in range(spec["steps"]):
        frozen = spec.get("frozen", {}).get(step, [])
        for n, p in model.named_parameters():
            p.requires_grad_(not any(n.startswith(f) for f in frozen))
        if spec.get("auto_refresh_trainable") is False:
            model.refresh_trainable()
        row = []
        for micro in range(micro_n):
            x, y = models.batch(name, spec.get("seed", 0), step, micro, rank, dtype)
            if spec.get("backend") == "cuda":
                x, y = x.cuda(), y.cuda()
            if keep == "last":
                model.set_reshard_after_backward(micro + 1 == micro_n)
            # FSDP2's HSDP accumulation: the all-reduce across replica groups deferred, on
            # again for the last micro-batch by set_requires_all_reduce(True) ("all_reduce"),
            # by set_requires_gradient_sync(True) ("sync"); or deferred once, inside a no_sync()
            # around the first micro-batch, which must outlast it ("inside_no_sync").
            defer, last = spec.get("defer_all_reduce"), micro + 1 == micro_n
            if defer and last:
                (model.set_requires_gradient_sync if defer == "sync" else model.set_requires_all_reduce)(True)
            elif defer in ("all_reduce", "sync"):
                model.set_requires_all_reduce(False)
            inside = defer == "inside_no_sync" and micro == 0
            ctx = model.no_sync() if inside or not (last or defer) else contextlib.nullcontext()
            with ctx:
                if inside:
                    model.set_requires_all_reduce(False)
                with models.autocast(spec, x.device.type):
                    out = model(x)
                loss = models.loss_fn(name, out, y)
                if spec.get("backward_thread"):
                    # As autograd does on CUDA: the backward (our hooks and backward
                    # functions) on a thread other than the one that sharded the model.
                    on_thread(loss.backward)
                else:
                    loss.backward()
            stats.append(cst.stats(model))
            held.append(cst.live_bytes(model))
            row.append(loss.item())
            if spec.get("eval_between") and micro + 1 < micro_n:
                with torch.no_grad():
                    ex, ey = models.batch(name, 99, step, 0, rank, dtype)
                    evals.append(models.loss_fn(name, model(ex), ey).item())
        if spec.get("clip"):
            # torch's own function, as an unmodified loop calls it.
            kind = spec.get("clip_norm", 2.0)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"], kind)))
        opt.step()
        opt.zero_grad()
        if spec.get("empty_cache"):
            # The library's pool before and after giving its cached blocks back, between steps.
            before = cst.memory_stats()
            freed = cst.empty_cache()
            memory.append((before, freed, cst.memory_stats()))
        losses.append(row)
        after.append(snapshot(cst.full_parameters(model)))
    plan = cst.plan(model)
    live = cst.live_bytes(model)
    return {
        "losses": losses,
        "params": after,
        "stats": stats,
        "evals": evals,
        "plan": plan,
        "live": live,
        "norms": norms,
        "held": held,
        "memory": memory,
        # Where each shard the optimizer updates lives: device type, page-locked, storage.
        "places": [(p.device.type, p.is_pinned(), p.untyped_storage().data_ptr()) for p in model.parameters()],
    }


def gradcache(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """GradCache-style steps: representations of every chunk without grad, the loss's
    gradient with respect to them, then each chunk's forward again and backward of that
    gradient, under no_sync for all chunks but the last."""
    import collsched.torch as cst

    name = spec["model"]
    model = shard(models.build(name, spec.get("seed", 0)), spec)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    chunks = spec["micro"]
    after, stats = [], []
    for step in range(spec["steps"]):
        batches = [models.batch(name, spec.get("seed", 0), step, c, rank) for c in range(chunks)]
        with torch.no_grad():
            reps = [model(x) for x, _ in batches]
        reps = [r.detach().requires_grad_(True) for r in reps]
        loss = sum(models.loss_fn(name, r, y) for r, (_, y) in zip(reps, batches))
        grads = torch.autograd.grad(loss, reps)
        step_stats = []
        for c, ((x, _), g) in enumerate(zip(batches, grads)):
            model.set_requires_gradient_sync(c + 1 == chunks)
            model(x).backward(g)
            step_stats.append(cst.stats(model))
        stats.append(step_stats)
        opt.step()
        opt.zero_grad()
        after.append(snapshot(cst.full_parameters(model)))
    return {"params": after, "stats": stats, "plan": cst.plan(model)}


def clip_mixed(rank: int, world: int) -> str:
    """Clips a sharded model's parameters together with a plain tensor: the error's message.
    torch's own clip still takes plain tensors alone."""
    import collsched.torch as cst

    model = shard(models.build("mlp"), {})
    x, y = models.batch("mlp", 0, 0, 0, rank)
    models.loss_fn("mlp", model(x), y).backward()
    plain = torch.nn.Parameter(torch.ones(3, 2))
    plain.grad = torch.full((3, 2), 4.0)
    norm = torch.nn.utils.clip_grad_norm_([plain], 1.0)
    assert abs(float(norm) - 4.0 * 6**0.5) < 1e-4 and float(plain.grad.norm()) < 1.0 + 1e-4
    try:
        torch.nn.utils.clip_grad_norm_([*model.parameters(), plain], 1.0)
    except cst.CollschedError as e:
        return str(e)
    return "no error"


def forward_only(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Training steps with, between them, a validation pass, a forward whose output is
    dropped, a forward that raises in its second block, and a backward that raises before
    the first block's (after the second handed its gradients over, while the root's are
    accumulated and not yet handed), followed by ``zero_grad``; returns what `train` does,
    plus the gathered bytes still live after each step and each validation pass."""
    import collsched.torch as cst

    name = spec["model"]
    model = shard(models.build(name, spec.get("seed", 0)), spec)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    boom = {"armed": False}

    def maybe_raise(module: torch.nn.Module, args: Any) -> None:
        if boom["armed"]:
            raise ValueError("injected failure in blocks.1")

    model.blocks[1].register_forward_pre_hook(maybe_raise)

    def fail_in_backward(grad: torch.Tensor) -> None:
        raise ValueError("injected failure in the backward of blocks.0")

    def arm_backward(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        if boom.get("backward"):
            out.register_hook(fail_in_backward)

    model.blocks[0].register_forward_hook(arm_backward)
    losses, after, live = [], [], []
    for step in range(spec["steps"]):
        x, y = models.batch(name, spec.get("seed", 0), step, 0, rank)
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item()])
        # After a step (which followed a dropped and a failed forward from step 1 on).
        live.append(cst.live_bytes(model))
        after.append(snapshot(cst.full_parameters(model)))
        with torch.no_grad():
            model(x)
        live.append(cst.live_bytes(model))
        model(x)  # output dropped: no backward
        boom["armed"] = True
        try:
            model(x)
            raise AssertionError("the injected failure did not propagate")
        except ValueError as e:
            assert "injected failure" in str(e)
        boom["armed"] = False
        boom["backward"] = True
        try:
            models.loss_fn(name, model(x), y).backward()
            raise AssertionError("the injected backward failure did not propagate")
        except ValueError as e:
            assert "injected failure in the backward" in str(e)
        boom["backward"] = False
        opt.zero_grad()
    return {"losses": losses, "params": after, "live": live}


class _DictIn(torch.nn.Linear):
    """A linear block that takes its input in a dict: a unit whose tensors are nested in its
    arguments."""

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(d["x"])


class _NestedMlp(models.Mlp):
    """The MLP with blocks that take their input in a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_DictIn(7, 13), _DictIn(13, 11), _DictIn(11, 9)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.tanh(b({"x": x}))
        return self.head(x)


def post_backward_order(rank: int, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    """One step of the MLP (with ``spec["nested"]``: blocks taking their input in a dict),
    looking, once the gradient of the first block's output is computed (the later blocks'
    backward done, the first's and the root's not), at which parameters' gradients the
    library has and which units are released."""
    from collsched.torch import module as sh

    model = shard(_NestedMlp() if spec.get("nested") else models.build("mlp"), spec)
    state = sh._root_state(model)
    names = {p.pid: p.name for p in state.params}
    seen: dict[str, Any] = {}

    def look(grad: torch.Tensor) -> None:
        seen["handed"] = sorted(names[i] for i in state.got)
        seen["released"] = [u.fetched is None for u in state.units]

    def arm(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
        out.register_hook(look)

    model.blocks[0].register_forward_hook(arm)
    x, y = models.batch("mlp", 0, 0, 0, rank)
    models.loss_fn("mlp", model(x), y).backward()
    return {**seen, "units": [type(u.module).__name__ for u in state.units]}


def raise_in_forward(rank: int, world: int, spec: dict[str, Any]) -> None:
    """Rank 1 raises in its forward of step 1 (and its process ends); the others go on."""
    name = spec["model"]
    model = shard(models.build(name, 0), spec)

    def fail(module: torch.nn.Module, args: Any) -> None:
        raise ValueError(f"rank {rank} failed in its forward")

    for step in range(3):
        if step == 1 and rank == 1:
            model.blocks[1].register_forward_pre_hook(fail)
        x, y = models.batch(name, 0, step, 0, rank)
        models.loss_fn(name, model(x), y).backward()


def shard_views(rank: int, world: int) -> dict[str, Any]:
    """The shards after fully_shard: their sizes, and a write to one seen by the next gather."""
    import collsched.torch as cst

    model = shard(models.build("mlp"), {"bucket_mb": 0.0005})
    sizes = {n: (p.dim(), p.numel()) for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(rank + 1))
    return {"sizes": sizes, "full": snapshot(cst.full_parameters(model)), "plan": cst.plan(model)}


class DlpackOnCuda:
    """An array that says (through DLPack alone, as another library's array answers) it lies
    on CUDA device 0, over host bytes: what the library must refuse to read as host memory
    (it reads no further than the array's own account)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._t = t

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)  # kDLCUDA, device 0

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self._t.data_ptr()

    @property
    def nbytes(self) -> int:
        return self._t.nbytes


class OnCuda(DlpackOnCuda):
    """:class:`DlpackOnCuda` answering as a CUDA tensor of torch does (``is_cuda``,
    ``get_device()``: what the library reads first)."""

    is_cuda = True
    is_cpu = False

    def get_device(self) -> int:
        return 0


def tensors_by_their_device(rank: int, world: int) -> dict[str, str]:
    """The native model's initial values, gradients and saved states are read from the
    tensors' own account of where they lie: a CUDA tensor on a host world, or a strided one,
    is an error naming it, never a host read."""
    import collsched.torch as cst
    from collsched import _native

    cst.init()
    w = cst.world()
    text = '{"params": [{"name": "w", "shape": [4, 6], "dtype": "f32"}, {"name": "b", "shape": [6], "dtype": "f32"}]}'
    w_init, b_init = torch.arange(24, dtype=torch.float32).view(4, 6), torch.ones(6)
    out: dict[str, str] = {}

    def error(fn: Any) -> str:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    out["init_on_cuda"] = error(lambda: _native.Model(w, text, [w_init, OnCuda(b_init)], "even", 1.0))
    out["init_strided"] = error(lambda: _native.Model(w, text, [w_init.t(), b_init], "even", 1.0))
    out["init_count"] = error(lambda: _native.Model(w, text, [w_init], "even", 1.0))
    model = _native.Model(w, text, [w_init, b_init], "even", 1.0)
    engine = model.engine("none")
    engine.fetch([0, 1])
    engine.release([0, 1])
    out["grad_on_cuda"] = error(lambda: engine.grad_ready_many([(0, torch.zeros(24)), (1, OnCuda(torch.zeros(6)))]))
    out["grad_dlpack_on_cuda"] = error(lambda: engine.grad_ready(1, DlpackOnCuda(torch.zeros(6))))
    out["grad_strided"] = error(lambda: engine.grad_ready(0, torch.zeros(6, 4).t()))
    out["save_on_cuda"] = error(
        lambda: model.save("/nonexistent-collsched-dir", 0, [("m", 0, "f32", OnCuda(b_init))], "{}")
    )
    return out


def emulated_regions(rank: int, world: int) -> dict[str, Any]:
    """On the emulated device, library memory is a device's to the package: a shard's region
    refuses the buffer protocol (a host read) and views through DLPack as a CPU tensor."""
    import collsched.torch as cst
    from collsched import _native

    cst.init("emulated")
    w = cst.world()
    text = '{"params": [{"name": "w", "shape": [4, 6], "dtype": "f32"}]}'
    init = torch.arange(24, dtype=torch.float32).view(4, 6)
    model = _native.Model(w, text, [init], "even", 1.0, 4)
    region, offset, numel = model.shard(0)
    try:
        memoryview(region)
        host_read = "no error"
    except Exception as e:
        host_read = f"{type(e).__name__}: {e}"
    t = torch.from_dlpack(region.dlpack("f32", [numel]))
    return {
        "kind": w.kind,
        "device": region.device,
        "emulated": region.emulated,
        "host_read": host_read,
        "view": (str(t.device), t.tolist()),
        "want": init.flatten()[offset : offset + numel].tolist(),
    }


def dlpack_views(rank: int, world: int) -> dict[str, Any]:
    """A shard's region as DLPack tensors: shared memory with the buffer-protocol view, other
    dtypes and shapes over the same bytes, refusals, a capsule taken twice or never, and a
    tensor that outlives every other reference to the region."""
    import gc
    import sys

    from collsched.torch import module as sh

    model = shard(models.build("mlp"), {})
    native = sh._root_state(model).model
    pid = next(i for i in range(len(list(model.parameters()))) if native.shard(i)[0] is not None)
    region, _offset, numel = native.shard(pid)
    out: dict[str, Any] = {"numel": numel, "len": len(region)}
    t = torch.from_dlpack(region.dlpack("f32", [numel]))
    f = torch.frombuffer(region, dtype=torch.float32)
    out["same_address"] = t.data_ptr() == f.data_ptr() == region.address
    t[0] = 7.25
    out["write_seen"] = float(f[0])
    h = torch.from_dlpack(region.dlpack("bf16", [2, numel]))
    out["bf16"] = (str(h.dtype), list(h.shape), h.data_ptr() == region.address)
    g = torch.from_dlpack(region.dlpack("f16", [numel * 2]))
    out["f16"] = (str(g.dtype), list(g.shape))
    errors = []
    for dtype, shape in (("f32", [numel + 1]), ("f32", [-1]), ("f64", [1]), ("bf16", [numel, 3])):
        try:
            region.dlpack(dtype, shape)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    out["errors"] = errors
    capsule = region.dlpack("f32", [numel])
    torch.from_dlpack(capsule)
    try:
        torch.from_dlpack(capsule)
        out["second_take"] = "no error"
    except Exception as e:  # torch names the used capsule
        out["second_take"] = type(e).__name__
    region.dlpack("f32", [numel])  # never taken: freed with the capsule
    # The lifetime itself: a tensor (and a capsule not yet taken) holds a reference to its
    # region, given back when it goes.
    other = native.shard(pid)[0]
    base = sys.getrefcount(other)
    held = torch.from_dlpack(other.dlpack("f32", [numel]))
    refs = [sys.getrefcount(other) - base]
    del held
    gc.collect()
    refs.append(sys.getrefcount(other) - base)
    untaken = other.dlpack("f32", [numel])
    refs.append(sys.getrefcount(other) - base)
    del untaken
    refs.append(sys.getrefcount(other) - base)
    out["refs"] = refs
    del region, f, h, g, capsule, native, other
    gc.collect()
    out["outlives"] = float(t[0])
    return out


def bad_fully_shard(rank: int, world: int, case: str) -> str:
    """``fully_shard`` on bad input; returns the error's class and message."""
    import collsched.torch as cst

    cst.init()
    try:
        if case == "f64":
            # A floating dtype the kernels do not move (integer ones pass through untouched).
            m = torch.nn.Linear(3, 2)
            m.register_parameter("count", torch.nn.Parameter(torch.zeros(2, dtype=torch.float64)))
            cst.fully_shard(m)
        elif case == "no_params":
            cst.fully_shard(torch.nn.ReLU())
        elif case == "prefetch":
            cst.fully_shard(torch.nn.Linear(3, 2), prefetch="sometimes")
        elif case == "strategy":
            cst.fully_shard(torch.nn.Linear(3, 2), strategy="hybrid:0")
        elif case == "root_then_block":
            m = models.build("mlp")
            cst.fully_shard(m)
            inner = torch.nn.Sequential(m.blocks[0])
            cst.fully_shard(inner)
        elif case == "half_after":
            m = models.build("mlp")
            for b in m.blocks:
                cst.fully_shard(b)
            cst.fully_shard(m)
            before = {n: (p.data_ptr(), p.dtype) for n, p in m.named_parameters()}
            m.float().to("cpu")  # no change: allowed
            try:
                m.half()
            finally:
                after = {n: (p.data_ptr(), p.dtype) for n, p in m.named_parameters()}
                assert after == before, "the shards were not put back"
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return "no error"


def sync_states(rank: int, world: int) -> dict[str, list]:
    """Every rank starts from different values; sync_module_states makes them rank 0's."""
    import collsched.torch as cst

    cst.init()
    model = models.build("mlp", seed=rank)
    for b in model.blocks:
        cst.fully_shard(b, sync_module_states=True)
    cst.fully_shard(model, sync_module_states=True, bucket_mb=0.0005)
    return snapshot(cst.full_parameters(model))


def checkpointed(rank: int, world: int, spec: dict[str, Any], path: str, phase: str) -> dict[str, Any]:
    """``save``: train steps ``[0, split)`` and save; ``load``: a model from other values,
    load, train steps ``[split, steps)``. Returns losses and parameters after each step."""
    import collsched.torch as cst

    name = spec["model"]
    dtype = spec.get("dtype", torch.float32)
    seed = spec.get("seed", 0) if phase == "save" else 12345
    model = shard(models.build(name, seed, dtype), spec)
    opt = models.optimizer(spec.get("opt", "adamw"), model.parameters())
    split = spec["split"]
    steps = range(0, split) if phase == "save" else range(split, spec["steps"])
    if phase == "load" and spec.get("via") == "dcp":
        dcp_checkpoint(model, opt, path, "load")
    elif phase == "load":
        index = cst.load_checkpoint(model, opt, path)
        assert index["step"] == split and index["world"] == spec["save_world"], index
    losses, after = [], []
    for step in steps:
        x, y = models.batch(name, spec.get("seed", 0), step, 0, rank, dtype)
        if spec.get("backend") == "cuda":
            x, y = x.cuda(), y.cuda()
        loss = models.loss_fn(name, model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item()])
        after.append(snapshot(cst.full_parameters(model)))
    if phase == "save" and spec.get("via") == "dcp":
        dcp_checkpoint(model, opt, path, "save")
    elif phase == "save":
        cst.save_checkpoint(model, opt, path, step=split)
    return {"losses": losses, "params": after}


def dcp_checkpoint(model: torch.nn.Module, opt: torch.optim.Optimizer, path: str, phase: str) -> None:
    """torchtitan's checkpoint: the model's and the optimizer's state dicts (DTensors) through
    torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    if phase == "save":
        dcp.save(sd, checkpoint_id=path)
        return
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])


def export_full(rank: int, world: int, spec: dict[str, Any], path: str) -> dict[str, list]:
    """Trains two steps, then writes the full parameters with save_full; returns them as
    full_state_dict gathers them."""
    import collsched.torch as cst

    name = spec["model"]
    model = shard(models.build(name), spec)
    opt = models.optimizer("adamw", model.parameters())
    for step in range(2):
        x, y = models.batch(name, 0, step, 0, rank)
        models.loss_fn(name, model(x), y).backward()
        opt.step()
        opt.zero_grad()
    cst.save_full(model, path)
    return snapshot(cst.full_state_dict(model))


def killed_during_save(rank: int, world: int, spec: dict[str, Any], good: str, bad: str) -> str:
    """Loads ``good``, trains a step, then saves to ``bad``, where rank 1 is killed (SIGKILL)
    as the save begins; returns rank 0's error."""
    import os
    import signal

    import collsched.torch as cst

    name = spec["model"]
    model = shard(models.build(name, 99), spec)
    opt = models.optimizer("adamw", model.parameters())
    cst.load_checkpoint(model, opt, good)
    x, y = models.batch(name, 0, spec["split"], 0, rank)
    models.loss_fn(name, model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        cst.save_checkpoint(model, opt, bad, step=spec["split"] + 1)
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return "saved"


def load_fails(rank: int, world: int, spec: dict[str, Any], path: str) -> str:
    import collsched.torch as cst

    model = shard(models.build(spec["model"], 99), spec)
    try:
        cst.load_checkpoint(model, None, path)
    except Exception as e:
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return "loaded"


def init_cuda(rank: int, world: int) -> str:
    """What ``init(backend="cuda")`` raises on a machine without a GPU (its message)."""
    import collsched.torch as cst

    try:
        cst.init("cuda")
    except Exception as e:  # the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def world_cuda(rank: int, world: int) -> str:
    """What the native ``World.cuda`` raises without a CUDA driver (its message)."""
    from collsched import _native

    try:
        _native.World.cuda(0, 0)
    except Exception as e:  # the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def world_cuda_through_the_store(rank: int, world: int) -> dict[str, Any]:
    """``StoreExchange`` over torch.distributed's store (initialized by the test), on its own
    and as the native ``World.cuda``'s exchange (which fails here, without a CUDA driver, on
    every rank: its report goes through the store)."""
    import torch.distributed as dist

    from collsched import _native
    from collsched.torch.world import StoreExchange

    ex = StoreExchange(dist.distributed_c10d._get_default_store(), rank, world)
    rounds = [ex(f"rank {rank} round {k}".encode() * (rank + 1)) for k in range(2)] + [ex(b"")]
    try:
        _native.World.cuda(0, 0, rank, world, None, [], 30.0, exchange=ex)
        err = "no error"
    except Exception as e:  # the message is what the test checks
        err = f"{type(e).__name__}: {e}"
    # Every rank is past the last round: the keys left are that round's.
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    kept = [[store.check([ex.key(k, r)]) for r in range(world)] for k in range(1, ex.round + 1)]
    return {"rounds": [[r.decode() for r in one] for one in rounds], "error": err, "calls": ex.round, "kept": kept}


def states_are_freed(rank: int, world: int, backend: str) -> dict[str, Any]:
    """A sharded model's state, and the blocks' states a root's fully_shard took over, are freed
    once nothing refers to them (the saved-tensor hooks, native, refer back to their state):
    the blocks' at the root's fully_shard, the root's when the model and optimizer go."""
    import gc
    import weakref

    import collsched.torch as cst
    from collsched.torch.module import _root_state

    cst.init(backend)
    torch.manual_seed(0)
    model = models.Gpt(dim=16, heads=2, layers=2)
    mp = cst.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        cst.fully_shard(block, mp_policy=mp)
    del block  # the last block (and through it the state) is no longer referred to here
    blocks = [weakref.ref(_root_state(b)) for b in model.blocks]
    masters = [weakref.ref(p.own) for b in model.blocks for p in _root_state(b).params]
    cst.fully_shard(model, mp_policy=mp)
    gc.collect()
    after_root = [r() is None for r in blocks + masters]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, models.VOCAB, (2, models.SEQ))
    model(idx).float().sum().backward()
    opt.step()
    root = weakref.ref(_root_state(model))
    del model, opt
    gc.collect()
    return {"blocks_and_masters_freed": after_root, "n": len(blocks) + len(masters), "root_freed": root() is None}


def forward_only_passes(rank: int, world: int, backend: str) -> dict[str, Any]:
    """Training forwards that no backward follows (a loss computed for a log, a pass that
    raised before its backward): the number of live tensors after each, for the model sharded
    and, as the reference, unsharded. Nothing may pile up pass after pass."""
    import gc

    import collsched.torch as cst

    def live() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    cst.init(backend)
    idx = torch.randint(0, models.VOCAB, (2, models.SEQ), generator=torch.Generator().manual_seed(rank))
    out = {}
    for name in ("plain", "sharded"):
        torch.manual_seed(0)
        model = models.Gpt(dim=16, heads=2, layers=2)
        if name == "sharded":
            for block in model.blocks:
                cst.fully_shard(block)
            cst.fully_shard(model)
        counts = []
        for _ in range(10):
            loss = model(idx).float().sum()
            assert loss.requires_grad
            del loss
            counts.append(live())
        out[name] = counts
        out[f"{name}_params"] = len(list(model.parameters()))
        del model
    return out
