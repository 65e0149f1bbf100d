"""What torch's C++ holder of a Python backend's work does not forward, made to answer.

torch hands the work a Python backend returns back to its caller inside a C++ holder that
forwards ``wait()`` and ``get_future()`` alone: ``is_completed()`` would stay False for ever
(a loop polling it would never end) and ``_source_rank()`` (what ``dist.recv(src=None)``
asks) would raise. :func:`install` wraps both methods of torch's ``Work`` once: torch's own
answer first, and where it has none, the answer of this backend's work, reached through the
one method the holder forwards. Any other backend's work gets torch's own answers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

# The sender of each tensor a receive from any source filled, by the tensor's id (while the
# tensor lives: tensors compare by value, so they cannot key a weak dictionary).
_SOURCES: dict[int, int] = {}
# Set while a wrapped is_completed() asks a work's future: this backend's get_future() then
# answers at once (a completed future if the work is complete, else a pending one), starting
# no wait, and says it answered (``answered``): another backend's future is not taken as an
# answer (NCCL's completes when the work is queued, not when it ran).
_PROBE = threading.local()


def note_source(tensor: torch.Tensor, src: int) -> None:
    if id(tensor) not in _SOURCES:
        weakref.finalize(tensor, _SOURCES.pop, id(tensor), None)
    _SOURCES[id(tensor)] = src


def probing() -> bool:
    """Whether the current get_future() call is a wrapped is_completed()'s probe; if so, the
    caller answers it (this backend's works)."""
    if getattr(_PROBE, "on", False):
        _PROBE.answered = True
        return True
    return False


def install() -> None:
    """Wraps ``Work.is_completed`` and ``Work._source_rank`` (idempotent)."""
    from torch._C._distributed_c10d import Work

    if getattr(Work.is_completed, "_collsched", False):
        return
    completed, source_rank = Work.is_completed, Work._source_rank

    def is_completed(work: Any) -> bool:
        if completed(work):
            return True
        before = getattr(_PROBE, "on", False), getattr(_PROBE, "answered", False)
        _PROBE.on, _PROBE.answered = True, False
        try:
            fut = work.get_future()
            # Only this backend's works answer; any other keeps torch's own answer.
            return bool(_PROBE.answered and fut.done())
        except RuntimeError:  # a work without a future: torch's answer stands
            return False
        finally:
            _PROBE.on, _PROBE.answered = before

    def _source_rank(work: Any) -> int:
        try:
            return source_rank(work)
        except RuntimeError:
            fut = work.get_future()
            fut.wait()
            value = fut.value()
            src = _SOURCES.get(id(value[0])) if isinstance(value, list) and value else None
            if src is None:
                raise
            return src

    is_completed._collsched = True  # type: ignore[attr-defined]
    Work.is_completed = is_completed
    Work._source_rank = _source_rank
