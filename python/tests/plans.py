"""The plan JSON a parameter list must give, worked out from the documented rules (the rustdoc
of ``collsched_buckets``'s layouts and strategies, ``schedule::plan``'s op table and
``schedule::plan::json``'s format), for buckets by size with EvenSplit, Flat and Hybrid.
Nothing here uses collsched: the tests compare the library's plan with this."""

from __future__ import annotations

import math
from typing import Any

SIZE = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2}


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _group_size(strategy: str, world: int) -> int:
    return int(strategy.split(":")[1]) if strategy.startswith("hybrid:") else world


def _groups_of_params(params: list[dict[str, Any]], cap: int) -> list[list[dict[str, Any]]]:
    """Buckets by size: one open bucket per dtype; a parameter joins its dtype's open bucket
    when the bucket's bytes stay within the cap, else opens the next one. Numbered by their
    first parameter."""
    buckets: list[list[dict[str, Any]]] = []
    open_: dict[str, tuple[int, int]] = {}  # dtype -> (bucket index, bytes)
    for p in params:
        nbytes = p["numel"] * SIZE[p["dtype"]]
        at = open_.get(p["dtype"])
        if at is not None and at[1] + nbytes <= cap:
            buckets[at[0]].append(p)
            open_[p["dtype"]] = (at[0], at[1] + nbytes)
        else:
            open_[p["dtype"]] = (len(buckets), nbytes)
            buckets.append([p])
    return buckets


def _even(ps: list[dict[str, Any]], g: int, ae: int) -> tuple[int, list[list[tuple[str, int, int, int]]]]:
    """EvenSplit over ``g`` positions: each parameter in ``g`` chunks of ``ceil(n / g)``
    elements (aligned), one per position, the chunks of a shard one after another. Returns the
    shard's elements and per position its segments ``(param, param_offset, numel,
    shard_offset)``."""
    segs: list[list[tuple[str, int, int, int]]] = [[] for _ in range(g)]
    slot = 0
    for p in ps:
        chunk = _align_up(-(-p["numel"] // g), ae)
        for q in range(g):
            lo, hi = q * chunk, min((q + 1) * chunk, p["numel"])
            if lo < hi:
                segs[q].append((p["name"], lo, hi - lo, slot))
        slot += chunk
    return slot, segs


def _flat(ps: list[dict[str, Any]], starts: list[int], shard: int, g: int) -> list[list[tuple[str, int, int, int]]]:
    """Flat: the parameters at ``starts`` of one concatenation, position ``q`` holding its
    elements ``[q * shard, (q + 1) * shard)``."""
    segs: list[list[tuple[str, int, int, int]]] = [[] for _ in range(g)]
    for q in range(g):
        lo, hi = q * shard, (q + 1) * shard
        for p, s in zip(ps, starts):
            a, b = max(s, lo), min(s + p["numel"], hi)
            if a < b:
                segs[q].append((p["name"], a - s, b - a, a - lo))
    return segs


def _bucket(bid: int, kind: str, ps: list[dict[str, Any]], shard: int, segs: list, world: int) -> dict[str, Any]:
    g = len(segs)
    return {
        "id": bid,
        "kind": kind,
        "dtype": ps[0]["dtype"],
        "params": [p["name"] for p in ps],
        "shard_numel": shard,
        "shards": [
            {
                "rank": r,
                "segments": [
                    {"param": n, "param_offset": o, "numel": k, "shard_offset": at} for n, o, k, at in segs[r % g]
                ],
            }
            for r in range(world)
        ],
    }


def expected(params: list[dict[str, Any]], world: int, strategy: str, bucket_mb: float, align: int) -> dict:
    """The plan JSON (less its fingerprint) of ``params`` (the parameter file's entries) at
    ``world`` ranks with ``strategy`` (``even``, ``flat`` or ``hybrid:G``), the bucket cap
    ``bucket_mb`` MiB (rounded to the nearest byte) and shard offsets aligned to ``align``
    bytes."""
    assert strategy == "even" or strategy == "flat" or strategy.startswith("hybrid:"), strategy
    g = _group_size(strategy, world)
    specs = [
        {
            "name": p["name"],
            "numel": math.prod(p["shape"]),
            "dtype": p["dtype"],
            "trainable": p.get("trainable", True),
        }
        for p in params
    ]
    cap = round(bucket_mb * 2**20)
    gathers = _groups_of_params(specs, cap)
    buckets, grads = [], []
    for bid, ps in enumerate(gathers):
        ae = align // SIZE[ps[0]["dtype"]]
        live = [p for p in ps if p["trainable"]]
        if strategy == "flat":
            # Each parameter starts aligned; the concatenation is split in g equal shards.
            # The gradient bucket keeps the gather bucket's concatenation, frozen ones as holes.
            starts, at = [], 0
            for p in ps:
                starts.append(at)
                at = _align_up(at + p["numel"], ae)
            shard = _align_up(-(-at // g), ae)
            buckets.append(_bucket(bid, "gather", ps, shard, _flat(ps, starts, shard, g), world))
            if live:
                kept = [s for p, s in zip(ps, starts) if p["trainable"]]
                grads.append((live, shard, _flat(live, kept, shard, g)))
        else:
            shard, segs = _even(ps, g, ae)
            buckets.append(_bucket(bid, "gather", ps, shard, segs, world))
            if live:
                grads.append((live, *_even(live, g, ae)))
    for live, shard, segs in grads:
        buckets.append(_bucket(len(buckets), "grad", live, shard, segs, world))
    blocks = [list(range(k * g, (k + 1) * g)) for k in range(world // g)]
    across = [list(range(i, world, g)) for i in range(g)] if world > g else []
    ops = []
    for b in buckets:
        nbytes = b["shard_numel"] * SIZE[b["dtype"]]
        if b["kind"] == "gather":
            ops += [{"kind": "all_gather", "bucket": b["id"], "group": grp, "bytes_per_rank": nbytes} for grp in blocks]
        else:
            ops += [
                {"kind": "reduce_scatter", "bucket": b["id"], "group": grp, "bytes_per_rank": nbytes} for grp in blocks
            ]
            ops += [{"kind": "all_reduce", "bucket": b["id"], "group": grp, "bytes_per_rank": nbytes} for grp in across]
    return {"world": world, "strategy": strategy, "params": specs, "buckets": buckets, "ops": ops}
