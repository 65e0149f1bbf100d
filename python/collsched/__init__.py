"""collsched: coalesced all-gather / reduce-scatter plans and their scheduling for sharded
data-parallel training.

``collsched.plan(params, world, ...)`` returns a model's plan (the structure
``collsched plan --json`` prints); ``collsched.torch`` shards PyTorch modules the way FSDP2's
``fully_shard`` does, on collsched's runtime.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from ._native import CollschedError, MismatchError, PeerError, plan_json
from ._native import bench as _bench

__all__ = ["CollschedError", "MismatchError", "PeerError", "bench", "params_json", "plan"]

_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _dtype_name(dtype: Any) -> str:
    text = str(dtype).removeprefix("torch.")
    return _DTYPES.get(text, text)


def params_json(params: Any) -> str:
    """The parameter file's text (``{"params": [...]}``) of ``params``: a ``torch.nn.Module``
    (its named parameters), a list of dicts with ``name``, ``shape``, ``dtype`` and optionally
    ``trainable`` and ``module``, or a list of ``(name, shape, dtype)`` tuples."""
    if hasattr(params, "named_parameters"):
        entries = [
            {
                "name": n,
                "shape": list(p.shape),
                "dtype": _dtype_name(p.dtype),
                "trainable": bool(p.requires_grad),
            }
            for n, p in params.named_parameters()
        ]
    elif isinstance(params, Iterable):
        entries = []
        for e in params:
            if isinstance(e, Mapping):
                d = dict(e)
                d["dtype"] = _dtype_name(d.get("dtype", "f32"))
                d["shape"] = list(d.get("shape", []))
                entries.append(d)
            else:
                name, shape, dtype = e
                entries.append({"name": name, "shape": list(shape), "dtype": _dtype_name(dtype)})
    else:
        raise CollschedError(f"plan: expected a module or a list of parameters, got {type(params).__name__}")
    return json.dumps({"params": entries})


def plan(
    params: Any,
    world: int,
    *,
    strategy: str = "even",
    bucket_mb: float = 64.0,
    align: int = 256,
    bucket_by: str = "size",
) -> dict:
    """The coalesced plan of ``params`` for ``world`` ranks: the structure ``collsched plan
    --json`` prints (``world``, ``strategy``, ``fingerprint``, ``params``, ``buckets`` with each
    rank's shard segments, ``ops``).

    ``strategy``: ``even``, ``flat``, ``greedy`` or ``hybrid:G``; ``bucket_mb``: cap on a
    bucket's bytes in MiB; ``align``: shard alignment in bytes; ``bucket_by``: ``size`` or
    ``module[:D][+pack]``. Raises ``CollschedError`` naming the parameter or knob at fault.
    """
    if not isinstance(world, int) or isinstance(world, bool) or world < 0:
        raise CollschedError(f"plan: world must be a positive number of ranks, got {world!r}")
    text = plan_json(params_json(params), world, strategy, float(bucket_mb), align, bucket_by)
    return json.loads(text)


def bench(op: str, ranks: int, **kw: Any) -> list[dict]:
    """Measures a collective over ``ranks`` threads of this process, as ``collsched bench``
    does, on ``backend="local"`` (host memory) or ``"cuda"`` (a thread per GPU, NCCL); one
    dict per size (``bytes``, ``time_us``, ``algbw``, ``busbw``, ``wrong`` with
    ``check=True``, ``memcpy``: this machine's single-thread host copy in GB/s). Keywords:
    ``min_bytes``, ``max_bytes`` (32 MiB each), ``factor`` (2), ``dtype`` (``"f32"``),
    ``iters`` (20), ``warmup`` (5), ``check`` (False), ``coalesce`` (1), ``inflight`` (2:
    iterations each rank keeps in flight; 1 times each collective alone), ``backend``
    (``"local"``)."""
    return _bench(op, ranks, **kw)
