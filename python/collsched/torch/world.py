"""Joining the job: :func:`init` makes this process's rank of the ``shm`` backend (through
torch.distributed's store when it is initialized, else from the launcher's environment), of
an MPI job, or of the ``cuda`` backend (one GPU per process, NCCL); every part of
``collsched.torch`` (``fully_shard``, checkpoints, the ``"collsched"`` process group, which is
CPU-only) uses that one world."""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from .. import _native
from .._native import CollschedError

_WORLD: Any = None
# The backend ``_WORLD`` was made on ("shm", "mpi", "cuda" or "emulated").
_BACKEND: str | None = None
# The job key the ranks agreed on through torch.distributed's store (group_world's base).
_JOB: str | None = None
# The CUDA stream a cuda world computes on (torch's current stream at init), kept alive.
_STREAM: Any = None
# The ``hybrid_group_size`` a cuda world was made with (its groups' communicators), or None.
CUDA_GROUP_SIZE: int | None = None
_TO_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def init(backend: str | None = None, *, hybrid_group_size: Any = None) -> Any:
    """Joins this process's job as its rank (collective: every rank calls it). Idempotent:
    once joined, it returns that world; a ``backend`` named that differs from the one joined
    (an earlier ``init``, or a ``"collsched"`` process group, which joins on ``"shm"``) is
    refused. ``None`` (the default): the world joined already, else ``"shm"``.

    When ``torch.distributed`` is initialized, rank and world come from it and the ranks agree
    on a job key through its store (no second rendezvous, no port); otherwise from the
    launcher's environment (torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, or Open
    MPI's). A process group on the ``"collsched"`` backend made the world already: it is
    reused. ``backend``: ``"shm"`` (processes of one machine, CPU tensors), ``"mpi"`` (the
    processes of the MPI job ``mpirun`` started, on one machine or many, CPU tensors; a
    package built with the ``mpi`` feature, ``collsched._native.HAS_MPI``) or ``"cuda"``
    (one GPU per process: device ``LOCAL_RANK``, made current here; the ranks meet through
    torch.distributed's store when it is initialized, and may then span machines, else
    through the hub of one machine;
    collectives through NCCL on the library's streams, computation on torch's current stream
    at this call, which ``fully_shard``'s hooks wait on instead of blocking the host;
    ``collsched._native.HAS_CUDA``). ``hybrid_group_size``: on ``"cuda"``, the ``G`` of the
    ``"hybrid:G"`` strategy the models of this world will use (NCCL makes the groups'
    communicators at init, on every rank alike). ``"emulated"``: the shm backend seen as a
    device backend (``collsched._native.World.emulated``): CPU tensors, but ``fully_shard``
    takes the paths it takes on ``"cuda"`` (gradients given in the reduction dtype and packed
    on the compute stream, reduced shards in library memory that is never read as host
    memory, ``no_sync`` accumulating beside the library), so that its tests run them on the CPU.
    """
    global _WORLD, _BACKEND
    if _WORLD is not None:
        if backend is not None and backend != _BACKEND:
            raise CollschedError(
                f"init(backend={backend!r}): this process joined its job on {_BACKEND!r} already (an earlier "
                "init, or init_process_group('collsched'), which joins on 'shm'); call init with that backend, "
                f"or call init({backend!r}) first"
            )
        return _WORLD
    backend = backend or "shm"
    if backend not in ("shm", "mpi", "cuda", "emulated"):
        raise CollschedError(
            f"init(backend={backend!r}): the backends are 'shm' (ranks as processes of one machine), 'mpi' "
            "(the processes of an MPI job), both on CPU tensors, 'cuda' (one GPU per process), and 'emulated' "
            "(shm seen as a device, for tests)"
        )
    # Read only once _WORLD is set, which every return below does.
    _BACKEND = backend
    import torch.distributed as dist

    if backend == "cuda":
        global CUDA_GROUP_SIZE
        _WORLD = _join_cuda(hybrid_group_size)
        CUDA_GROUP_SIZE = None if hybrid_group_size is None else int(hybrid_group_size)
        return _WORLD

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

    make = _native.World.emulated if backend == "emulated" else _native.World
    if dist.is_available() and dist.is_initialized():
        store = dist.distributed_c10d._get_default_store()
        rank, size = dist.get_rank(), dist.get_world_size()
        _WORLD = make(rank, size, _job_key(store, rank, size, backend))
    else:
        _WORLD = make()
    return _WORLD


def _job_key(store: Any, rank: int, size: int, what: str) -> str:
    """The job key rank 0 puts in torch's ``store`` (collective); refuses a job that spans
    machines (``what`` names the backend)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and local.strip().isdigit() and int(local) != size:
        raise CollschedError(
            f"init: the {what} backend needs every rank on one machine; this job has {size} ranks, "
            f"{local} on this machine (LOCAL_WORLD_SIZE)"
        )
    global _JOB
    key = "collsched/job"
    if rank == 0:
        store.set(key, f"torch-{uuid.uuid4().hex}")
    _JOB = store.get(key).decode()
    return _JOB


def _join_through(store: Any, rank: int, size: int, timeout: float | None = None) -> Any:
    """A world joined with a job key rank 0 puts in torch's ``store`` (collective)."""
    return _native.World(rank, size, _job_key(store, rank, size, "shm"), timeout)


def hybrid_groups(size: int, group_size: int) -> list[list[int]]:
    """The rank groups of ``"hybrid:G"`` sharding over ``size`` ranks: the shard groups
    (``G`` consecutive ranks each), then the replica groups (the ranks at one position of every
    shard group)."""
    if group_size < 1 or size % group_size:
        raise CollschedError(
            f"hybrid_group_size {group_size}: it must divide the world size {size} (hybrid:G shards over groups "
            "of G consecutive ranks)"
        )
    n = size // group_size
    shard = [[b * group_size + i for i in range(group_size)] for b in range(n)]
    replica = [[b * group_size + i for b in range(n)] for i in range(group_size)]
    return [g for g in shard + replica if len(g) < size]


class StoreExchange:
    """The job's small exchanges through torch.distributed's ``store``, which every machine of
    the job reaches: a call with this rank's bytes returns every rank's, in rank order
    (collective; each call is one round of keys under ``collsched/x/``). A rank's key of a round
    is deleted once every rank wrote the next (each read it before): the store keeps the last
    round's alone."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank, self.size, self.round = store, rank, size, 0

    def key(self, round: int, rank: int) -> str:
        return f"collsched/x/{round}/{rank}"

    def __call__(self, data: bytes) -> list[bytes]:
        self.round += 1
        # A marker byte: a store's value is never empty.
        self.store.set(self.key(self.round, self.rank), b"v" + bytes(data))
        out = [bytes(self.store.get(self.key(self.round, r)))[1:] for r in range(self.size)]
        if self.round > 1:
            self.store.delete_key(self.key(self.round - 1, self.rank))
        return out


def _join_cuda(group_size: Any) -> Any:
    """This process's rank of the cuda backend (collective): through torch.distributed's store
    when it is initialized (the job may span machines), else through the hub of this machine
    from the launcher's environment."""
    global _STREAM
    import torch.distributed as dist

    if not _native.HAS_CUDA:
        raise CollschedError(
            "init(backend='cuda'): this collsched package was built without the cuda backend; rebuild it with "
            "MATURIN_PEP517_ARGS='--features cuda' pip install ./python"
        )
    if not torch.cuda.is_available():
        raise CollschedError(
            "init(backend='cuda'): torch sees no CUDA device (torch.cuda.is_available() is False); "
            "use backend='shm' for CPU tensors"
        )
    exchange = None
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        exchange = StoreExchange(dist.distributed_c10d._get_default_store(), rank, size)
        args: tuple = (rank, size, None)
    else:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        args = (None, None, None)
    # NVRTC and NCCL from torch's own nvidia-* wheels (the NCCL torch runs on), unless the
    # environment names a place: the loader searches this site's nvidia/*/lib folders.
    os.environ.setdefault("COLLSCHED_CUDA_SEARCH", os.path.dirname(os.path.dirname(torch.__file__)))
    device = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
    torch.cuda.set_device(device)
    _STREAM = torch.cuda.current_stream()
    groups = [] if group_size is None else hybrid_groups(size, int(group_size))
    return _native.World.cuda(device, _STREAM.cuda_stream, *args, groups, exchange=exchange)


def adopt(store: Any, rank: int, size: int, timeout: float | None = None) -> Any:
    """The world of a ``"collsched"`` process group of ``size`` ranks whose rank this process
    is: the one :func:`init` joined if it did (it must be the same job), else a new one joined
    through ``store``, which :func:`init` then returns; its members wait ``timeout`` seconds
    for each other (the group's, unless ``COLLSCHED_TIMEOUT_SECS`` is set)."""
    global _WORLD, _BACKEND
    if _WORLD is None:
        _WORLD = _join_through(store, rank, size, timeout)
        _BACKEND = "shm"
    elif (_WORLD.rank, _WORLD.world) != (rank, size):
        raise CollschedError(
            f"init_process_group('collsched'): this process is rank {_WORLD.rank} of {_WORLD.world} in the job "
            f"collsched.torch.init() joined, but torch.distributed makes it rank {rank} of {size}"
        )
    return _WORLD


# The worlds over parts of the job (group_world), by their ranks in the job.
_GROUPS: dict[tuple[int, ...], Any] = {}


def group_world(ranks: list[int]) -> Any:
    """A world of the ``shm`` backend whose ranks are the job's ``ranks`` (in that order; this
    process among them): what a model sharded over a part of the job (a DeviceMesh beside
    pipeline or tensor parallelism) runs on. The job's own world when ``ranks`` are all of
    it. Collective over ``ranks``: each of them calls it (once, the first time; made once per
    set of ranks and reused). Its job key is the job's with a hash of the ranks, so no exchange
    is needed and two parts never meet."""
    w = world()
    ranks = [int(r) for r in ranks]
    if ranks == list(range(w.world)):
        return w
    key = tuple(ranks)
    if key in _GROUPS:
        return _GROUPS[key]
    if len(set(ranks)) != len(ranks) or not all(0 <= r < w.world for r in ranks) or w.rank not in ranks:
        raise CollschedError(
            f"a model over ranks {ranks} of the job's {w.world}: give distinct ranks of the job, this rank "
            f"({w.rank}) among them"
        )
    if w.kind == "cuda" or _JOB is None:
        raise CollschedError(
            f"a model over ranks {ranks} of the job's {w.world}: a world over part of the job is made on the "
            "shm backend from the job key its ranks agreed on through torch.distributed's store (this job's "
            f"world is {'cuda' if w.kind == 'cuda' else 'an MPI job or one joined from the launcher environment'}); "
            "shard over the whole job, or initialize torch.distributed before collsched.torch.init()"
        )
    make = _native.World.emulated if w.kind == "emulated" else _native.World
    import hashlib

    part = hashlib.sha1(",".join(map(str, ranks)).encode()).hexdigest()[:16]
    sub = make(ranks.index(w.rank), len(ranks), f"{_JOB}-g{part}")
    _GROUPS[key] = sub
    return sub


def world_of(part: tuple[int, ...] | None) -> Any:
    """The world of a model over ``part`` (the job's ranks :func:`group_world` made a world
    of), or the job's (None). Models keep the ranks, not the world: only this module holds
    worlds, so that they are dropped at exit (an MPI world's drop finalizes MPI)."""
    return world() if part is None else _GROUPS[part]


def world() -> Any:
    """The world :func:`init` joined (raises if it was not called)."""
    if _WORLD is None:
        raise CollschedError("collsched.torch.init() was not called: call it on every rank first")
    return _WORLD


def memory_stats() -> dict[str, int]:
    """This rank's device memory in collsched's own pool (the ``cuda`` backend), which torch's
    ``torch.cuda.memory_reserved()`` and ``memory_allocated()`` do not count: ``reserved_bytes``
    (every block got from the driver), ``in_use_bytes`` (shards, gathered buckets, gradients,
    scratch), ``deferred_bytes`` (given back, their work not yet seen complete), ``free_bytes``
    (cached for reuse; :func:`empty_cache` returns them) and ``fresh_allocations``. An empty
    dict on the host backends (``shm``, ``mpi``, ``emulated``: host memory). Not collective."""
    stats = world().memory_stats()
    return {} if stats is None else dict(stats)


def empty_cache() -> int:
    """Returns this rank's cached free blocks of collsched's device pool to the driver, as
    ``torch.cuda.empty_cache()`` does torch's (call both to give a GPU's idle memory back);
    blocks in use stay. It first waits for the work queued on the library's streams (at most
    the backend's timeout; if that work does not end, nothing is returned and it raises); the
    driver's free then waits for the whole GPU, torch's work included, as torch's own does.
    Returns the bytes returned (0 on the host backends). Not collective; between steps."""
    return world().empty_cache()


def flight_record(path: Any = None, reason: str = "requested") -> dict:
    """This rank's flight record: its last collectives (``COLLSCHED_FLIGHT_ENTRIES``, default
    2000), each with its sequence number on its (group, stream), op, bucket (tag), group, bytes,
    dtype, stream, state (launched, started, completed, failed) and times, as a dict; and on a
    host backend the sharded models' compute (``"compute"``: each unit's forward and backward
    spans, ``spans.py``), which ``collsched flight PATH --trace-out`` draws beside them. With
    ``path`` (a directory), also written there as ``rank-R.json``; ``collsched flight PATH``
    reads every rank's and says what went wrong. Not collective: call it on any rank, any time
    (a hang's watchdog, an exception handler). ``COLLSCHED_FLIGHT_RECORDER=DIR`` has every rank
    write its record there by itself when a collective fails."""
    import json

    from .spans import recorded

    text = world().flight_record(reason, None if path is None else os.fspath(path), recorded())
    return json.loads(text)
