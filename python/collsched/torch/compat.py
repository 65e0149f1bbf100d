"""FSDP2's module methods for what collsched does its own way (:class:`Fsdp2Methods`, mixed
into every sharded module): manual backward finalization and ``reset_iter_state``
(``finalize.py``), the gradient reduction's options that collsched's reductions meet already,
and FSDP2's hooks into its own collectives, which are refused, saying why."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

from .._native import CollschedError
from . import finalize as finalize_
from .finalize import GradientReductionHandle

if TYPE_CHECKING:
    from .shard import _State


def _state_of(module: nn.Module) -> _State:
    state = module.__dict__.get("_collsched_state")
    if state is None:
        raise CollschedError(f"{type(module).__name__} is not sharded by collsched.torch.fully_shard")
    return state


def _not_fsdp2_comms(method: str) -> str:
    return (
        f"{method}: collsched.torch runs its own collectives on its own buffers and streams (its library), "
        "not FSDP2's process-group calls, so there is nothing for this hook to replace; remove the call, or use "
        "torch's fully_shard for this module"
    )


def settle_sync(state: Any) -> None:
    """Whether the next backward reduces (``state.sync``): outside any ``no_sync()``, gradient
    synchronization asked for (``set_requires_gradient_sync``) and, where the strategy has
    replica groups, their all-reduce too (``set_requires_all_reduce``: the library reduces
    in-group and across groups in one step, so deferring one defers both)."""
    replicas = state.shard_group < state.world.world
    wanted = state.grad_sync and (state.all_reduce or not replicas)
    state.sync = state.no_sync_depth == 0 and wanted


class Fsdp2Methods:
    """FSDP2's module methods that change nothing in collsched, refuse, or end a backward by hand."""

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """FSDP2's method, taken for its signature: collsched's reductions always sum (in the
        reduction dtype, ``f32`` accumulation on the host) and divide by the gradient divide
        factor after the sum (in f16, partly before it, as FSDP2 splits it), which is what this
        asks of FSDP2's communicators."""
        _state_of(self)
        del enable

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """FSDP2's method for HSDP: whether a backward's gradients are all-reduced across the
        replica groups (``hybrid:G`` below the world size, a 2-D mesh, ``dp_mesh_dims`` with
        ``replicate``). ``False``: the backward passes accumulate and reduce nothing until one
        with ``True`` reduces the sum, in-group and across groups at once (the same gradients;
        where FSDP2 reduce-scatters each micro-batch within its group and holds the shard, the
        library holds the micro-batches' unreduced sum, as under ``no_sync``). Without replica
        groups there is no such all-reduce and the flag changes nothing. The flag is the sharded
        model's, whichever unit it is set on (``recurse`` is taken for FSDP2's signature)."""
        state = _state_of(self)
        del recurse  # the reductions are the whole model's
        state.all_reduce = bool(requires_all_reduce)
        settle_sync(state)

    def set_post_optim_event(self, event: Any) -> None:
        """FSDP2's method: the next forward's gathers start after ``event`` (recorded after an
        optimizer step on another stream). On ``cuda`` the library's compute stream (torch's
        current stream at ``init``, which its gathers follow) waits for it; on host memory the
        optimizer's step is over when it returns, and nothing waits."""
        _state_of(self)
        from . import world as world_

        if event is not None and world_._STREAM is not None:
            world_._STREAM.wait_event(event)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """FSDP2's method, taken for its signature: ``False`` tells FSDP2 that this unit's
        parameters are not used in the backward, to skip their all-gather there. collsched
        gathers a unit in the backward only when its backward starts or autograd asks for one
        of its saved parameters, so an unused unit costs its one gather at most; the flag
        changes nothing."""
        _state_of(self)
        del unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2's method, taken for its signature: collsched's collective buffers come from its
        own pool (``cst.memory_stats()``), never a process group's allocator."""
        _state_of(self)
        del enable

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """FSDP2's method, taken for its signature: collsched's collectives run on its own
        backend and buffers; there is no process-group symmetric memory to switch to."""
        _state_of(self)
        del backend

    def set_custom_all_gather(self, comm: Any) -> None:
        """FSDP2's hook for its own all-gather; refused: collsched's gathers are its library's."""
        raise CollschedError(_not_fsdp2_comms("set_custom_all_gather"))

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """FSDP2's hook for its own reduce-scatter; refused: collsched's reductions are its
        library's."""
        raise CollschedError(_not_fsdp2_comms("set_custom_reduce_scatter"))

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """FSDP2's hook run on each reduced gradient; refused: the reduced gradients stay in the
        library until the backward's end, where each shard's ``.grad`` gets them (work on them
        there: after ``backward()``, before the optimizer's step)."""
        raise CollschedError(_not_fsdp2_comms("set_all_reduce_hook"))

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's method, on the root: with ``True``, :meth:`finalize_backward` ends each
        logical backward (micro-batches under ``set_requires_gradient_sync(False)``, then
        synchronization on and one finalization, as torch.distributed.pipelining drives an FSDP2
        stage; it makes these calls on FSDP2's modules only, so over collsched's stages it
        reduces at each micro-batch's backward instead). Set it outside a backward. A
        synchronized backward still delivers its gradients itself."""
        finalize_.set_manual(_state_of(self), self, enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """FSDP2's method, on the root, after the backward passes of one logical backward: with
        gradient synchronization on, reduces what the passes under ``no_sync`` accumulated
        (collective: every rank calls it) and releases the units ``set_reshard_after_backward(False)``
        held; with it off the gradients stay accumulated. Needs
        ``set_manual_backward_finalization(True)``; refused inside a pass. ``async_op=True``
        returns a :class:`GradientReductionHandle` whose ``wait()`` returns at once (the
        reductions ran in the call)."""
        return finalize_.finalize(_state_of(self), self, async_op)

    def reset_iter_state(self) -> None:
        """FSDP2's method, on the root, after a forward or backward raised: releases every unit,
        ends the step left open, and drops its gradients and what ``no_sync`` micro-batches had
        accumulated (restart that accumulation); earlier steps' ``.grad`` stay. Every rank calls
        it (it may reduce). Without it, after a backward raised, the next forward recovers the
        same way (a host backend's ``no_sync`` accumulation is then dropped only where the
        failed backward synchronized); after a forward raised, the next forward continues the
        step it left open."""
        finalize_.reset(_state_of(self), self)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """FSDP2's method, taken for its signature: collsched reduces every gradient bucket whole,
        a parameter a rank's backward did not reach counted as zeros there (FSDP2's ``True``), so
        ranks that use different parameters never disagree on their collectives; after a
        synchronized backward every trainable parameter has a ``.grad``."""
        _state_of(self)
        del reduce_scatter_unused_params, recurse

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """FSDP2's method (how many reduce-scatter input buffers may be in flight before the
        compute stream waits to reuse one), checked as FSDP2 checks it and taken: each of
        collsched's reductions has a buffer of its own from the library's pool, freed behind
        that reduction, so the compute stream never waits to reuse one (any cap is met)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int) or max_input_buffers < 1:
            raise CollschedError(f"set_reduce_scatter_max_input_buffers: {max_input_buffers!r}; give an int >= 1")
        _state_of(self)
        del recurse

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's method: ``False`` (the default: a released unit's gathered memory goes back)
        is taken; ``True`` (the gathered storage kept at its address across a release and the
        next gather, for CUDA graph capture) is refused: a unit's gathered buckets come from the
        library's pool at each gather, usually at the same address but not always."""
        _state_of(self)
        del recurse
        if keep:
            raise CollschedError(
                "set_keep_unsharded_storage(True): collsched.torch gathers each unit into buffers of its pool at "
                "each fetch, not into storage kept at fixed addresses, so a CUDA graph captured over a step would "
                "read stale addresses; leave it False (or reshard_after_forward=False to keep a unit fetched into "
                "its backward)"
            )

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """FSDP2's method, taken for its signature: collsched's reductions already run apart
        from its gathers (their own stream and, on ``cuda``, their own NCCL communicator), so
        they overlap whether ``enable`` is True or False."""
        _state_of(self)
        del enable, recurse


class Fsdp2StateView:
    """What ``_get_fsdp_state()`` gives for a module sharded by collsched.torch, which keeps
    no FSDP2 state: FSDP2's communication context alone, ``_comm_ctx`` (an object of the
    module's own until torch's ``share_comm_ctx`` sets one shared with other modules; what
    ``torch.distributed.pipelining``'s deferred reduction compares between stages; collsched's
    collectives run on the library's streams whatever it is), and no ``_fsdp_param_groups``.
    Reading any other FSDP2 state is refused by name."""

    __slots__ = ("_module", "_comm_ctx", "_fsdp_param_groups")

    def __init__(self, module: Any) -> None:
        self._module = type(module).__name__
        self._comm_ctx: Any = object()
        self._fsdp_param_groups: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise CollschedError(
            f"{self._module} is sharded by collsched.torch, which keeps no FSDP2 state: _get_fsdp_state() gives "
            f"its communication context (_comm_ctx) alone, not {name}; code reading FSDP2's other internals does "
            "not apply to it: use its public FSDP2 methods"
        )
