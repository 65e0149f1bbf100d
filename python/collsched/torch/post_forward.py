"""FSDP2's ``reshard_after_forward`` as an int ``N`` below the shard group's size: after its
training forward a unit keeps ``1/N`` of its parameters on each rank (the piece its group of
``N`` consecutive ranks assigns it) instead of ``1/world`` or all of it, and its backward
gathers them again within that group, not across the world. The gradients are still reduced
over the whole shard group, into the usual shards.

The second layout is a library model of its own per ``N`` (``_Post``: strategy
``hybrid:N`` over the parameters of the units that ask for ``N``, none trainable), built with
the sharded model and again when a setting changes. At a unit's forward end its gathered
values are copied into that model's shards (:func:`capture`), then the unit is released as
usual; its fetches in the backward (its pre-backward, a recomputation, a saved tensor) go to
that model's engine (:func:`backward_engine`). The post-forward shards live as long as the
sharded model (FSDP2 frees them after the backward): ``1/N`` of those units' parameters per
rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .units import _tensor, library_model

if TYPE_CHECKING:
    from .shard import _State
    from .units import _Unit


class _Post:
    """The post-forward layout of the units resharded to ``size`` ranks: the library's model
    over their parameters (``index``: a parameter's id there, by the sharded model's id), its
    engine, and this rank's shard of each parameter (a tensor over library memory, with the
    flattened parameter's ``offset`` of its first element)."""

    def __init__(self, st: _State, size: int, pids: list[int]) -> None:
        self.index = {pid: i for i, pid in enumerate(pids)}
        # None trainable (the sharded model's engine takes the gradients), no values yet
        # (zeros: each forward writes what its backward gathers).
        params = [st.params[pid] for pid in pids]
        self.model = library_model(
            st.world, params, [False] * len(params), None, f"hybrid:{size}", st.opts["bucket_mb"]
        )
        self.engine = self.model.engine(*st.engine_args)
        self.shards: dict[int, tuple[torch.Tensor, int]] = {}
        for pid, i in self.index.items():
            p = st.params[pid]
            region, offset, numel = self.model.shard(i)
            self.shards[pid] = (_tensor(region, p.dtype, [numel], st.device), offset)

    def fetch(self, ids: list[int], known: Any = None) -> Any:
        return self.engine.fetch([self.index[i] for i in ids], known)

    def release(self, ids: list[int]) -> None:
        self.engine.release([self.index[i] for i in ids])


def build(st: _State) -> None:
    """The post-forward layouts of ``st``'s units (one per size asked for; none when every unit
    reshards to all ranks or to none), in place of the old ones once all are made. A unit that
    shares a parameter with another unit (a tied one) has none: its backward gathers across
    the world (the other unit may hold that parameter fetched meanwhile: one engine counts both
    uses). Collective: between steps, every rank alike."""
    made = {}
    for size in sorted({u.post for u in st.units if has_layout(u)}):
        pids = sorted({pid for u in st.units if u.post == size and has_layout(u) for pid in u.ids})
        made[size] = _Post(st, size, pids)
    st.post = made
    for u in st.units:
        u.captured = False


def has_layout(unit: _Unit) -> bool:
    """Whether ``unit`` has a post-forward layout: resharded to some ranks, and sharing no
    parameter with another unit."""
    return bool(unit.post) and not unit.shared


def capture(st: _State, unit: _Unit) -> None:
    """``unit``'s training forward is over: this rank's post-forward piece of each of its
    parameters is copied out of the gathered values before they are released (a unit with a
    tied parameter has no post-forward layout: nothing is kept)."""
    if not has_layout(unit):
        return
    post = st.post[unit.post]
    with torch.no_grad():
        for p in unit.params:
            shard, offset = post.shards[p.pid]
            if shard.numel():
                shard.copy_(p.gathered().reshape(-1)[offset : offset + shard.numel()])
    unit.captured = True


def backward_engine(st: _State, unit: _Unit) -> Any:
    """What fetches ``unit`` in the backward: its post-forward layout where this step's
    forward captured it, else the training engine (a forward under ``no_grad``, as a reentrant
    checkpoint's first one, captures nothing)."""
    return st.post[unit.post] if unit.captured else st.train


def begin_backward(st: _State) -> None:
    for post in st.post.values():
        post.engine.begin_backward()


def end_step(st: _State) -> dict[int, dict[str, Any]]:
    """Ends every post-forward engine's step (each one, the first failure raised after) and
    returns their counters by size; the units' captures are spent."""
    for u in st.units:
        u.captured = False
    own: dict[int, dict[str, Any]] = {}
    failed: BaseException | None = None
    for size, post in st.post.items():
        try:
            own[size] = post.engine.end_step()
        except BaseException as e:
            failed = failed or e
    if failed is not None:
        raise failed
    return own


def merge(stats: dict[str, Any], own: dict[int, dict[str, Any]]) -> None:
    """Adds the post-forward engines' counters (the backward's gathers within groups) to the
    training engine's ``stats``, and keeps each under ``stats["post_forward"]`` by size (the
    peak of gathered bytes is each engine's own: not added)."""
    if not own:
        return
    for s in own.values():
        for k, v in s.items():
            if k not in ("step", "peak_gathered_bytes") and isinstance(v, (int, float)):
                stats[k] = stats.get(k, 0) + v
    stats["post_forward"] = own


def live_bytes(st: _State) -> int:
    """Gathered bytes the post-forward engines hold now."""
    return sum(int(post.engine.live_bytes) for post in st.post.values())
