"""Joining the job: :func:`init` makes this process's rank of the ``shm`` backend (through
torch.distributed's store when it is initialized, else from the launcher's environment);
every part of ``collsched.torch`` (``fully_shard``, checkpoints, the ``"collsched"`` process
group) uses that one world."""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from .. import _native
from .._native import CollschedError

_WORLD: Any = None
_TO_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def init(backend: str = "shm") -> Any:
    """Joins this process's job as its rank (collective: every rank calls it). Idempotent.

    When ``torch.distributed`` is initialized, rank and world come from it and the ranks agree
    on a job key through its store (no second rendezvous, no port); otherwise from the
    launcher's environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, or Open
    MPI's). A process group on the ``"collsched"`` backend made the world already: it is
    reused. ``backend``: ``"shm"`` (processes of one machine, CPU tensors) or ``"mpi"`` (the
    processes of the MPI job ``mpirun`` started, on one machine or many, CPU tensors; a
    package built with the ``mpi`` feature, ``collsched._native.HAS_MPI``).
    """
    global _WORLD
    if _WORLD is not None:
        return _WORLD
    if backend not in ("shm", "mpi"):
        raise CollschedError(
            f"init(backend={backend!r}): the backends are 'shm' (ranks as processes of one machine) and 'mpi' "
            "(the processes of an MPI job); both on CPU tensors"
        )
    import torch.distributed as dist

    if backend == "mpi":
        w = _native.World.mpi()
        if (
            dist.is_available()
            and dist.is_initialized()
            and (dist.get_rank(), dist.get_world_size())
            != (
                w.rank,
                w.world,
            )
        ):
            raise CollschedError(
                f"init(backend='mpi'): MPI makes this process rank {w.rank} of {w.world}, torch.distributed "
                f"rank {dist.get_rank()} of {dist.get_world_size()}: start both from the same mpirun job"
            )
        _WORLD = w
        return _WORLD

    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        _WORLD = _join_through(store, dist.get_rank(), dist.get_world_size())
    else:
        _WORLD = _native.World()
    return _WORLD


def _join_through(store: Any, rank: int, size: int) -> Any:
    """A world joined with a job key rank 0 puts in torch's ``store`` (collective)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdigit() and int(local) != size:
        raise CollschedError(
            f"init: the shm backend needs every rank on one machine; this job has {size} ranks, "
            f"{local} on this machine (LOCAL_WORLD_SIZE)"
        )
    key = "collsched/job"
    if rank == 0:
        store.set(key, f"torch-{uuid.uuid4().hex}")
    job = store.get(key).decode()
    return _native.World(rank, size, job)


def adopt(store: Any, rank: int, size: int) -> Any:
    """The world of a ``"collsched"`` process group of ``size`` ranks whose rank this process
    is: the one :func:`init` joined if it did (it must be the same job), else a new one joined
    through ``store``, which :func:`init` then returns."""
    global _WORLD
    if _WORLD is None:
        _WORLD = _join_through(store, rank, size)
    elif (_WORLD.rank, _WORLD.world) != (rank, size):
        raise CollschedError(
            f"init_process_group('collsched'): this process is rank {_WORLD.rank} of {_WORLD.world} in the job "
            f"collsched.torch.init() joined, but torch.distributed makes it rank {rank} of {size}"
        )
    return _WORLD


def world() -> Any:
    """The world :func:`init` joined (raises if it was not called)."""
    if _WORLD is None:
        raise CollschedError("collsched.torch.init() was not called: call it on every rank first")
    return _WORLD


def flight_record(path: Any = None, reason: str = "requested") -> dict:
    """This rank's flight record: its last collectives (``COLLSCHED_FLIGHT_ENTRIES``, default
    2000), each with its sequence number on its (group, stream), op, bucket (tag), group, bytes,
    dtype, stream, state (launched, started, completed, failed) and times, as a dict. With
    ``path`` (a directory), also written there as ``rank-R.json``; ``collsched flight PATH``
    reads every rank's and says what went wrong. Not collective: call it on any rank, any time
    (a hang's watchdog, an exception handler). ``COLLSCHED_FLIGHT_RECORDER=DIR`` has every rank
    write its record there by itself when a collective fails."""
    import json

    text = world().flight_record(reason, None if path is None else os.fspath(path))
    return json.loads(text)
