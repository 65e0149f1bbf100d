"""The face of a sharded module: ``fully_shard`` (which makes a module a unit, and a root a
sharded model, ``_State``), the methods FSDP2 users call on it (``no_sync``,
``set_requires_gradient_sync``, prefetch lists, ``refresh_trainable``), and the whole-model
functions (``stats``, ``full_parameters``, ``plan``, ``live_bytes``)."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from .._native import CollschedError
from . import optim_state, state_dict, values
from . import post_forward as post_
from . import tp as tp_
from .build import after_forward, divides, set_reshard
from .compat import Fsdp2Methods, Fsdp2StateView, _state_of, settle_sync
from .shard import _State
from .world import _FROM_TORCH, _TO_TORCH


class CollschedModule(Fsdp2Methods, FSDPModule):
    """Mixed into every module given to :func:`fully_shard` (as FSDP2 does): the methods FSDP2
    users call on a sharded module. The module keeps its class's name, its own ``forward``
    and its signature (what Hugging Face's ``generate``, the Trainer and ``torch.export``
    read): hooks run the unit's fetch and release around it (``_pre_forward``,
    ``_post_forward``). It is an ``FSDPModule`` (every public method of which it has), so
    code that drives FSDP2's modules by their methods drives it too:
    ``torch.distributed.pipelining`` defers a stage's gradient reduction to the schedule's
    end (``set_manual_backward_finalization``, ``finalize_backward``) and unshards and
    reshards stages, the Trainer reshards before making the optimizer. Of FSDP2's internal
    state it has the communication context alone (``_get_fsdp_state``)."""

    _collsched_unit = True

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # FSDP2's ``__new__`` makes the original class; a sharded class is made as any module.
        return object.__new__(cls)

    def _get_fsdp_state(self) -> Fsdp2StateView:
        """FSDP2's internal state, of which collsched keeps the communication context alone
        (:class:`Fsdp2StateView`: what ``share_comm_ctx`` and ``torch.distributed.pipelining``
        read); any other part of it is refused by name."""
        view = self.__dict__.get("_collsched_fsdp_view")
        if view is None:
            view = self.__dict__["_collsched_fsdp_view"] = Fsdp2StateView(self)
        return view

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """torch's call, and for what its hooks miss (torch runs an ``always_call`` hook after an
        ``Exception``, not after a ``KeyboardInterrupt`` or ``SystemExit``): the forwards this
        call began are unwound as raised ones, leaving nothing fetched."""
        state: _State | None = self.__dict__.get("_collsched_state")
        depth = 0 if state is None else len(state.frames)
        try:
            return super()._call_impl(*args, **kwargs)  # type: ignore[misc]
        except Exception:
            raise
        except BaseException:
            while state is not None and len(state.frames) > depth:
                state.post_forward(state.frames[-1].module, None)
            raise

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``module.to()``, ``.half()``, ``.share_memory()``, ...: a conversion that keeps the
        shards where they are (the same dtype and device) changes nothing; one that would move
        a shard out of collsched's memory is undone and raises (the gathers would go on
        reading the old values while the optimizer updated the copy)."""
        # Past FSDPModule's (FSDP2's state): the module's own class's, or torch's.
        out = super(FSDPModule, self)._apply(fn, recurse)  # type: ignore[misc]
        state: _State | None = self.__dict__.get("_collsched_state")
        if state is not None and state.model is not None:
            state.check_shards_in_place(type(self).__name__)
        return out

    def to_empty(self, *, device: Any, recurse: bool = True) -> Any:
        """``nn.Module.to_empty`` (after building on the meta device and sharding): the shards
        live in collsched's memory already and stay (their values come from a load); buffers,
        and parameters outside the sharded model, are made empty on ``device``."""
        state: _State | None = self.__dict__.get("_collsched_state")
        if state is None:
            return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]
        state.emptying = True
        try:
            return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]
        finally:
            state.emptying = False
            # Values may be written into the shards from here on (init_weights): a root's
            # build over this model gathers them.
            state.meta = False

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward passes accumulate gradients locally and reduce nothing, until a
        backward with ``True`` reduces everything (FSDP2's spelling of ``no_sync``; as FSDP2's,
        it sets ``set_requires_all_reduce`` too). The flag is the sharded model's, whichever
        of its units it is set on, before or after the root's call (``recurse`` is taken for
        FSDP2's signature: one unit's gradients cannot be synchronized apart from the rest)."""
        state = _state_of(self)
        state.grad_sync = state.all_reduce = bool(requires_gradient_sync)
        settle_sync(state)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the first one after reduces
        (unless ``set_requires_gradient_sync(False)`` or ``set_requires_all_reduce(False)``
        says otherwise by then)."""
        state = _state_of(self)
        state.no_sync_depth += 1
        settle_sync(state)
        try:
            yield
        finally:
            state.no_sync_depth -= 1
            settle_sync(state)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Whether this unit (and, with ``recurse``, the units under it) is released after its
        training forward (True) or kept fetched into its backward (False: no second gather,
        its full parameters held meanwhile), or an int ``N``, as ``fully_shard``'s (``1/N`` of
        its parameters kept per rank, gathered within ``N`` ranks in the backward; refused,
        for the whole call, where a unit of a ``fully_shard([...])`` list is among them). FSDP2's
        method of the same name. Between steps, and
        collective where it changes the setting: every rank calls it alike (the training engine is
        made anew, which exchanges the plan's fingerprint)."""
        if reshard_after_forward is None:
            raise CollschedError(
                "set_reshard_after_forward(None): give True, False or a number of ranks (None, fully_shard's "
                "default, is False on the root and True elsewhere)"
            )
        flag = _reshard_flag(reshard_after_forward, "set_reshard_after_forward")
        state = _state_of(self)  # type: ignore[arg-type]
        want = after_forward(flag, state, "set_reshard_after_forward")
        units = _units_under(self, state, recurse)
        if not isinstance(want, bool) and any(len(u.members) > 1 for u in units):
            raise CollschedError(
                f"set_reshard_after_forward({reshard_after_forward}): a unit of a fully_shard([...]) list takes True "
                "or False (an int layout is made for one module's unit)"
            )
        before = [(u.reshard, u.post) for u in units]
        for u in units:
            set_reshard(u, want)
        if all((u.reshard, u.post) == b for u, b in zip(units, before)):
            return
        if state.model is not None:
            try:
                # The order of the fetches changes: the trace prefetch records it again; the
                # post-forward layouts are made for the new settings (kept as they were on failure).
                state.retrace("set_reshard_after_forward")
                post_.build(state)
            except BaseException:
                for u, (reshard, post) in zip(units, before):
                    u.reshard, u.post = reshard, post
                raise
        for u in units:
            u.module.__dict__["_collsched_reshard"] = want

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """FSDP2's ``unshard``: between steps, gathers this unit's parameters and puts them in
        its modules (``module.weight`` is then the full value, to read: writes to it are not
        kept) until :meth:`reshard` or the next forward, which releases them first (a pass
        gathers on its own schedule). Inside a pass it does nothing: the schedule's prefetch
        gathers ahead (make optimizers from the shards, not while unsharded). Collective:
        every rank calls it. ``async_op=True`` returns an
        :class:`UnshardHandle` whose ``wait()`` returns at once (the gather ran in the call)."""
        _root_state(self).unshard(self.__dict__["_collsched_u"])  # type: ignore[arg-type]
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """FSDP2's ``reshard``: releases what :meth:`unshard` gathered, or what
        ``set_reshard_after_backward(False)`` held since the last backward (its shards back in
        its modules); nothing otherwise. Call it on every rank alike: a unit released on some
        ranks only is gathered by the next forward on those alone."""
        _root_state(self).reshard(self.__dict__["_collsched_u"])  # type: ignore[arg-type]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """FSDP2's method, taken for its signature: every backward here hands its gradients over
        and waits for their reductions at its end, last or not (accumulate with ``no_sync`` or
        ``set_requires_gradient_sync(False)``), so nothing is kept."""
        _state_of(self)  # (refused on a module collsched has not sharded)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's method: whether this unit (and, with ``recurse``, the units under it) is
        released after its backward (True, the default) or kept fetched, its full parameters
        in its modules, into the next forward (False: that forward gathers nothing for it; its
        buckets' memory held in between). Kept only across a backward that does not
        synchronize (``no_sync``, ``set_requires_gradient_sync(False)``): after a synchronized
        one the optimizer may step, so the unit is released and the next forward gathers the
        new values (FSDP2 would keep the old ones). ``reshard()`` (on every rank alike),
        ``save_checkpoint``, ``load_checkpoint``, ``full_state_dict`` and ``save_full`` release
        what is held; ``state_dict()`` and ``load_state_dict()`` refuse while units are held
        (as between no_sync micro-batches). Held buckets count against the gathered-memory
        budget, as a prefetch does. A unit resharded to some ranks after its forward (an int
        ``reshard_after_forward``) gathers within them in its backward and is released after
        it all the same. FSDP2's gradient accumulation::

            for i, batch in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                model.set_requires_gradient_sync(last)
                model.set_reshard_after_backward(last)
                model(batch).sum().backward()
        """
        if not isinstance(reshard_after_backward, bool):
            raise CollschedError(
                f"set_reshard_after_backward: {reshard_after_backward!r}; expected True (release each unit "
                "after its backward) or False (keep it fetched into the next forward)"
            )
        state = _state_of(self)
        for u in _units_under(self, state, recurse):
            u.reshard_bwd = reshard_after_backward
            # Kept where a root's fully_shard, re-planning the units, finds it.
            u.module.__dict__["_collsched_reshard_bwd"] = reshard_after_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """FSDP2's method: this unit's own gradients are reduced to their sum over the ranks
        divided by ``factor`` (by default the number of ranks: the mean; 1.0 gives the sum, for
        a loss already normalized over the global batch). The unit's own parameters only, as
        FSDP2's (call it on each ``fully_shard``-ed module). Between synchronized steps, on
        every rank alike (the training engine is made anew, which exchanges the plan)."""
        value = float(factor)
        if not (math.isfinite(value) and value > 0):
            raise CollschedError(f"set_gradient_divide_factor: {factor!r}; give a finite factor > 0")
        state = _state_of(self)
        units = _units_under(self, state, recurse=False)
        before = [u.module.__dict__.get("_collsched_divide") for u in units]
        for u in units:
            u.module.__dict__["_collsched_divide"] = value
        if state.model is None or divides(state) == state.divide:
            return
        try:
            state.divide = divides(state)
            state.retrace("set_gradient_divide_factor")
        except BaseException:
            for u, b in zip(units, before):
                u.module.__dict__.pop("_collsched_divide", None)
                if b is not None:
                    u.module.__dict__["_collsched_divide"] = b
            state.divide = divides(state)
            raise

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's earlier name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def refresh_trainable(self) -> bool:
        """Applies the parameters' ``requires_grad`` now (between steps); returns whether it
        changed. Done at every step boundary unless ``auto_refresh_trainable=False``."""
        return _state_of(self).refresh_trainable()

    def set_modules_to_forward_prefetch(self, modules: list[nn.Module]) -> None:
        """In the forward, once this unit is fetched, gather ``modules`` (units) ahead. Makes
        the model's prefetch explicit (FSDP2's method of the same name). Between steps."""
        self._set_prefetch(modules, backward=False)

    def set_modules_to_backward_prefetch(self, modules: list[nn.Module]) -> None:
        """In the backward, once this unit is fetched, gather ``modules`` (units) ahead. Makes
        the model's prefetch explicit (FSDP2's method of the same name). Between steps."""
        self._set_prefetch(modules, backward=True)

    def _set_prefetch(self, modules: list[nn.Module], backward: bool) -> None:
        state = _root_state(self)  # type: ignore[arg-type]
        me = state.unit_index(self)  # type: ignore[arg-type]
        # (A fully_shard([...]) list's members name one unit.)
        targets = list(dict.fromkeys(state.unit_index(m) for m in modules))
        (state.bwd_rules if backward else state.fwd_rules)[me] = targets
        state.opts["prefetch"] = "explicit"
        state.apply_explicit()


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns (FSDP2's name): the gather ran in the call."""

    def wait(self) -> None:
        """Returns at once: the parameters are gathered already."""


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Makes ``module.<method_name>`` (``generate``, ``encode``, ...) run as its ``forward``
    does: the unit fetched around the call (FSDP2's function of the same name). A method that
    calls its submodules other than through ``module(...)`` needs it; Hugging Face's
    encoder-decoders' ``generate()`` calls the encoder so. ``module`` is sharded already. A call
    with grad enabled is a training pass (its fetches begin a training step): call ``generate()``
    under ``torch.no_grad()``, as an evaluation."""
    _state_of(module)
    method = getattr(module, method_name, None)
    if not callable(method):
        raise CollschedError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            args, kwargs = _pre_forward(module, args, kwargs) or (args, kwargs)
            out = method(*args, **kwargs)
        except BaseException:
            _post_forward(module, args, None)
            raise
        cast = _post_forward(module, args, out)
        return out if cast is None else cast

    module.__dict__[method_name] = run


def _mesh_strategy(mesh: Any, strategy: str) -> tuple[tuple[int, ...] | None, str]:
    """The part of the job and the strategy ``fully_shard(mesh=...)`` means (FSDP2's device
    meshes as collsched's worlds and strategies), or a refusal naming what the mesh is. A
    mesh over part of the job (pipeline or tensor parallelism beside) is a world of its ranks
    (made here), named by them; None is the job's world."""
    from .world import group_world, world

    if mesh is None:
        world()  # refuses a job not joined yet
        return None, strategy
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise CollschedError(f"fully_shard: mesh={mesh!r}; expected a torch.distributed DeviceMesh")
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim > 2:
        raise CollschedError(
            f"fully_shard: mesh of shape {tuple(mesh.mesh.shape)} over ranks {ranks}; give a 1-D mesh (sharding) "
            "or a 2-D (replicate, shard) one (HSDP): slice a larger mesh by its dimension names"
        )
    part = None if group_world(ranks) is world() else tuple(ranks)
    if mesh.ndim == 1:
        return part, strategy
    group = int(mesh.mesh.shape[1])
    if strategy not in ("even", f"hybrid:{group}"):
        raise CollschedError(
            f"fully_shard: mesh of shape {tuple(mesh.mesh.shape)} (replicate x shard) is strategy 'hybrid:{group}'; "
            f"strategy={strategy!r} says otherwise: give one of them"
        )
    return part, f"hybrid:{group}"


def _ignored(modules: list[nn.Module], params: Any) -> list[nn.Parameter]:
    """``ignored_params``, checked: parameters of ``modules``, none sharded already."""
    if params is None:
        return []
    try:
        given = list(params)
    except TypeError:
        raise CollschedError(
            f"fully_shard: ignored_params={params!r}; expected a set of parameters of the module"
        ) from None
    mine = {id(p) for m in modules for p in m.parameters()}
    for p in given:
        if not isinstance(p, nn.Parameter) or id(p) not in mine:
            raise CollschedError(
                f"fully_shard: ignored_params holds {type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}, "
                f"not a parameter of {', '.join(type(m).__name__ for m in modules)}; give the module's own parameters"
            )
        if hasattr(p, "_collsched_param"):
            raise CollschedError(
                f"fully_shard: ignored_params holds a parameter of shape {tuple(p.shape)} that a fully_shard "
                "below already sharded; ignore it in that call (the blocks' calls come first)"
            )
    return given


def _group(modules: Any, reshard: Any) -> tuple[nn.Module, ...]:
    """FSDP2's ``fully_shard([a, b, ...])``, checked: the modules, one unit of the model a
    root's ``fully_shard`` plans (fetched when the first of them runs, released after each
    one's forward unless ``reshard_after_forward`` is False, reduced once all of their
    gradients are in). Returns the tuple the members keep (their group), or that of an
    earlier call with the same modules."""
    members = tuple(modules)
    if not members or not all(isinstance(m, nn.Module) for m in members):
        raise CollschedError(f"fully_shard: expected a non-empty list of torch.nn.Modules, got {modules!r}")
    earlier = members[0].__dict__.get("_collsched_group")
    if (
        earlier is not None
        and len(earlier) == len(members)
        and all(a is b for a, b in zip(earlier, members))
        and all(m.__dict__.get("_collsched_group") is earlier for m in members)
    ):
        return earlier
    for i, m in enumerate(members):
        if any(m is o for o in members[:i]):
            raise CollschedError(f"fully_shard: {type(m).__name__} is twice in the list; give each module once")
        inner = next((o for o in members if o is not m and any(o is x for x in m.modules())), None)
        if inner is not None:
            raise CollschedError(
                f"fully_shard: {type(inner).__name__} is inside {type(m).__name__}, both in one list; give the "
                "outer one alone"
            )
        if m.__dict__.get("_collsched_state") is not None or "_collsched_group" in m.__dict__:
            raise CollschedError(
                f"fully_shard: {type(m).__name__} was given to fully_shard already; a module is in one unit"
            )
    if not (reshard is None or isinstance(reshard, bool)):
        raise CollschedError(
            f"fully_shard: reshard_after_forward={reshard!r} for a list of modules; give True or False (an int "
            "layout is made for one module's unit)"
        )
    return members


def _reshard_flag(value: Any, what: str) -> bool | int | None:
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 1):
        return value
    raise CollschedError(
        f"{what}: reshard_after_forward={value!r}; expected True (release each unit after its forward), "
        "False (keep it fetched into its backward), None (False on the root, True elsewhere) or a number "
        "of ranks (FSDP2's int: the shard group's size is True, 1 is False)"
    )


def _check_placements(module: nn.Module, fn: Any, ignored: Any) -> None:
    """FSDP2's ``shard_placement_fn``: ``None`` or ``Shard(0)`` for every parameter is what
    collsched does (its state dicts give ``Shard(0)``); any other placement is refused, naming
    the parameter."""
    if fn is None:
        return
    from torch.distributed.tensor import Shard

    skip = {id(p) for p in ignored or ()}
    for name, p in module.named_parameters():
        # Ignored ones, and the shards of units sharded already (FSDP2 asks for neither).
        if id(p) in skip or hasattr(p, "_collsched_param"):
            continue
        got = fn(p)
        if got is not None and not (type(got) is Shard and got.dim == 0):
            raise CollschedError(
                f"fully_shard: shard_placement_fn gives {name} the placement {got!r}; collsched.torch shards every "
                "parameter along its first dimension (Shard(0), its state dicts' placement): return None or "
                "Shard(0), or leave the parameter out (ignored_params)"
            )


def _units_under(module: Any, state: _State, recurse: bool) -> list[Any]:
    """The units of ``state`` that are ``module`` or (``recurse``) under it."""
    units = {
        id(m.__dict__["_collsched_u"]): m.__dict__["_collsched_u"]
        for m in (module.modules() if recurse else [module])
        if m.__dict__.get("_collsched_state") is state and "_collsched_u" in m.__dict__
    }
    return list(units.values())


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    strategy: str = "even",
    bucket_mb: float = 64.0,
    prefetch: str = "trace",
    prefetch_mb: float | None = None,
    max_inflight: int | None = None,
    reduce_dtype: Any = None,
    auto_refresh_trainable: bool = True,
    sync_module_states: bool = False,
    reshard_after_forward: bool | int | None = None,
    mp_policy: Any = None,
    ignored_params: Any = None,
    mesh: Any = None,
    offload_policy: Any = None,
    shard_placement_fn: Any = None,
    dp_mesh_dims: Any = None,
) -> nn.Module | list[nn.Module]:
    """Shards ``module`` in place (collective: every rank calls it with the same module
    structure) and returns it.

    Call it on each block first, then on the root: each call makes ``module`` a unit whose
    parameters are fetched together, and shards every parameter under it; a call on a module
    above units re-plans them all as one model (the root's knobs apply). Afterwards
    ``module.named_parameters()`` yields the same names, each a 1-D ``Parameter`` over this
    rank's elements; after a synchronized backward each has ``.grad`` (the mean over ranks).
    ``module.state_dict()`` gives them as FSDP2 does, DTensors of their global shapes, and
    ``load_state_dict`` takes full values or DTensors (``state_dict.py``: collective, over
    torch.distributed's default group). A module built on the meta device is sharded without
    values (zeros in collsched's memory; no rank makes a full value): ``to_empty`` keeps the
    shards, and a load (``set_model_state_dict(..., broadcast_from_rank0=True)``,
    ``load_state_dict``, ``load_checkpoint``) writes them.
    A second call on a sharded module (a unit or the root) returns it unchanged: two trainers
    wrapping one model share its sharding.

    A list of modules (FSDP2's grouping, torchtitan's ``fully_shard([model.norm, model.output])``)
    makes them one unit, fetched when the first of them runs and reduced once all of their
    gradients are in; it is sharded by the root's call that follows (until then its modules
    refuse to run), and the list is returned. ``reshard_after_forward`` True releases the unit
    after each of its modules' forwards (a module run later gathers it again), False keeps it
    fetched into its backward; an int is refused for a list.

    Knobs: ``strategy`` ``"even"`` (every parameter cut in ``world`` pieces), ``"flat"``
    (buckets cut in equal pieces), ``"greedy"`` (whole parameters per rank), ``"hybrid:G"``
    (even within groups of G ranks, replicated across); ``bucket_mb`` (64) caps a bucket's
    bytes; ``prefetch`` ``"trace"`` (record the first step's fetch order, gather along it ahead),
    ``"explicit"`` (the next unit in the forward, the previous in the backward, or what the
    units' ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` say) or
    ``"none"``; ``prefetch_mb`` bounds the bytes gathered ahead (the next bucket is gathered ahead whatever
    its size, and its bytes count) and
    ``max_inflight`` the buckets gathered ahead (``None``: about one unit ahead while one
    computes, as FSDP2 prefetches one module: the largest unit's bytes and its buckets plus
    one);
    ``reduce_dtype`` (``None``: the parameter's; or ``torch.float32``, ...) is the dtype
    gradients are reduced in; ``auto_refresh_trainable`` (True) picks up ``requires_grad``
    changes at each step boundary; ``sync_module_states`` (False) starts every rank from rank
    0's values (give it to the units' calls too: a unit's shards are cut when it is sharded);
    ``reshard_after_forward`` (True: release the module's unit after its training forward;
    False: keep it fetched into its backward, one gather fewer, its full parameters held from
    forward to backward; ``None``, FSDP2's default: False on the root, whose backward begins
    at once (a module of it run after its forward, a chunked loss's head, finds its full
    parameters), True elsewhere; an int, FSDP2's number of ranks to reshard to, a factor of
    the shard group's size: the size is True, 1 is False, and ``N`` between keeps ``1/N`` of
    the unit's parameters on each rank after its forward, which its backward gathers within
    its group of ``N`` consecutive ranks, not across the world; see ``post_forward.py``) is
    this call's module's own, kept when a root's call
    re-plans the units; ``mp_policy`` (``None``: none) a :class:`MixedPrecisionPolicy` (this package's or
    FSDP2's): gathers in its ``param_dtype`` with f32 shards for the optimizer, and its
    ``reduce_dtype`` where ``reduce_dtype`` is not given; ``ignored_params`` (``None``: none) a
    set of parameters under ``module`` left as they are (FSDP2's: not sharded, their gradients
    not reduced; expert-parallel or quantized layers keep their own), as are parameters of
    non-floating dtypes; ``mesh`` (``None``: the job's world) a torch ``DeviceMesh``, as FSDP2
    takes it: 1-D shards over its ranks (``strategy`` as given), 2-D ``(replicate, shard)`` is
    ``strategy="hybrid:G"`` over its ranks with ``G`` the shard dimension's size (HSDP); a mesh
    over part of the job (a slice of a larger mesh, pipeline parallelism beside) shards over
    that part alone, in a world of its own (``shm`` backend; made at the first model over
    those ranks, every one of them calling); tensor-parallel parameters (DTensors of
    ``parallelize_module`` on ``world_mesh["tp"]``) are sharded over ``world_mesh["dp"]`` by
    their local tensors, as FSDP2's 2-D sharding (``tp.py``);
    ``offload_policy`` (``None``: none) a :class:`CPUOffloadPolicy` (this package's or FSDP2's):
    the module's shards and their gradients in host memory, the optimizer stepping there;
    ``shard_placement_fn`` (``None``) FSDP2's per-parameter placement: ``None`` or ``Shard(0)``
    for each parameter (what collsched does), any other placement refused by name;
    ``dp_mesh_dims`` (``None``; FSDP2's ``DataParallelMeshDims(shard=, replicate=)``, each a
    dimension's name or several neighbouring ones, flattened into one as FSDP2 does) makes
    ``mesh`` the whole SPMD mesh: every parameter a DTensor on it, ``Replicate()`` on those
    dimensions, sharded over ``shard`` and replicated over ``replicate`` (both: HSDP;
    ``replicate`` alone: DDP, strategy ``"hybrid:1"``), its other placements kept; as in
    FSDP2, a gradient is averaged over the data-parallel ranks as autograd leaves it there (a
    loss that is a DTensor mean over the global batch gives its gradient over the number of
    data-parallel ranks, as FSDP2 does).
    """
    group = _group(module, reshard_after_forward) if isinstance(module, (list, tuple)) else None
    members = list(group) if group is not None else [module]
    if group is None and not isinstance(module, nn.Module):
        raise CollschedError(f"fully_shard: expected a torch.nn.Module, got {type(module).__name__}")
    if group is None and module.__dict__.get("_collsched_state") is not None:
        # Already sharded (a unit or a root): a second trainer's wrapping reuses it.
        return module
    if group is not None and members[0].__dict__.get("_collsched_group") is group:
        # The same list given again.
        return members
    if group is None and "_collsched_group" in module.__dict__:
        raise CollschedError(
            f"fully_shard: {type(module).__name__} is in a group given to fully_shard([...]) already; shard a "
            "module above the group (the root), not one of its members"
        )
    if prefetch not in ("trace", "explicit", "none"):
        raise CollschedError(
            f"fully_shard: prefetch={prefetch!r}; expected 'trace' (replay the first step's order), 'explicit' "
            "(the next unit, or the units' set_modules_to_forward_prefetch lists) or 'none'"
        )
    spmd = None
    if dp_mesh_dims is not None:
        # FSDP2's whole SPMD mesh: sharded over its data-parallel dimensions (tp.py).
        mesh, spmd, ddp = tp_.spmd_mesh(mesh, dp_mesh_dims)
        if ddp is not None and strategy not in ("even", ddp):
            raise CollschedError(
                f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} replicates without sharding (DDP, strategy {ddp!r}); "
                f"strategy={strategy!r} says otherwise: give one of them"
            )
        strategy = ddp or strategy
    part, strategy = _mesh_strategy(mesh, strategy)
    mp = values.policy(mp_policy)
    if mp is not None and mp.reduce_dtype is not None:
        if reduce_dtype is not None and _TO_TORCH.get(reduce_dtype, reduce_dtype) != mp.reduce_dtype:
            raise CollschedError(
                f"fully_shard: reduce_dtype={reduce_dtype} and mp_policy.reduce_dtype={mp.reduce_dtype} differ; "
                "give one of them"
            )
        reduce_dtype = mp.reduce_dtype
    # mp_policy.reduce_dtype None: the parameters' own dtype (torch 2.15's FSDP2), chosen at build.
    if reduce_dtype is not None and not isinstance(reduce_dtype, str):
        if reduce_dtype not in _FROM_TORCH:
            raise CollschedError(f"fully_shard: reduce_dtype={reduce_dtype}; expected float32, bfloat16 or float16")
        reduce_dtype = _FROM_TORCH[reduce_dtype]
    ignored = _ignored(members, ignored_params)
    reshard = _reshard_flag(reshard_after_forward, "fully_shard")
    if spmd is not None and reshard is not None and not isinstance(reshard, bool):
        raise CollschedError(
            f"fully_shard: reshard_after_forward={reshard} (a number of ranks) with dp_mesh_dims is not supported "
            "(nor by FSDP2); give True or False, or shard a tensor-parallel model with mesh=world_mesh['dp']"
        )
    opts_offload = values.offload_policy(offload_policy)
    for m in members:
        _check_placements(m, shard_placement_fn, ignored)
    for m in members:
        m.__dict__["_collsched_ignored"] = ignored
        m.__dict__["_collsched_reshard"] = reshard
        m.__dict__["_collsched_mp"] = mp
        m.__dict__["_collsched_offload"] = opts_offload
    if group is not None:
        # One unit of the model a root's fully_shard plans (module.py's _group), over the
        # mesh given here (build.py compares it with the root's).
        for m in members:
            m.__dict__["_collsched_group"] = group
            m.__dict__["_collsched_part"] = part
            m.__dict__["_collsched_spmd"] = spmd
            _mark(m)
        return members
    opts = {
        "part": part,
        # Under dp_mesh_dims: the 1-D mesh of the dimensions sharded over (a state dict's rows are cut over it).
        "mesh": mesh if spmd is None else spmd.cut,
        "spmd": spmd,
        "strategy": strategy,
        "bucket_mb": bucket_mb,
        "prefetch": prefetch,
        "prefetch_bytes": None if prefetch_mb is None else int(prefetch_mb * (1 << 20)),
        "max_inflight": max_inflight,
        "reduce_dtype": reduce_dtype,
        "auto_refresh_trainable": auto_refresh_trainable,
        "sync_module_states": sync_module_states,
        "mp": mp,
        "offload": opts_offload,
    }
    state = _State(module, opts)
    after_forward(module.__dict__["_collsched_reshard"], state, "fully_shard")
    _mark(module)
    state.build()
    for unit in state.units:
        for m in unit.members:
            m.__dict__["_collsched_state"] = state
    state_dict.install(state)
    optim_state.install()
    return module


# The sharded class of each module class (``CollschedModule`` first), made once.
_CLASSES: dict[type, type] = {}


def _mark(module: nn.Module) -> None:
    """Makes ``module`` a :class:`CollschedModule` under its class's own name, module and
    docstring, and hooks its forward: first among its pre-hooks (others see the full
    parameters), its hook called even when the forward raises."""
    cls = type(module)
    if issubclass(cls, CollschedModule):
        return
    sharded = _CLASSES.get(cls)
    if sharded is None:
        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        sharded = _CLASSES[cls] = type(cls.__name__, (CollschedModule, cls), names)
    module.__class__ = sharded
    module.register_forward_pre_hook(_pre_forward, prepend=True, with_kwargs=True)
    module.register_forward_hook(_post_forward, always_call=True)


def _pre_forward(module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
    state: _State | None = module.__dict__.get("_collsched_state")
    if state is None:
        if "_collsched_group" in module.__dict__:
            raise CollschedError(
                f"{type(module).__name__} was given to fully_shard in a list and is not sharded yet: call "
                "fully_shard on the root module over the list's modules before running them"
            )
        return None
    return state.pre_forward(module, args, kwargs)


def _post_forward(module: nn.Module, _args: Any, out: Any) -> Any:
    state: _State | None = module.__dict__.get("_collsched_state")
    return None if state is None else state.post_forward(module, out)


def _root_state(module: nn.Module) -> _State:
    state = _state_of(module)
    if state.model is None:
        raise CollschedError(f"{type(module).__name__}'s sharding was taken over by a root's fully_shard")
    return state


def stats(module: nn.Module) -> dict[str, Any]:
    """The last training step's counters of ``module``'s sharded model: ``all_gathers``,
    ``reduce_scatters``, ``gathered_bytes``, ``reduced_bytes``, ``prefetch_hits``,
    ``prefetch_misses``, ``wait_ms``, ``peak_gathered_bytes``, ``host_us_per_unit`` (Python time
    of this package's hooks, the saved-tensor hooks included and calls into the library
    excluded, per unit forward, for the forward and backward of the step),
    ``native_us_per_unit`` (the time of those calls into the library, likewise),
    ``calls_us_per_unit`` (that time less ``wait_ms``, the waits for collectives),
    ``blocked_waits`` (the waits that found their collectives still running), ``views_made``
    (tensors made over gathered buffers at addresses a parameter had not had in its last 16:
    none in a steady state), ``steps`` and ``reduced_steps`` (running counts of the library's
    training steps this model ended: each backward's, and those a training forward whose output
    needs no gradient, ``finalize_backward``, ``reset_iter_state`` or a recovery ended; and of
    those the ones that reduced gradients), and more; with units resharded to some ranks after
    their forward (an int ``reshard_after_forward``), the counters include the backward's
    gathers within those ranks, and ``post_forward`` holds that layout's own counters by size
    (its peak of gathered bytes is not in ``peak_gathered_bytes``)."""
    return dict(_root_state(module).last)


def full_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (a copy), by name. Collective: every rank calls it."""
    state = _root_state(module)
    got = values.gather_all(state)
    return {p.name: got[p.pid] for p in state.params}


def plan(module: nn.Module) -> dict[str, Any]:
    """The plan of ``module``'s sharded model (the structure ``collsched plan --json``
    prints: buckets, each rank's shard segments, ops)."""
    return json.loads(_root_state(module).model.plan)


def live_bytes(module: nn.Module) -> int:
    """Gathered bytes held on this rank for ``module``'s sharded model (0 between steps, but
    for the units ``set_reshard_after_backward(False)`` holds after a no_sync backward, and
    those kept into a backward that has not run: a dropped training output's; the
    post-forward pieces of an int ``reshard_after_forward`` are shards, not counted)."""
    state = _root_state(module)
    return int(state.train.live_bytes) + post_.live_bytes(state)
