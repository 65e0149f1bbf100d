"""What the benchmarks' ranks tell each other (paths, results), as JSON in uint8 tensors:
torch.distributed's ``*_object`` collectives need numpy, which a plain ``pip install torch``
does not bring."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serializable), in rank order. Collective (over ``group``,
    the default group when ``None``)."""
    data = json.dumps(obj).encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    most = max(int(s.item()) for s in sizes)
    mine = torch.zeros(most, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    every = [torch.zeros(most, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(every, mine, group=group)
    return [json.loads(bytes(t[: int(s.item())].tolist())) for t, s in zip(every, sizes)]


def from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank. Collective."""
    return all_gather_json(obj if dist.get_rank() == 0 else None)[0]
