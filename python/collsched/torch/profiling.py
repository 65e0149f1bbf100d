"""Profiler events of the ``"collsched"`` backend's ops, as torch's own backends record them
(and as PyTorch's distributed test suite checks them): one event ``"<backend>:<op>"`` per op
(``"gloo:all_reduce"`` when the backend stands in for gloo), carrying the shapes of the op's
input tensors, begun at the launch and ended on another thread once the op completed, which
is what makes the profiler call it asynchronous (``FunctionEvent.is_async``). With no profiler
active an op pays one check of a flag.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch

_local = threading.local()


def active() -> bool:
    """Whether a profiler (``torch.profiler`` or ``torch.autograd.profiler``) records now."""
    return bool(torch._C._autograd._profiler_enabled())


def begin(name: str, tensors: Iterable[torch.Tensor]) -> Any:
    """Begins event ``name`` with the shapes of ``tensors``; its handle for :func:`end`."""
    return torch.autograd._record_function_with_args_enter(name, *tensors)


def end(handle: Any) -> None:
    """Ends an event begun by :func:`begin`, on the ender thread (never the caller's), and
    returns once it ended."""
    done = threading.Event()
    _ender().put((handle, done))
    done.wait()


def _end_events(q: queue.SimpleQueue) -> None:
    while True:
        handle, done = q.get()
        try:
            torch.autograd._record_function_with_args_exit(handle)
        except Exception:  # the profiler went away: nothing left to record into
            pass
        done.set()


@functools.lru_cache(maxsize=1)
def _ender() -> queue.SimpleQueue:
    q: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_end_events, args=(q,), name="collsched-profiler", daemon=True).start()
    return q


def recorded(op: str, inputs: Callable[..., Iterable[torch.Tensor]]) -> Callable:
    """Decorates a backend method that returns a work: while a profiler is active, the call
    begins ``"<backend's profile name>:<op>"`` with the tensors ``inputs(*args)`` picks, and
    the work ends it when it completes. A recorded op called from inside another (an
    ``all_gather_coalesced`` built on ``allgather``) records nothing more."""

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(self: Any, *args: Any) -> Any:
            if not active() or getattr(_local, "busy", False):
                return method(self, *args)
            handle = begin(f"{self._profile_name}:{op}", [t for t in inputs(*args) if isinstance(t, torch.Tensor)])
            _local.busy = True
            try:
                work = method(self, *args)
            except BaseException:
                end(handle)
                raise
            finally:
                _local.busy = False
            work._profile = handle
            return work

        return call

    return decorate


def first(tensors: Any, *_: Any) -> list[torch.Tensor]:
    """The op's first argument, a list of tensors."""
    return list(tensors)


def second(_: Any, tensors: Any, *__: Any) -> list[torch.Tensor]:
    """The op's second argument: a tensor or a list of them."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def nested_second(_: Any, lists: Any, *__: Any) -> list[torch.Tensor]:
    """The op's second argument, lists of tensors, flattened."""
    return [t for row in lists for t in row]


def none(*_: Any) -> list[torch.Tensor]:
    return []
