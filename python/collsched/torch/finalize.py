"""The end of a backward iteration by the caller's hand, as FSDP2's root module offers it:
manual finalization (``set_manual_backward_finalization``, ``finalize_backward``, which
torch.distributed.pipelining calls on an FSDP2 stage after the backward passes of all its
micro-batches; it calls them on FSDP2's modules only, and over collsched's stages reduces at
each micro-batch's backward instead) and
``reset_iter_state`` (the recovery after an exception in a forward or backward).

collsched ends each backward itself: a synchronized one's reductions are waited for and its
gradients are in the shards' ``.grad`` when ``backward()`` returns; one under ``no_sync``
accumulates. What manual finalization adds is the reduction of what ``no_sync`` backward
passes accumulated, without a further backward: :func:`finalize` reduces it once gradient
synchronization is on again, as FSDP2's ``finalize_backward`` does. Both calls are the whole
model's, made on its root, on every rank alike (they may reduce, which is collective: a rank
decides by what it accumulated, so every rank's ``no_sync`` backward passes must reach the
model's parameters alike, as with FSDP2)."""

from __future__ import annotations

from typing import Any

from .._native import CollschedError
from . import values as values_


class GradientReductionHandle:
    """What ``finalize_backward(async_op=True)`` returns (FSDP2's name): the reductions ran in
    the call, so ``wait()`` returns at once."""

    def wait(self) -> None:
        """Returns at once: the gradients are reduced and in the shards' ``.grad``."""


def _on_root(state: Any, module: Any, what: str) -> None:
    if module is not state.root:
        raise CollschedError(
            f"{what} must be called on the root module (the one the last fully_shard was applied to, "
            f"{type(state.root).__name__}), not on {type(module).__name__}"
        )


def set_manual(state: Any, module: Any, enabled: bool) -> None:
    """``set_manual_backward_finalization``: checked, then kept for :func:`finalize`."""
    _on_root(state, module, "set_manual_backward_finalization")
    if state.phase == "backward":
        raise CollschedError(
            "set_manual_backward_finalization cannot change the mode during a backward; set it before the forward"
        )
    state.manual = bool(enabled)


def finalize(state: Any, module: Any, async_op: bool) -> GradientReductionHandle | None:
    """``finalize_backward``: after the backward passes of one logical backward, reduces what
    those under ``no_sync`` accumulated (with synchronization on again; with it still off the
    gradients stay accumulated, as FSDP2's do) and releases the units held since. A synchronized
    backward has already delivered its gradients, so after one there is nothing left to do."""
    _on_root(state, module, "finalize_backward")
    if not state.manual:
        raise CollschedError(
            "finalize_backward requires manual backward finalization: call "
            "model.set_manual_backward_finalization(True) before the forward"
        )
    if state.phase != "idle":
        when = "during a backward" if state.phase == "backward" else "between a forward and its backward"
        raise CollschedError(
            f"finalize_backward called {when}; call it after the backward passes complete, before the optimizer's step"
        )
    if state.sync:
        state.drop_held()
        if state.unsynced:
            _reduce_accumulated(state, deliver=True)
    return GradientReductionHandle() if async_op else None


def reset(state: Any, module: Any) -> None:
    """``reset_iter_state``: after an exception in a forward or a backward, releases every
    unit, ends the step the exception left open and drops its gradients, and drops what
    ``no_sync`` micro-batches accumulated before it (that micro-batch sequence is lost, as with
    FSDP2). The shards' ``.grad`` from earlier synchronized steps stay. Collective where
    gradients were accumulated: every rank calls it."""
    _on_root(state, module, "reset_iter_state")
    # Forwards unwound without their hooks (torch skips them for some exceptions).
    while state.frames:
        state.post_forward(state.frames[-1].module, None)
    state.drop_held()
    # Whether the library may hold gradients of no_sync micro-batches: the step's end below
    # keeps them when the step was one under no_sync, and when no backward began in it (the
    # library still in no_sync mode) loses track of them.
    accumulated = state.unsynced or not state.sync
    state._recover()
    if accumulated or state.unsynced:
        _reduce_accumulated(state, deliver=False)


def _reduce_accumulated(state: Any, deliver: bool) -> None:
    """Ends a step with no backward in it as a synchronized one: the library reduces the
    gradients accumulated under ``no_sync`` (a device backend's, waiting beside the library in
    ``state.accum``, are handed over first: :func:`reset`'s ``_recover`` dropped them already)
    and, with ``deliver``, adds them to the shards' ``.grad``; without it they are taken and
    dropped."""
    sync = state.sync
    state.sync = True
    try:
        state.train.set_no_sync(False)
        native, _ = values_.hand(state, state.params, final=True)
        state.native_s += native
        state._end_step(deliver=deliver)
    finally:
        state.sync = sync
