"""collsched.torch: shard PyTorch modules the way FSDP2's ``fully_shard`` does, on collsched.

::

    import collsched.torch as cst
    cst.init()                                  # torchrun's environment, or torch.distributed's
    for block in model.blocks:
        cst.fully_shard(block)                  # a unit: its parameters are fetched together
    cst.fully_shard(model)                      # the root: one plan for the whole model
    opt = torch.optim.AdamW(model.parameters()) # on this rank's shards

How it works (one rank):

- **Sharding.** Each ``fully_shard`` call builds (or, for a root over already-sharded units,
  rebuilds) one collsched model over every parameter under the module. Each parameter is
  replaced in its module by a 1-D ``Parameter`` over this rank's elements of it (the shard,
  in the library's memory: the optimizer updates it in place and the next gather reads it;
  under a ``MixedPrecisionPolicy`` it is the parameter's own dtype, cast into the library's
  shard of ``param_dtype`` at each pass's start). Bucket boundaries follow the units.
- **Forward.** Hooks around a unit's own ``forward`` (the module keeps its class's name,
  forward and signature) fetch its parameters (their buckets are all-gathered,
  later ones prefetched along the recorded order) and swap in full-size parameters whose data
  are views of the gathered buffers (no copy); after its forward they are released and the
  shards swapped back (or, with ``reshard_after_forward=False``, kept into its backward; with
  an int ``N`` below the shard group's size, this rank's piece of a ``1/N`` layout copied out first, which
  the backward gathers within ``N`` ranks: ``post_forward.py``).
  Tensors autograd saves that view gathered parameters are kept as references, not as
  memory, and fetched again in backward (``saved_tensors_hooks``, in native code: torch calls
  them for every tensor saved, activations included).
- **Backward.** A unit is fetched again, its full parameters back in its modules, once the
  gradient of one of its outputs is computed (FSDP2's pre-backward hook), or when autograd
  first needs one of its saved parameters if that comes first. A forward that activation
  checkpointing (``torch.utils.checkpoint``, reentrant or not, ``checkpoint_wrapper``) runs
  again in the backward finds them there; a unit's forward recomputed so keeps its unit
  fetched until the unit's backward is done. Its tensor arguments that need a gradient pass
  through an autograd function in the forward, whose backward runs once the unit's backward
  is done (FSDP2's post-backward hook): then the unit's accumulated gradients go to the library in one call, gradient
  buckets are reduce-scattered as they fill, and the unit is released (or, with
  ``set_reshard_after_backward(False)`` and a backward under no_sync, held into the next
  forward). Gradients not in by
  then (a tied parameter's, a unit without such arguments, the root) go at the end of the
  backward, when the step ends and each shard's ``.grad`` gets the reduced (mean over ranks)
  gradient of its elements, added to what is there (``zero_grad`` as usual).
- **Passes without backward** (``torch.no_grad()``, an exception in a forward,
  ``KeyboardInterrupt`` included) leave nothing fetched: evaluation passes run on a second
  engine of the same model, and an aborted pass releases what it fetched. A training forward
  whose output is dropped leaves the units kept into their backward (the root, by default)
  fetched: the next training pass goes on with them, and its backward releases them.

On the ``cuda`` backend (``init(backend="cuda")``) the same pass runs on the device: the
shards, the full parameters' views and the reduced gradients are library memory on the GPU
(DLPack ``kDLCUDA``), a fetch makes torch's current stream wait for the gathers, a release
frees buffers only after what that stream queued so far, gradients go over in the reduction
dtype on that stream, and under ``no_sync`` they accumulate beside the library, in the
reduction dtype, until the synchronized micro-batch.

State dicts and checkpoints: ``module.state_dict()`` gives each sharded parameter as a
DTensor of its global shape (``Shard(0)`` over torch.distributed's default group), an
optimizer's ``state_dict()`` its shard-shaped states likewise, and both load full values or
DTensors, so torch.distributed.checkpoint saves and loads them into any world size
(``state_dict.py``, ``optim_state.py``); :func:`save_checkpoint` / :func:`load_checkpoint` do
it without torch.distributed. A model built on the meta device is sharded without values and
loaded afterwards.

Gradient clipping: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` (importing
this package makes it sharding-aware), or :func:`clip_grad_norm_` by name, takes the norm over
every rank's elements, as FSDP2's DTensor parameters do (torch's own, on a rank's shards, would
clip each rank by its shard's norm).

Traces: :func:`flight_record` holds this rank's last collectives and, on a host backend,
each unit's forward and backward compute (``collsched flight DIR --trace-out`` draws both);
:func:`workload_record` writes the model and its measured compute as the simulator's workload,
so ``collsched sim --against`` lays a real step beside the simulated one (``spans.py``).

Knobs are the arguments of :func:`fully_shard` and :func:`init`; errors are
:class:`collsched.CollschedError` and its subclasses, with the library's message.

The ``"collsched"`` torch.distributed backend (``dist.init_process_group("collsched")``), which
importing this package registers, is :mod:`collsched.torch.distributed`. The files:
``world.py`` (joining the job), ``module.py`` (``fully_shard`` and the module's methods),
``shard.py`` (a root's sharded model and its hooks), ``build.py`` (its build), ``units.py`` (parameters and units),
``values.py`` (initial values, mixed precision's f32 masters, CPU offload),
``state_dict.py`` (``state_dict()`` as DTensors, ``load_state_dict``), ``optim_state.py``
(an optimizer's state dict likewise), ``tp.py`` (tensor-parallel DTensor parameters, sharded
over the data-parallel dimension of a 2-D mesh),
``compat.py`` (FSDP2's module methods met otherwise or refused), ``finalize.py`` (manual
backward finalization, ``reset_iter_state``),
``checkpoint.py`` (checkpoints), ``clip.py`` (gradient clipping), ``spans.py`` (the compute
track, the simulator's workload), ``distributed.py`` (the process group backend).
"""

from __future__ import annotations

from .._native import CollschedError
from . import clip, distributed
from .checkpoint import full_state_dict, load_checkpoint, save_checkpoint, save_full
from .clip import clip_grad_norm_
from .finalize import GradientReductionHandle
from .module import (
    CollschedModule,
    UnshardHandle,
    full_parameters,
    fully_shard,
    live_bytes,
    plan,
    register_fsdp_forward_method,
    stats,
)
from .spans import workload_record
from .values import CPUOffloadPolicy, MixedPrecisionPolicy
from .world import empty_cache, flight_record, init, memory_stats, world

__all__ = [
    "CPUOffloadPolicy",
    "CollschedError",
    "CollschedModule",
    "GradientReductionHandle",
    "MixedPrecisionPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "empty_cache",
    "flight_record",
    "fully_shard",
    "full_parameters",
    "full_state_dict",
    "save_full",
    "load_checkpoint",
    "save_checkpoint",
    "init",
    "live_bytes",
    "memory_stats",
    "plan",
    "register_fsdp_forward_method",
    "stats",
    "workload_record",
    "world",
]

distributed.register()
clip.install()
