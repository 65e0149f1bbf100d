"""The pieces of a sharded model that ``fully_shard`` builds: a parameter (``_Param``: its shard,
its full value's views) and a unit (``_Unit``: a module whose parameters are fetched and
released together), ``_tensor``, a tensor over a region of library memory, and the autograd
pieces of a pass (``_Frame``, ``_PostBackward``, ``_needing_grad``, ``_recomputing``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .. import _native, params_json
from .world import _FROM_TORCH


def _tensor(region: Any, dtype: torch.dtype, shape: Any, device: torch.device) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` viewing ``region`` (library memory, on the host or on a
    CUDA device); an empty tensor on ``device`` for ``None``."""
    if region is None:
        return torch.empty(0, dtype=dtype, device=device)
    if region.device is None:
        return torch.frombuffer(region, dtype=dtype).view(shape)
    return torch.from_dlpack(region.dlpack(_FROM_TORCH[dtype], list(shape)))


def library_model(
    world: Any, params: list[_Param], trainable: list[bool], values: Any, strategy: str, bucket_mb: float
) -> Any:
    """The library's model over ``params`` (``values``: their full values, or None for zeros),
    buckets ending at the units, as every model of a sharded root has them."""
    entries = [
        {
            "name": p.name,
            "shape": list(p.shape),
            "dtype": _FROM_TORCH[p.dtype],
            "trainable": t,
            "module": f"unit{p.unit}",
        }
        for p, t in zip(params, trainable)
    ]
    return _native.Model(world, params_json(entries), values, strategy, float(bucket_mb), 256, "module")


class _Param:
    """One parameter of a sharded model: its shard (registered in the modules), the full-size
    parameter forward and backward use, and where it lives."""

    __slots__ = (
        "pid",
        "name",
        "shape",
        "dtype",
        "numel",
        "nbytes",
        "shard",
        "home",
        "own",
        "offset",
        "full",
        "placeholder",
        "unit",
        "views",
        "addr",
        "tp",
        "spmd",
    )

    def __init__(self, pid: int, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
        self.pid = pid
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.numel = shape.numel()
        self.nbytes = self.numel * dtype.itemsize
        # Right shape, one element of memory, reads as zeros: what the full parameter holds
        # while it is not gathered (autograd checks shapes, never reads it).
        self.placeholder = (
            torch.zeros(1, dtype=dtype, device=device).expand(shape)
            if len(shape)
            else torch.zeros((), dtype=dtype, device=device)
        )
        self.shard: nn.Parameter = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
        # The shard's data as the library placed it (a view of its memory), kept to check and
        # restore what the module's conversions do to the shard.
        self.home = self.shard.data
        # What the shard's data is: ``home``, or under mixed precision the f32 master;
        # ``offset``: its first element's index in the flattened parameter.
        self.own = self.home
        self.offset = 0
        self.full: nn.Parameter = nn.Parameter(self.placeholder, requires_grad=False)
        self.unit = 0
        # Views of gathered buffers made for this parameter, by address (buffers come back
        # from the pool at the addresses they had: a view is made once per address), and the
        # address the full parameter's data views now (0: the placeholder).
        self.views: dict[int, torch.Tensor] = {}
        self.addr = 0
        # A tensor-parallel parameter's spec (``tp.py``; ``shape`` is then its local tensor's),
        # of the gathers' dtype, or None; under dp_mesh_dims, its ``tp.Spmd``.
        self.tp: Any = None
        self.spmd: Any = None

    @property
    def tp_dp(self) -> tuple[int, ...]:
        """Under dp_mesh_dims, the indices of the parameter's mesh's data-parallel dimensions
        (the library reduces over them; ``tp.local_grad`` keeps them); else none."""
        return () if self.spmd is None else self.spmd.dp

    @property
    def global_shape(self) -> torch.Size:
        """The parameter's shape as the model has it (a tensor-parallel one's global shape)."""
        return self.shape if self.tp is None else self.tp.shape

    def gathered(self) -> torch.Tensor:
        """The tensor the full parameter's data is now (a tensor-parallel one's local tensor)."""
        return self.full.data if self.tp is None else self.full._local_tensor

    def point(self, view: torch.Tensor) -> None:
        """The full parameter views ``view`` (a tensor-parallel one: its local tensor does)."""
        if self.tp is None:
            self.full.data = view
        else:
            self.full._local_tensor = view


class _Unit:
    """A module given to ``fully_shard``: the parameters its forward uses (its own and those
    of submodules that are not units themselves), fetched together."""

    __slots__ = (
        "index",
        "module",
        "members",
        "slots",
        "swaps",
        "ids",
        "params",
        "shared",
        "known",
        "fetched",
        "swapped",
        "grads",
        "reshard",
        "post",
        "captured",
        "kept",
        "exposed",
        "reshard_bwd",
        "held",
        "manual",
        "output_dtype",
    )

    def __init__(self, index: int, module: nn.Module) -> None:
        self.index = index
        self.module = module
        # The modules of FSDP2's fully_shard([...]) list (``module`` first), or ``module`` alone.
        self.members = [module]
        self.slots: list[tuple[nn.Module, str, int]] = []
        # Per slot: the module's parameter dict, the name, the full parameter, the shard.
        self.swaps: list[tuple[dict[str, Any], str, nn.Parameter, nn.Parameter]] = []
        self.ids: list[int] = []
        self.params: list[_Param] = []
        # Whether another unit fetches one of these parameters too (a tied parameter): its
        # full parameter may then view another address than this unit's last fetch left.
        self.shared = False
        # The addresses of the parameters' full values at this unit's last fetch (what the
        # library is told it knows).
        self.known: list[int] = []
        self.fetched: Any = None
        # Whether the full parameters are in the modules now (in the unit's forward, and from
        # its pre-backward to its release).
        self.swapped = False
        # The trainable parameters this unit owns: their gradients are its to hand over.
        self.grads: list[_Param] = []
        # ``reshard_after_forward``: released after a training forward (True), or kept fetched
        # into the backward (False; ``kept`` while so held).
        self.reshard = True
        self.kept = False
        # Kept past a forward, where modules run after the pass (a chunked loss's head) save
        # the full parameters for their backward as they are, not through the saved-tensor
        # hooks: :meth:`expire` at its release.
        self.exposed = False
        # An int ``reshard_after_forward`` below the shard group's size: the ranks each of its
        # parameters is resharded to after a training forward (0: none such), and whether this
        # step's forward has put its pieces there (``post_forward.py``).
        self.post = 0
        self.captured = False
        # ``reshard_after_backward``: released after its backward (True), or kept fetched from
        # a backward that did not synchronize into the next forward (False; ``held`` while so
        # held, its full parameters left in its modules, as FSDP2 leaves them).
        self.reshard_bwd = True
        self.held = False
        # Fetched by ``module.unshard()`` (between steps, for reading) until ``reshard()``.
        self.manual = False
        # Mixed precision's output_dtype of this unit's own fully_shard call, or None.
        self.output_dtype: torch.dtype | None = None

    def expire(self) -> None:
        """Released after being kept past a forward: the full parameters' version counters
        move on, so a backward that still reads one saved outside the saved-tensor hooks (one
        more backward through a retained graph) raises autograd's error about a tensor modified
        in place, instead of reading a buffer that another gather may have reused."""
        self.exposed = False
        torch.autograd.graph.increment_version([p.full for p in self.params])


class _Frame:
    """One unit forward in progress, from its pre-hook to its hook: the module, the exception being
    handled when it began (``raised``; another one at its end means the forward raised), and
    for a pass's first call its engine, the engine of the pass around it (``outer``) and the
    saved-tensor hooks it pushed; the units it fetched and whether in training."""

    __slots__ = ("module", "raised", "engine", "outer", "saved", "entered")

    def __init__(self, module: nn.Module, raised: BaseException | None) -> None:
        self.module = module
        self.raised = raised
        self.engine: Any = None
        self.outer: Any = None
        self.saved: Any = None
        self.entered: list[tuple[_Unit, bool]] = []


def _recomputing(state: Any) -> bool:
    """Whether a unit's forward called now is a recomputation in the backward (autograd is
    running a backward on this thread, outside any forward pass of ``state``'s)."""
    return state.engine is None and torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _needing_grad(out: Any) -> list[torch.Tensor]:
    """The tensors in ``out`` (nested in lists, tuples and dicts) that need a gradient."""
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _needing_grad(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _needing_grad(o)]
    return []


class _PostBackward(torch.autograd.Function):
    """Passes a unit's arguments through unchanged; its backward runs once their gradients
    are computed, that is once the unit's own backward is done."""

    @staticmethod
    def forward(ctx: Any, state: Any, unit: _Unit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.state._post_backward(ctx.unit)
        return (None, None, *grads)
