"""The surface the other tests leave out, each knob or function against what its documentation
says and, where there is one, plain PyTorch: ``fully_shard``'s ``prefetch="none"``,
``max_inflight`` and ``prefetch_mb`` (peak gathered bytes bounded by what the knob admits,
computed from the plan), ``stats()``'s byte counters, ``world()`` before and after ``init()``,
``clip_grad_norm_``'s ``norm_type`` and ``error_if_nonfinite``, checkpoints without an
optimizer, ``collsched.plan``'s ``align`` and ``bucket_by``, and the ``"collsched"`` process
group's ``allocate_tensor``, coalesced forms and PREMUL_SUM."""

from __future__ import annotations

import math
import re

import pytest
import torch

import collsched

import models
import parity
import surface_workers as sw
from ranks import run

ELEM = {"f32": 4, "bf16": 2, "f16": 2}


# ---- the plan, as the tests read it ---------------------------------------------------------


def buckets(plan: dict, kind: str) -> list[dict]:
    return [b for b in plan["buckets"] if b["kind"] == kind]


def gathered_bytes(plan: dict, b: dict, dtype: str | None = None) -> int:
    """Bytes of bucket ``b``'s full-size buffer (every rank's shard; even and flat plans, where
    every shard is a piece of it), in ``dtype`` (the bucket's unless given)."""
    return b["shard_numel"] * plan["world"] * ELEM[dtype or b["dtype"]]


def contiguous(plan: dict, b: dict, name: str) -> bool:
    """Whether parameter ``name`` is one run of bucket ``b``'s gathered buffer (its ranks'
    pieces in order and back to back), so the gathered buffer itself can be viewed."""
    seen, at = 0, None
    for shard in sorted(b["shards"], key=lambda s: s["rank"]):
        for s in shard["segments"]:
            if s["param"] != name:
                continue
            start = shard["rank"] * b["shard_numel"] + s["shard_offset"]
            if s["param_offset"] != seen or (at is not None and start != at):
                return False
            seen, at = seen + s["numel"], start + s["numel"]
    numel = {p["name"]: p["numel"] for p in plan["params"]}[name]
    return seen == numel


def memory(plan: dict, b: dict) -> int:
    """The most a gather bucket takes while gathered: its gathered buffer, plus an unpacked copy
    of its parameters when one of them is not one run of it (exactly the gathered buffer when
    every parameter is one run, as in every plan these tests bound)."""
    extra = 0
    if not all(contiguous(plan, b, n) for n in b["params"]):
        numel = {p["name"]: p["numel"] for p in plan["params"]}
        extra = sum(numel[n] for n in b["params"]) * ELEM[b["dtype"]]
    return gathered_bytes(plan, b) + extra


def unit_of(name: str) -> int:
    """The unit of a parameter of the tests' models: block ``i``'s are unit ``i + 1``, the
    root's own (embeddings, final norm, head) unit 0."""
    m = re.match(r"blocks\.(\d+)\.", name)
    return int(m.group(1)) + 1 if m else 0


def root_buckets(plan: dict) -> list[dict]:
    """The root's own gather buckets (unit 0's): fully_shard's default keeps the root fetched
    from its forward into its backward, as FSDP2's does, so these are gathered once a step,
    every other gather bucket twice."""
    return [b for b in buckets(plan, "gather") if {unit_of(n) for n in b["params"]} == {0}]


def gathers_per_step(plan: dict) -> int:
    """All-gathers of a training step with the default ``reshard_after_forward``: every block's
    bucket in the forward and again in the backward, the root's once."""
    return 2 * len(buckets(plan, "gather")) - len(root_buckets(plan))


def unit_memory(plan: dict) -> dict[int, int]:
    """The gather buckets' memory per unit (fully_shard cuts buckets at units: each bucket's
    parameters are one unit's)."""
    out: dict[int, int] = {}
    for b in buckets(plan, "gather"):
        units = {unit_of(n) for n in b["params"]}
        assert len(units) == 1, f"bucket {b['id']} spans units {units}: {b['params']}"
        u = units.pop()
        out[u] = out.get(u, 0) + memory(plan, b)
    return out


def held_without_prefetch(plan: dict) -> int:
    """The gathered bytes held at most without prefetch: the root's parameters (gathered for the
    whole step, kept from the forward into the backward) and one block's."""
    per_unit = unit_memory(plan)
    return per_unit[0] + max(v for u, v in per_unit.items() if u != 0)


# ---- fully_shard's prefetch knobs and the step counters -------------------------------------

KNOBS = {
    "default": {},
    "none": {"prefetch": "none"},
    "inflight1": {"max_inflight": 1},
    "inflight2": {"max_inflight": 2},
    "mb0": {"prefetch_mb": 0.0},
    "mb4k": {"prefetch_mb": 4096 / (1 << 20)},
}
KNOB_SPEC = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "opt": "sgd"}


def gpt_plan() -> dict:
    """The plan ``fully_shard`` makes of the gpt of ``KNOB_SPEC`` at 2 ranks (its units as the
    parameters' modules, buckets cut at them), made here with ``collsched.plan``."""
    model = models.build(KNOB_SPEC["model"])
    params = [
        {"name": n, "shape": list(p.shape), "dtype": "f32", "module": f"unit{unit_of(n)}"}
        for n, p in model.named_parameters()
    ]
    return collsched.plan(params, 2, bucket_mb=KNOB_SPEC["bucket_mb"], bucket_by="module")


def documented_defaults(plan: dict) -> dict:
    """``fully_shard``'s documented defaults of ``prefetch_mb`` and ``max_inflight`` ("about
    one unit ahead ...: the largest unit's bytes and its buckets plus one"), given explicitly."""
    per_unit = unit_memory(plan)
    largest = max(per_unit, key=lambda u: per_unit[u])
    count = sum(1 for b in buckets(plan, "gather") if unit_of(b["params"][0]) == largest)
    return {"prefetch_mb": per_unit[largest] / (1 << 20), "max_inflight": count + 1}


@pytest.fixture(scope="module")
def knob_runs() -> dict[str, list[dict]]:
    """The gpt trained 3 steps at 2 ranks with each knob set of ``KNOBS`` and with the
    documented defaults given explicitly (``"explicit"``), in one job: by knob set, every
    rank's run."""
    sets = {**KNOBS, "explicit": documented_defaults(gpt_plan())}
    names = list(sets)
    per_rank = run(sw.train_each, 2, KNOB_SPEC, [sets[n] for n in names])
    return {n: [r[i] for r in per_rank] for i, n in enumerate(names)}


@pytest.mark.parametrize("knobs", [*KNOBS, "explicit"])
def test_every_prefetch_knob_trains_as_plain_pytorch(knob_runs, knobs):
    """Prefetching changes when buckets are gathered, never what: with every knob set the
    losses and full parameters after every step are plain PyTorch's."""
    parity.check(knob_runs[knobs], models.reference(KNOB_SPEC, 2))


def test_prefetch_none_gathers_nothing_ahead(knob_runs):
    """``prefetch="none"``: no gather launched ahead, no hit; every bucket gathered by its
    fetch, once per pass; the peak is what the fetched units hold (the root's buckets and the
    largest block's, from the plan). The default, on the same model, does prefetch after its
    first (recording) step and holds more."""
    for rank, r in enumerate(knob_runs["none"]):
        held = held_without_prefetch(r["plan"])
        for step, st in enumerate(r["stats"]):
            where = f"rank {rank} step {step}: {st}"
            assert st["prefetch_launches"] == 0 and st["prefetch_hits"] == 0, where
            assert st["prefetch_misses"] == st["all_gathers"] == gathers_per_step(r["plan"]), where
            assert st["peak_gathered_bytes"] == held, f"{where}: peak, {held} held by the fetched units"
    for rank, r in enumerate(knob_runs["default"]):
        for step, st in enumerate(r["stats"][1:], 1):
            assert st["prefetch_launches"] > 0 and st["prefetch_hits"] > 0, f"rank {rank} step {step}: {st}"
            peak = knob_runs["none"][rank]["stats"][step]["peak_gathered_bytes"]
            assert st["peak_gathered_bytes"] > peak, f"rank {rank} step {step}: the default holds no more than none"


def test_the_default_prefetch_budget_is_the_documented_one_unit_ahead(knob_runs):
    """The defaults are what ``fully_shard`` documents ("about one unit ahead while one
    computes, as FSDP2 prefetches one module: the largest unit's bytes and its buckets plus
    one"): a run with those values given explicitly (from the plan) prefetches, holds and
    misses exactly as the default run does."""
    assert knob_runs["explicit"][0]["plan"]["buckets"] == gpt_plan()["buckets"], "the test's plan is not the run's"
    keys = ("all_gathers", "prefetch_launches", "prefetch_hits", "prefetch_misses", "peak_gathered_bytes")
    for rank, (d, e) in enumerate(zip(knob_runs["default"], knob_runs["explicit"])):
        for step, (a, b) in enumerate(zip(d["stats"], e["stats"])):
            got = {k: a[k] for k in keys}
            want = {k: b[k] for k in keys}
            assert got == want, f"rank {rank} step {step}: default {got}, documented defaults {want}"


def ahead_allowed(plan: dict, knobs: dict) -> int:
    """The most bytes a knob set lets be gathered ahead, from the plan: ``max_inflight=k``, the
    ``k`` largest buckets; ``prefetch_mb``, the first bucket ahead whatever its size (the
    largest) and ``prefetch_mb`` beyond it."""
    sizes = sorted((memory(plan, b) for b in buckets(plan, "gather")), reverse=True)
    if "max_inflight" in knobs:
        return sum(sizes[: knobs["max_inflight"]])
    return sizes[0] + int(knobs["prefetch_mb"] * (1 << 20))


@pytest.mark.parametrize("knobs", ["inflight1", "inflight2", "mb0", "mb4k"])
def test_max_inflight_and_prefetch_mb_bound_the_gathered_bytes(knob_runs, knobs):
    """``max_inflight`` bounds the buckets gathered ahead and ``prefetch_mb`` the bytes beyond
    the next bucket: every step's peak is at most what the fetched units hold (the peak of
    ``prefetch="none"``, itself the plan's root and largest block) plus what the knob admits
    ahead (from the plan's bucket sizes), below the default's peak, and the knob still
    prefetches (it bounds, it does not turn prefetch off)."""
    for rank, r in enumerate(knob_runs[knobs]):
        plan = r["plan"]
        allowed = held_without_prefetch(plan) + ahead_allowed(plan, KNOBS[knobs])
        for step, st in enumerate(r["stats"]):
            where = f"rank {rank} step {step} ({KNOBS[knobs]}): {st}"
            assert st["peak_gathered_bytes"] <= allowed, f"{where}: peak above {allowed} bytes"
            if step == 0:
                continue  # the first step records the order: nothing is prefetched yet
            assert st["prefetch_launches"] > 0, f"{where}: nothing prefetched"
            default = knob_runs["default"][rank]["stats"][step]["peak_gathered_bytes"]
            assert st["peak_gathered_bytes"] < default, f"{where}: not below the default's peak {default}"


def check_byte_counters(runs: list[dict], reduce_dtype: str | None) -> None:
    """Every step's ``gathered_bytes`` is every gather bucket's full buffer twice (the forward
    and the backward; the root's once: it is kept into the backward), ``reduced_bytes`` every
    gradient bucket's once in the reduction dtype, the launch counts agree, and ``wait_ms``,
    ``host_us_per_unit``, ``native_us_per_unit`` and ``calls_us_per_unit`` are finite and not
    negative."""
    for rank, r in enumerate(runs):
        plan = r["plan"]
        gather, grad = buckets(plan, "gather"), buckets(plan, "grad")
        kept = root_buckets(plan)
        want_gathered = 2 * sum(gathered_bytes(plan, b) for b in gather) - sum(gathered_bytes(plan, b) for b in kept)
        want_reduced = sum(gathered_bytes(plan, b, reduce_dtype) for b in grad)
        for step, st in enumerate(r["stats"]):
            where = f"rank {rank} step {step}"
            want = 2 * len(gather) - len(kept)
            assert st["all_gathers"] == want, f"{where}: {st['all_gathers']} gathers, {want} wanted"
            assert st["gathered_bytes"] == want_gathered, f"{where}: gathered {st['gathered_bytes']}, {want_gathered}"
            assert st["reduce_scatters"] == len(grad), f"{where}: {st['reduce_scatters']} reductions, {len(grad)}"
            assert st["reduced_bytes"] == want_reduced, f"{where}: reduced {st['reduced_bytes']}, {want_reduced}"
            for key in ("wait_ms", "host_us_per_unit", "native_us_per_unit", "calls_us_per_unit"):
                v = st[key]
                assert isinstance(v, float) and math.isfinite(v) and v >= 0, f"{where}: {key} = {v!r}"
            # The library calls' time less their waits: never above their whole time.
            assert st["calls_us_per_unit"] <= st["native_us_per_unit"], where
            assert isinstance(st["blocked_waits"], int) and st["blocked_waits"] >= 0, where
            # Every parameter is viewed at its first fetch (later steps view the addresses a
            # bucket had not had before: on a busy machine, when its deferred free is late).
            views, n = st["views_made"], len(plan["params"])
            assert isinstance(views, int) and (views >= n if step == 0 else views >= 0), f"{where}: {views} views"


@pytest.mark.parametrize("knobs", [*KNOBS, "explicit"])
def test_stats_count_the_plan_s_bytes(knob_runs, knobs):
    """With every prefetch knob, f32 even shards at 2 ranks: ``gathered_bytes`` and
    ``reduced_bytes`` are the plan's (what is gathered ahead is gathered once, never twice)."""
    check_byte_counters(knob_runs[knobs], None)


def test_stats_count_reduced_bytes_in_the_reduction_dtype():
    """bf16 parameters reduced in f32, flat shards at 3 ranks: the gradient buckets' bytes are
    counted in f32 (twice their bf16 size), the gathers' in bf16; and the run is plain
    PyTorch's."""
    spec = {
        "model": "mlp",
        "steps": 2,
        "dtype": torch.bfloat16,
        "reduce_dtype": torch.float32,
        "strategy": "flat",
        "bucket_mb": 0.0005,
        "opt": "sgd",
    }
    runs = [r[0] for r in run(sw.train_each, 3, spec, [{}])]
    parity.check(runs, models.reference(spec, 3), torch.bfloat16)
    assert all(b["dtype"] == "bf16" for b in runs[0]["plan"]["buckets"])
    check_byte_counters(runs, "f32")


# ---- world() ------------------------------------------------------------------------------


@pytest.mark.parametrize(("backend", "kind"), [("shm", "host"), ("emulated", "emulated")])
def test_world_before_and_after_init(backend, kind):
    """Before ``init()``, ``world()`` raises naming ``init()``; after, it is the world ``init``
    returned (this rank of 2, of the backend's kind), and a second ``init`` returns it again."""
    for rank, got in enumerate(run(sw.world_then_init, 2, backend)):
        before = got["before"]
        assert before.startswith("collsched.CollschedError") and "init() was not called" in before, before
        assert got["after"] == (rank, 2, kind), got
        assert got["init_returns_world"] and got["again_same"], got


def test_world_of_a_collsched_process_group_needs_no_init():
    """A ``"collsched"`` process group makes the job's world: ``world()`` answers before any
    ``init()``, and ``init()`` returns that same world."""
    for rank, got in enumerate(run(sw.world_then_init, 3, None, init="collsched")):
        assert got["before"] == "no error", got
        assert got["after"] == (rank, 3, "host"), got
        assert got["again_same"], got


# ---- clip_grad_norm_ ------------------------------------------------------------------------

CLIP_WORLD = 3
CLIP_SPEC = {
    "model": "mlp",
    "bucket_mb": 0.0005,
    "max_norm": 0.02,
    "norm_types": [1.0, 2.0, math.inf, 3.0],
    "poison": "blocks.1.weight",
}


def mean_grads(name: str, world: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch's gradient of step 0 on the unsharded model: every rank's batch, the ranks'
    gradients added in rank order and divided by the world, as the sharded run reduces them."""
    torch.set_num_threads(1)
    model = models.build(name)
    params = dict(model.named_parameters())
    total: dict[str, torch.Tensor] = {}
    for r in range(world):
        x, y = models.batch(name, 0, 0, 0, r)
        grads = torch.autograd.grad(models.loss_fn(name, model(x), y), list(params.values()))
        for n, g in zip(params, grads):
            total[n] = g if n not in total else total[n] + g
    return {n: g / world for n, g in total.items()}


def torch_clip(grads: dict[str, torch.Tensor], max_norm: float, norm_type: float, error: bool = False):
    """torch's own ``clip_grad_norm_`` on plain tensors with ``grads`` (collsched's, where
    importing ``collsched.torch`` installed it, hands tensors that are not shards to torch's):
    the norm and the clipped gradients by name."""
    ps = {n: torch.zeros_like(g, requires_grad=True) for n, g in grads.items()}
    for n, p in ps.items():
        p.grad = grads[n].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(ps.values()), max_norm, norm_type, error_if_nonfinite=error)
    return float(norm), {n: p.grad for n, p in ps.items()}


def shard_indices(plan: dict, rank: int, name: str) -> list[int]:
    """The elements of parameter ``name`` that ``rank``'s shard holds, in order."""
    segs = [
        s
        for b in buckets(plan, "gather")
        for shard in b["shards"]
        if shard["rank"] == rank
        for s in shard["segments"]
        if s["param"] == name
    ]
    return [
        i
        for s in sorted(segs, key=lambda s: s["param_offset"])
        for i in range(s["param_offset"], s["param_offset"] + s["numel"])
    ]


def check_shard_grads(plan: dict, rank: int, got: dict[str, list], want: dict[str, torch.Tensor], what: str) -> None:
    """Every shard's gradient on ``rank`` is its elements of ``want`` (NaN where it is NaN)."""
    for n, full in want.items():
        idx = shard_indices(plan, rank, n)
        if not idx:
            # An empty gradient, as FSDP2 gives a parameter a rank holds none of.
            assert got.get(n) == [], f"{what}: rank {rank} holds no element of {n}; its gradient: {got.get(n)}"
            continue
        assert n in got, f"{what}: rank {rank} has no gradient for its {len(idx)} elements of {n}"
        torch.testing.assert_close(
            torch.tensor(got[n]),
            full.flatten()[idx],
            rtol=1e-5,
            atol=1e-8,
            equal_nan=True,
            msg=lambda m, n=n: f"{what}: rank {rank} {n}: {m}",
        )


@pytest.fixture(scope="module")
def clip_runs() -> list[dict]:
    return run(sw.clip_cases, CLIP_WORLD, CLIP_SPEC)


@pytest.mark.parametrize("norm_type", CLIP_SPEC["norm_types"])
def test_clip_grad_norm_of_each_norm_type_is_torch_s_on_the_unsharded_model(clip_runs, norm_type):
    """``collsched.torch.clip_grad_norm_(model.parameters(), max_norm, norm_type)`` for norm
    types 1, 2, inf and 3: on every rank the norm torch's own function takes of the unsharded
    model's gradient, as a tensor of the parameters' dtype, and every shard's gradient clipped
    as torch clips the unsharded one."""
    grads = mean_grads(CLIP_SPEC["model"], CLIP_WORLD)
    want_norm, want = torch_clip(grads, CLIP_SPEC["max_norm"], norm_type)
    assert want_norm > CLIP_SPEC["max_norm"], f"norm {want_norm}: the case clips nothing"
    for rank, r in enumerate(clip_runs):
        norm, dtype, shape = r["norms"][str(norm_type)]
        assert dtype == "torch.float32" and shape == [], (dtype, shape)
        assert norm == pytest.approx(want_norm, rel=1e-5), f"rank {rank} norm {norm_type}: {norm}, torch's {want_norm}"
        check_shard_grads(r["plan"], rank, r["clipped"][str(norm_type)], want, f"norm {norm_type}")


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_clip_grad_norm_error_if_nonfinite(clip_runs, bad):
    """A NaN or an infinity in one rank's gradient: with ``error_if_nonfinite=True`` every rank
    raises (as torch does), naming the norm, its gradients untouched; with ``False`` every rank
    returns the non-finite norm torch returns and scales the gradients as torch does (all NaN
    for a NaN norm; zero but the poisoned element, NaN, for an infinite one)."""
    grads = mean_grads(CLIP_SPEC["model"], CLIP_WORLD)
    poison = CLIP_SPEC["poison"]
    last = CLIP_WORLD - 1
    at = shard_indices(clip_runs[last]["plan"], last, poison)[0]
    grads[poison].view(-1)[at] = float(bad)
    with pytest.raises(RuntimeError):
        torch_clip(grads, CLIP_SPEC["max_norm"], 2.0, error=True)
    want_norm, want = torch_clip(grads, CLIP_SPEC["max_norm"], 2.0)
    assert not math.isfinite(want_norm)
    for rank, r in enumerate(clip_runs):
        raised = r["nonfinite"][f"{float(bad)}-True"]
        assert raised["norm"] is None, f"rank {rank}: error_if_nonfinite=True returned {raised['norm']}"
        assert raised["error"].startswith("collsched.CollschedError") and bad in raised["error"], raised["error"]
        assert raised["untouched"], f"rank {rank}: the gradients changed before the error"
        kept = r["nonfinite"][f"{float(bad)}-False"]
        assert kept["error"] is None, f"rank {rank}: {kept['error']}"
        norm = kept["norm"]
        assert (math.isnan(norm) and math.isnan(want_norm)) or norm == want_norm, f"rank {rank}: {norm}, {want_norm}"
        check_shard_grads(r["plan"], rank, kept["grads"], want, f"{bad} gradient")


# ---- checkpoints without an optimizer --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("gpt", torch.float32), ("mlp", torch.bfloat16)],
    ids=["gpt-f32", "mlp-bf16"],
)
def test_checkpoint_without_optimizer_round_trips_into_another_world(tmp_path, name, dtype):
    """``save_checkpoint(model, None, ...)`` at 3 ranks (even shards) and
    ``load_checkpoint(model, None, ...)`` at 2 (flat, other buckets) into a model of other
    values: every parameter back bit for bit in its dtype, on every rank; the index has the
    step and world saved, no optimizer state, and pieces that cover every element once."""
    path = str(tmp_path / "ckpt")
    save = {"model": name, "dtype": dtype, "bucket_mb": 0.002, "step": 7}
    saved = run(sw.checkpoint_without_optimizer, 3, save, path, "save")
    load = {**save, "strategy": "flat", "bucket_mb": 0.0005}
    loaded = run(sw.checkpoint_without_optimizer, 2, load, path, "load")
    want = saved[0]["params"]
    assert all(s["params"] == want for s in saved), "the saving ranks' full parameters differ"
    assert loaded[0]["before"] != want, "the model loaded into already had the saved values"
    for rank, r in enumerate(loaded):
        assert r["dtypes"] == [str(dtype)], r["dtypes"]
        assert sorted(r["params"]) == sorted(want)
        for n, w in want.items():
            assert r["params"][n] == w, f"rank {rank}: {n} differs from the saved values"
        index = r["index"]
        assert index["step"] == 7 and index["world"] == 3 and index["strategy"] == "even", index
        assert index["extras"] == [] and "optimizer" not in (index.get("meta") or {}), index
        numel = {p["name"]: math.prod(p["shape"]) for p in index["params"]}
        assert sorted(numel) == sorted(want)
        for p in index["params"]:
            pieces = sorted((q["offset"], q["numel"]) for q in p["pieces"])
            ends = [0] + [o + k for o, k in pieces]
            assert [o for o, _ in pieces] == ends[:-1] and ends[-1] == numel[p["name"]], (p["name"], pieces)


# ---- collsched.plan's align and bucket_by -----------------------------------------------------

PLAN_PARAMS = [
    {"name": "emb", "shape": [37, 24], "dtype": "f32"},
    {"name": "w", "shape": [24, 13], "dtype": "bf16"},
    {"name": "b", "shape": [13], "dtype": "f32"},
    {"name": "h", "shape": [5, 7], "dtype": "f16"},
]


def offsets_in_bytes(plan: dict) -> list[tuple[str, int, int, int]]:
    """Every segment's ``(param, shard offset, parameter offset, shard size)``, in bytes."""
    return [
        (
            s["param"],
            s["shard_offset"] * ELEM[b["dtype"]],
            s["param_offset"] * ELEM[b["dtype"]],
            b["shard_numel"] * ELEM[b["dtype"]],
        )
        for b in plan["buckets"]
        for shard in b["shards"]
        for s in shard["segments"]
    ]


@pytest.mark.parametrize("strategy", ["even", "flat", "greedy"])
def test_plan_align_puts_every_shard_boundary_on_a_multiple(strategy):
    """``align``: every shard's size, every segment's offset in its shard and every cut in a
    parameter is a multiple of ``align`` bytes, for 4, 64 and 1024; every element is still
    held once; and the knob is not ignored (at 4 bytes some boundary is off the default 256,
    and the shards are smaller than at 1024)."""
    sizes = {}
    for align in (4, 64, 1024):
        plan = collsched.plan(PLAN_PARAMS, 3, strategy=strategy, align=align, bucket_mb=1.0)
        seen = {p["name"]: [0] * p["numel"] for p in plan["params"]}
        for b in buckets(plan, "gather"):
            for shard in b["shards"]:
                for s in shard["segments"]:
                    for i in range(s["param_offset"], s["param_offset"] + s["numel"]):
                        seen[s["param"]][i] += 1
        assert all(c == 1 for v in seen.values() for c in v), f"align {align}: an element held other than once"
        for param, shard_off, param_off, shard_bytes in offsets_in_bytes(plan):
            where = f"{strategy} align {align} {param}"
            assert shard_bytes % align == 0, f"{where}: shard of {shard_bytes} bytes"
            assert shard_off % align == 0, f"{where}: segment at byte {shard_off} of its shard"
            assert param_off % align == 0, f"{where}: cut at byte {param_off} of the parameter"
        sizes[align] = sum(b["shard_numel"] * ELEM[b["dtype"]] for b in plan["buckets"])
        if align == 4:
            off = [x for _, a, p, n in offsets_in_bytes(plan) for x in (a, p, n) if x % 256]
            assert off, f"{strategy}: at align 4 every boundary is still a multiple of 256"
    assert sizes[4] < sizes[1024], f"{strategy}: shard bytes by align {sizes}"


def test_plan_align_refuses_what_it_cannot_use():
    """An ``align`` that is not a power of two, below a parameter's element size, or above the
    limit is a ``CollschedError`` naming the value (and the dtype or rule it breaks)."""
    for align, words in ((3, ["3", "power of two"]), (2, ["2", "f32"]), (2 << 20, [str(2 << 20)])):
        with pytest.raises(collsched.CollschedError) as e:
            collsched.plan(PLAN_PARAMS, 2, align=align)
        for w in words:
            assert w in str(e.value), str(e.value)


MODULE_PARAMS = [
    {"name": "p0", "shape": [8, 4], "dtype": "f32", "module": "enc"},
    {"name": "p1", "shape": [4], "dtype": "f32", "module": "enc"},
    {"name": "p2", "shape": [4, 4], "dtype": "f32", "module": "dec"},
    {"name": "p3", "shape": [4], "dtype": "f32", "module": "dec"},
    {"name": "p4", "shape": [3], "dtype": "f32", "module": "dec"},
    # Their names say two layers; their field says one module.
    {"name": "layers.0.w", "shape": [6], "dtype": "f32", "module": "head"},
    {"name": "layers.1.w", "shape": [6], "dtype": "f32", "module": "head"},
]


def groups(plan: dict, kind: str = "gather") -> list[list[str]]:
    return [b["params"] for b in buckets(plan, kind)]


def test_plan_bucket_by_module_follows_the_module_field():
    """``bucket_by="module"``: buckets end where the parameters' ``module`` field changes (the
    field wins over the names' layers), for the gradients too; ``"size"`` packs them all into
    one; under a small cap a module is cut but no bucket holds two modules."""
    assert groups(collsched.plan(MODULE_PARAMS, 2, bucket_by="size")) == [[p["name"] for p in MODULE_PARAMS]]
    plan = collsched.plan(MODULE_PARAMS, 2, bucket_by="module")
    want = [["p0", "p1"], ["p2", "p3", "p4"], ["layers.0.w", "layers.1.w"]]
    assert groups(plan) == want and groups(plan, "grad") == want, plan["buckets"]
    assert plan["bucket_by"] == "module"
    module = {p["name"]: p["module"] for p in MODULE_PARAMS}
    small = collsched.plan(MODULE_PARAMS, 2, bucket_by="module", bucket_mb=100 / (1 << 20))
    assert len(groups(small)) > len(want), groups(small)
    for g in groups(small):
        assert len({module[n] for n in g}) == 1, f"a bucket spans modules: {g}"
    order = [n for g in groups(small) for n in g]
    assert order == [p["name"] for p in MODULE_PARAMS], order


def test_plan_bucket_by_module_from_the_names():
    """Without a ``module`` field the module is the name's layer (``enc.0`` of ``enc.0.a``);
    ``module:1`` cuts only where the first component changes."""
    params = [
        {"name": n, "shape": [4], "dtype": "f32"} for n in ("enc.0.a", "enc.0.b", "enc.1.a", "dec.0.a", "dec.0.b")
    ]
    assert groups(collsched.plan(params, 2, bucket_by="module")) == [
        ["enc.0.a", "enc.0.b"],
        ["enc.1.a"],
        ["dec.0.a", "dec.0.b"],
    ]
    assert groups(collsched.plan(params, 2, bucket_by="module:1")) == [
        ["enc.0.a", "enc.0.b", "enc.1.a"],
        ["dec.0.a", "dec.0.b"],
    ]
    with pytest.raises(collsched.CollschedError, match="layer"):
        collsched.plan(params, 2, bucket_by="layer")


# ---- the "collsched" process group ----------------------------------------------------------


def rank_values(world: int, numel: int, salt: int, small: bool) -> list[torch.Tensor]:
    return [sw.values(r, numel, salt, small) for r in range(world)]


def as_tensor(p: tuple[str, list]) -> torch.Tensor:
    dtype, vals = p
    return torch.tensor(vals, dtype=getattr(torch, dtype))


def test_allocate_tensor_as_fsdp2_reaches_it():
    """The backend FSDP2 asks (``group._get_backend(cpu)``) allocates CPU tensors of the size
    and dtype asked for, refuses other devices, and collectives from and into its tensors
    (FSDP2's in-place all-gather, a reduce-scatter, an f16 all-reduce) give what the test
    computes from every rank's input."""
    world, n = 3, 1000
    for rank, got in enumerate(run(sw.pg_allocate, world, init="collsched")):
        assert got["name"] == "collsched" and got["supports_cpu"] and not got["supports_meta"], got
        for dt, numel in (("float32", 1000), ("bfloat16", 7), ("float16", 3), ("int64", 5)):
            assert got["shapes"][dt] == ([numel], dt, True, "cpu"), (dt, got["shapes"][dt])
        assert got["empty"] == ([0], "torch.float32"), got["empty"]
        assert got["meta"].startswith("collsched.CollschedError") and "meta" in got["meta"], got["meta"]
        want = torch.cat([x.float() for x in rank_values(world, n, 1, False)])
        assert torch.equal(as_tensor(got["all_gather"]), want), f"rank {rank}: all-gather"
        want = torch.cat([x.bfloat16() for x in rank_values(world, n, 2, False)])
        assert torch.equal(as_tensor(got["all_gather_in_place"]), want), f"rank {rank}: in-place all-gather"
        total = sum(rank_values(world, n * world, 3, True))
        assert torch.equal(as_tensor(got["reduce_scatter"]), total.float().chunk(world)[rank]), f"rank {rank}"
        assert torch.equal(as_tensor(got["all_reduce"]), sum(rank_values(world, n, 4, True)).half()), f"rank {rank}"


def test_fsdp2_with_communication_buffers_from_the_process_group():
    """FSDP2 with ``set_allocate_memory_from_process_group_for_comm(True)`` gets its buffers
    from ``allocate_tensor`` and trains bit for bit as without it, and as plain PyTorch."""
    spec = {"model": "gpt", "steps": 3}
    runs = run(sw.fsdp2_allocating, 2, spec, init="collsched")
    ref = models.reference(spec, 2)
    for rank, r in enumerate(runs):
        assert r["plain"]["calls"]["n"] == 0, r["plain"]["calls"]
        assert r["allocating"]["calls"]["n"] > 0, f"rank {rank}: FSDP2 never called allocate_tensor"
        assert r["allocating"]["losses"] == r["plain"]["losses"], f"rank {rank}: losses differ"
        assert r["allocating"]["params"] == r["plain"]["params"], f"rank {rank}: parameters differ"
        for step, want in enumerate(ref["params"]):
            for n, w in want.items():
                got = torch.tensor(r["allocating"]["params"][step][n])
                torch.testing.assert_close(got, w.flatten(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_coalesced_collectives_under_the_coalescing_manager():
    """Under ``dist._coalescing_manager`` (the backend's ``allreduce_coalesced``,
    ``all_gather_single_coalesced``, ``reduce_scatter_single_coalesced``), synchronous and
    async: several sizes (1, 257, 70000 elements) in one batch, each tensor's result what the
    test computes from every rank's input, exactly (sums of small integers; gathers)."""
    world = 3
    sizes = (1, 257, 70000)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    for rank, got in enumerate(run(sw.pg_coalesced, world, init="collsched")):
        for k, n in enumerate(sizes):
            where = f"rank {rank} tensor {k} ({n} elements)"
            total = sum(rank_values(world, n, 10 + k, True))
            assert torch.equal(as_tensor(got["all_reduce"][k]), total.float()), f"{where}: all_reduce"
            if k < 2:
                avg = (sum(x.bfloat16().double() for x in rank_values(world, n, 20 + k, True)) / world).bfloat16()
                assert torch.equal(as_tensor(got["all_reduce_avg_async"][k]), avg), f"{where}: async AVG"
            want = torch.cat([x.to(dtypes[k]) for x in rank_values(world, n, 30 + k, False)])
            assert torch.equal(as_tensor(got["all_gather"][k]), want), f"{where}: all_gather"
            want = torch.cat([x.float() for x in rank_values(world, n, 40 + k, False)])
            assert torch.equal(as_tensor(got["all_gather_in_place_async"][k]), want), f"{where}: in place, async"
            total = sum(rank_values(world, n * world, 50 + k, True)).chunk(world)[rank]
            assert torch.equal(as_tensor(got["reduce_scatter_sum"][k]), total.float()), f"{where}: reduce_scatter"
            assert torch.equal(as_tensor(got["reduce_scatter_avg"][k]), (total / world).float()), f"{where}: AVG"


PREMUL_CASES = [
    # Small integers times a power of two: exact in every dtype.
    ("all_reduce", "float16", 0.25, 1000, True),
    ("all_reduce", "bfloat16", 0.5, 257, True),
    ("reduce_scatter", "float16", 0.25, 300, True),
    ("reduce_scatter", "bfloat16", 0.125, 7, True),
    ("reduce_scatter_coalesced", "bfloat16", 0.25, 64, True),
    # FSDP2's factor (1 / world) on normal values: one rounding from float64's result.
    ("all_reduce", "float16", 1 / 3, 1000, False),
    ("reduce_scatter", "bfloat16", 1 / 3, 500, False),
    ("reduce_scatter_coalesced", "float16", 1 / 3, 64, False),
    ("all_reduce", "float32", 1 / 3, 100, False),
]


def test_premul_sum_of_f16_and_bf16():
    """``dist._make_nccl_premul_sum(factor)`` (FSDP2's gradient reduction) on f16, bf16 (and
    f32): all-reduce, reduce-scatter and coalesced reduce-scatter give ``factor`` times the
    sum of every rank's input, computed here in float64 and rounded once: exact for small
    integers and a power-of-two factor, within a rounding for 1/3; a tensor factor is
    refused."""
    world = 3
    tol = {torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3), torch.float32: (1e-6, 1e-6)}
    runs = run(sw.pg_premul, world, PREMUL_CASES, init="collsched")
    for rank, got in enumerate(runs):
        assert len(got) == len(PREMUL_CASES) + 1
        for k, (op, dt, factor, numel, small) in enumerate(PREMUL_CASES):
            dtype = getattr(torch, dt)
            where = f"rank {rank} {PREMUL_CASES[k]}"
            n = numel * (world if op != "all_reduce" else 1)
            inputs = [x.to(dtype).double() for x in rank_values(world, n, 100 + k, small)]
            total = sum(inputs) * factor
            if op == "reduce_scatter":
                total = total.chunk(world)[rank]
            if op == "reduce_scatter_coalesced":
                want = torch.cat([h.chunk(world)[rank] for h in total.chunk(2)]).to(dtype)
                mine = torch.cat([as_tensor(g) for g in got[k]])
            else:
                want, mine = total.to(dtype), as_tensor(got[k])
            assert mine.dtype == dtype and mine.shape == want.shape, (where, mine.dtype, mine.shape)
            if small:
                assert torch.equal(mine, want), f"{where}: not exact"
            else:
                rtol, atol = tol[dtype]
                torch.testing.assert_close(mine, want, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}")
        refused = got[-1]
        assert refused.startswith("collsched.CollschedError") and "tensor factor" in refused, refused


def test_a_sharded_module_keeps_its_interface_and_hooks_run_around_its_forward():
    for rank, r in enumerate(run(sw.module_face, 2)):
        # The class's own forward and signature (keyword-only arguments reach it), its name.
        assert r["signature"] == r["ref_signature"] and r["signature"].startswith("(idx: 'torch.Tensor', *, scale"), r
        assert r["class"] == ("Keyed", "Keyed", True), r
        assert r["keyed"] and r["whole"], (rank, r)
        # A pre-hook registered after fully_shard sees the full parameters (collsched's runs
        # first); a forward hook registered after it runs after the release (as FSDP2's).
        assert r["hooks"] == {"pre": (6, 6), "post": r["shard"]} and len(r["shard"]) == 1, r
        # A method that reads parameters other than through forward: the shards, unless
        # registered (then it computes what the unsharded module does).
        assert "must be 2-D" in r["encode_unregistered"], r
        assert r["encode"], r
        assert "has no method 'decode'" in r["missing"] and r["missing"].startswith("collsched.CollschedError"), r
        # A forward that raises leaves nothing gathered; the next step is plain PyTorch's.
        assert r["raised"] == "builtins.ValueError: boom", r
        assert r["live_after_raise"] == 0 and r["after_step"] and r["names"], r


@pytest.mark.parametrize("mode", ["default", "keep", "release", "toggle"])
def test_reshard_after_forward_keeps_units_fetched_into_their_backward(mode):
    """``reshard_after_forward=False`` (every unit's, the root's by default as FSDP2's, or set
    between steps) keeps a unit fetched from its forward into its backward: one gather fewer
    per bucket, its buckets' memory held in between, the same training as plain PyTorch,
    nothing left after; True on the root releases it too."""
    spec = {"model": "gpt", "steps": 3, "bucket_mb": 0.002}
    runs = run(sw.resharding, 2, spec, mode)
    parity.check(runs, models.reference(spec, 2))
    for rank, r in enumerate(runs):
        plan = r["plan"]
        gather = buckets(plan, "gather")
        root = root_buckets(plan)
        assert 0 < len(root) < len(gather), plan
        for step, st in enumerate(r["stats"]):
            kept = {"default": root, "keep": gather, "release": [], "toggle": gather if step else []}[mode]
            where = f"rank {rank} step {step} ({mode})"
            assert st["all_gathers"] == 2 * len(gather) - len(kept), f"{where}: {st}"
            # Held between forward and backward: the kept buckets, and what prefetch gathered
            # ahead once a step's order is recorded (a change of the setting records anew).
            held, recording = sum(memory(plan, b) for b in kept), step == 0 or (mode == "toggle" and step == 1)
            assert r["between"][step] == held if recording else r["between"][step] >= held, f"{where}: {r['between']}"
            assert r["after"][step] == 0, f"{where}: {r['after'][step]} bytes left gathered"
        assert "reshard_after_forward=3: the parameters are sharded over 2 ranks" in r["int"], r["int"]
        assert "a factor of 2 (as FSDP2 requires): one of [1, 2]" in r["int"], r["int"]
        assert r["int_world"] == [True] * len(r["int_world"]) and len(r["int_world"]) > 2, r["int_world"]
        assert r["int_one"] == [False] * len(r["int_world"]), r["int_one"]
        assert "reshard_after_forward=0; expected" in r["zero"], r["zero"]
        assert "reshard_after_forward=3: the parameters are sharded over 2 ranks" in r["ctor_int"], r["ctor_int"]
        assert r["ctor_int_unchanged"], "a refused fully_shard left the module changed"


def test_mixed_precision_policy_casts_where_fsdp2_does(tmp_path):
    for r in run(sw.mixed_face, 2, str(tmp_path / "full.safetensors")):
        # Units compute in bf16 (their inputs cast), the root's output_dtype casts its output
        # (each module's own, as FSDP2); the optimizer's parameters, their gradients and the
        # exported values are f32.
        assert r["seen"] == {"input": "torch.bfloat16", "block_out": "torch.bfloat16"}, r
        assert r["output"] == "torch.float32", r
        assert r["params"] == r["grads"] == r["full"] == r["after_half"] == ["torch.float32"], r
        assert "save_full" in r["save_full"] and "full_state_dict" in r["save_full"], r["save_full"]
        assert r["half"].startswith("collsched.CollschedError") and "put back" in r["half"], r["half"]
        assert "mp_policy='bf16'" in r["not_a_policy"] and "MixedPrecisionPolicy" in r["not_a_policy"], r
        assert "mp_policy.param_dtype=torch.int8" in r["int_dtype"], r["int_dtype"]
        assert "differ" in r["conflict"] and r["conflict"].startswith("collsched.CollschedError"), r["conflict"]
        assert "give every unit the root's param_dtype" in r["unit_policy"], r["unit_policy"]


def test_a_pass_leaves_nothing_behind_at_its_edges():
    for r in run(sw.pass_edges, 2):
        # torch runs no forward hook after a KeyboardInterrupt: the module's call unwinds it.
        assert r["interrupted"] and r["after_interrupt"] == (0, True, 0), r
        # Kept units stay gathered across an evaluation pass: one gather per bucket in the
        # training forward, the evaluation's own, none in the backward (the first step
        # releases after the forward and gathers again in the backward).
        n = r["buckets"]
        assert r["gathers"][1:] == [n, n], r
        # A new engine after the setting changed keeps the frozen block frozen.
        assert r["frozen_same"] and r["live"] == 0, r
