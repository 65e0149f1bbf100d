"""Tensor-parallel models sharded over the data-parallel dimension of a 2-D (dp, tp) mesh
(FSDP2's 2-D sharding: ``parallelize_module`` on ``mesh["tp"]``, ``fully_shard(mesh=mesh["dp"])``),
against plain unsharded PyTorch computed here."""

from __future__ import annotations

import math

import pytest
import torch
import tp_workers as w

from ranks import run


def _reference(dp_size: int, steps: int) -> dict:
    """Plain PyTorch in float64: the model stepped on the mean of the dp ranks' losses (the
    sharded gradient is their average), gradients clipped to norm 0.5, Adam; each dp rank's
    losses, the norms, the final values and Adam's first moments in parameter order."""
    m = w.model(0).double()
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    losses: list[list[float]] = [[] for _ in range(dp_size)]
    norms = []
    for step in range(steps):
        total = 0.0
        for r in range(dp_size):
            loss = m(w.batch(r, step).double()).pow(2).mean()
            losses[r].append(loss.item())
            total = total + loss / dp_size
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    moments = [opt.state[p]["exp_avg"].reshape(-1).tolist() for p in m.parameters()]
    params = {k: v.reshape(-1).tolist() for k, v in m.state_dict().items()}
    return {"losses": losses, "norms": norms, "params": params, "moments": moments}


def _close(got: list[float], want: list[float], what: str, tol: float) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert math.isfinite(a) and abs(a - b) <= tol * max(1.0, abs(b)), (what, i, a, b)


@pytest.mark.parametrize(
    "world,checkpointed,bf16,reshard",
    [(4, False, False, None), (4, True, False, None), (4, False, True, None), (8, True, False, 2)],
    ids=["plain", "checkpointed", "bf16", "reshard-2-of-4"],
)
def test_a_tensor_parallel_model_sharded_over_dp_trains_as_plain_pytorch(world, checkpointed, bf16, reshard, tmp_path):
    """The (dp, tp) model trained against plain PyTorch; at dp 4 with the blocks'
    ``reshard_after_forward=2`` (and activation checkpointing), each backward gathers the
    blocks' local shards from the post-forward layout, within pairs of dp ranks."""
    steps = 3
    dp_size = world // 2
    path = str(tmp_path / "dcp")
    out = run(w.train_2d, world, steps, path, checkpointed, bf16, reshard, init="collsched", timeout=300)
    ref = _reference(dp_size, steps)
    # float32 sharded and tensor-parallel (partial sums in another order) against float64
    # (1e-7 passes here); gathered in bfloat16 (8 bits of mantissa), about its rounding.
    tol = 2e-2 if bf16 else 1e-6
    # Adam turns the rounding of a gradient near zero into a step of up to lr either way: in
    # bfloat16 the values may differ by 2 lr a step.
    value_tol = 2 * 0.01 * steps if bf16 else tol
    for rank in range(world):
        got = out[rank]
        assert got["dp_rank"] == rank // 2, got["dp_rank"]
        _close(got["losses"], ref["losses"][got["dp_rank"]], f"rank {rank} losses", tol)
        _close(got["norms"], ref["norms"], f"rank {rank} clipped norms", tol)
        _close(got["totals"], ref["norms"], f"rank {rank} get_total_norm", tol)
        for key in ("params", "full", "loaded"):
            assert sorted(got[key]) == sorted(ref["params"]), (key, sorted(got[key]))
            for k, v in ref["params"].items():
                _close(got[key][k], v, f"rank {rank} {key} {k}", value_tol)
        # The checkpoint's round trip is exact.
        assert got["loaded"] == got["params"], rank
        assert sorted(got["moments"]) == list(range(len(ref["moments"]))), sorted(got["moments"])
        for i, want in enumerate(ref["moments"]):
            _close(got["moments"][i], want, f"rank {rank} Adam moment {i}", tol)
        # Tensor-parallel parameters on (dp, tp) as FSDP2 places them; the others over dp alone.
        # In float32 (the masters, under mixed precision).
        placed = got["placements"]
        assert placed["blocks.0.up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0)) torch.float32", placed
        assert placed["blocks.1.down.weight"] == "(Shard(dim=0), Shard(dim=1)) torch.float32", placed
        assert placed["blocks.0.down.bias"] == "(Shard(dim=0), Replicate()) torch.float32", placed
        assert placed["head.weight"] == "(Shard(dim=0),) torch.float32", placed
        # Gathered from the post-forward layout in each backward: two blocks, one bucket or
        # more each (none without the setting).
        want = [{2: n} for n in [got["post"][0].get(2, 0)] * steps] if reshard else [{}] * steps
        assert got["post"] == want and (not reshard or want[0][2] >= 2), (rank, got["post"])
    # Every rank the same values.
    for rank in range(1, world):
        assert out[rank]["params"] == out[0]["params"], rank


def test_a_dcp_checkpoint_of_a_2d_model_loads_into_a_1d_one(tmp_path):
    world = 4
    path = str(tmp_path / "dcp")
    out = run(w.train_2d, world, 2, path, False, init="collsched", timeout=300)
    loaded = run(w.load_1d, world, path, init="collsched", timeout=240)
    for rank in range(world):
        assert loaded[rank] == out[0]["params"], rank


def test_what_a_tensor_parallel_model_refuses_is_named(tmp_path):
    out = run(w.refusals, 4, str(tmp_path / "ckpt"), init="collsched", timeout=240)
    for rank, got in enumerate(out):
        error = "collsched.CollschedError: "
        whole = got["whole_job"]
        assert whole.startswith(error + "fully_shard: parameter blocks.0.up.weight is a DTensor"), (rank, whole)
        assert "mesh=world_mesh['dp']" in got["whole_job"], got["whole_job"]
        assert got["save_full"].startswith(error + "save_full: the model has tensor-parallel"), got["save_full"]
        assert got["layout"].startswith(error + "load_checkpoint: the checkpoint at"), got["layout"]
        assert "nothing was loaded" in got["layout"], got["layout"]
        assert "holds parameter blocks.0.down.bias cut (Replicate(),)" in got["layout"], got["layout"]
        assert got["same_layout"] == "no error", got["same_layout"]
        assert got["same_values"] == "True", got
        spmd = {
            "spmd_plain": "parameter blocks.0.norm.weight is a plain tensor; under dp_mesh_dims every parameter",
            "spmd_placed": "parameter head.weight is placed (Shard(dim=0), Shard(dim=1)) on mesh ('dp', 'tp'); "
            "under dp_mesh_dims it must be Replicate() on the data-parallel dimensions ['dp']",
            "spmd_names": "dp_mesh_dims names dimension 'cp', which mesh of dimensions ('dp', 'tp') lacks",
            "spmd_ddp": "replicates without sharding (DDP, strategy 'hybrid:1'); strategy='flat' says otherwise",
            "spmd_backwards": "dp_mesh_dims.shard=('tp', 'dp') are not neighbouring dimensions in mesh order",
            "spmd_same": "names 'dp' twice (to shard over and to replicate over",
            "spmd_mixed": "parameter blocks.0.norm.weight was sharded with dp_mesh_dims over ['dp'] of mesh "
            "('dp', 'tp') (a block's call), the root Net without dp_mesh_dims",
            "spmd_int": "reshard_after_forward=2 (a number of ranks) with dp_mesh_dims is not supported",
        }
        assert got["spmd_order"] == "no error", got["spmd_order"]
        for key, want in spmd.items():
            assert got[key].startswith(error + "fully_shard: ") and want in got[key], (rank, key, got[key])


@pytest.mark.parametrize("no_sync,backend", [(False, "shm"), (True, "shm"), (True, "emulated")])
def test_sequence_parallel_norms_partial_gradients_are_reduced_over_tp(no_sync, backend):
    world, steps = 4, 3
    # The "collsched" process group joins the job on shm: the emulated world joins through gloo's.
    init = "collsched" if backend == "shm" else "torch"
    out = run(w.sequence_parallel, world, steps, no_sync, backend, init=init, timeout=300)
    # Plain PyTorch in float64 on whole sequences, stepped on the mean of the dp ranks' losses.
    m = w.model(0).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses: list[list[float]] = [[], []]
    for step in range(steps):
        total = 0.0
        for r in range(2):
            loss = m(w.seq_batch(r, step).double()).pow(2).mean()
            losses[r].append(loss.item())
            total = total + loss / 2
        total.backward()
        opt.step()
        opt.zero_grad()
    params = {k: v.reshape(-1).tolist() for k, v in m.state_dict().items()}
    for rank, got in enumerate(out):
        _close(got["losses"], losses[rank // 2], f"rank {rank} losses", 1e-6)
        assert sorted(got["params"]) == sorted(params), sorted(got["params"])
        for k, v in params.items():
            _close(got["params"][k], v, f"rank {rank} {k}", 1e-6)
        # The head's 5 rows are cut 3 and 2 over tp: whole local tensors, replicated over dp;
        # the up projection's 10 rows evenly: strided over dp.
        assert got["placements"]["head.weight"] == "(Replicate(), Shard(dim=0))", got["placements"]
        assert got["placements"]["blocks.0.up.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", got[
            "placements"
        ]
        assert got["placements"]["blocks.0.norm.weight"] == "(Shard(dim=0), Replicate())", got["placements"]


def test_a_meta_device_tensor_parallel_model_takes_rank_0s_values():
    out = run(w.meta_init, 4, init="collsched", timeout=240)
    ref = w.model(0)
    want = {k: v.reshape(-1).tolist() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        losses = [ref(w.batch(r, 0)).pow(2).mean().item() for r in range(2)]
    for rank, got in enumerate(out):
        # Values exact (copied, never computed); the forward in float32 through tp's partial sums.
        assert got["values"] == want, rank
        _close([got["loss"]], [losses[rank // 2]], f"rank {rank} loss", 1e-6)


@pytest.mark.parametrize(
    "layout,micro",
    [("dp-tp", 1), ("hsdp", 1), ("dp-tp", 2), ("flat", 1), ("ddp-tp", 1)],
    ids=["dp-tp", "hsdp", "dp-tp-no-sync", "flattened", "ddp-tp"],
)
def test_a_model_of_dtensors_on_the_whole_mesh_shards_over_dp_mesh_dims_as_fsdp2_does(layout, micro, tmp_path):
    """FSDP2's ``dp_mesh_dims`` form against plain PyTorch and FSDP2: parameters DTensors on
    the whole mesh (``tp_workers.SPMD_LAYOUTS``: (dp 2, tp 2); (rep 2, dp 2) for HSDP; (dp 2,
    cp 2) sharded over both flattened; (rep 2, tp 2) replicated over rep, DDP), the loss a
    DTensor mean over the global batch. FSDP2 averages each data-parallel rank's part of that
    gradient over them, so each step takes the plain gradient over the number of data-parallel
    ranks (computed so here); collsched the same, exact to float32's rounding, its state dict
    placed as FSDP2's. With ``micro`` micro-batches a step (the first ones without gradient
    synchronization) the step takes the sum of theirs."""
    world, steps = 4, 3
    tp = w.SPMD_LAYOUTS[layout][3]
    dp_size = world // 2 if tp else world
    m = w.model(0).double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses, norms = [], []
    for step in range(steps):
        for k in range(micro):
            loss = m(torch.cat([w.batch(r, step * micro + k) for r in range(dp_size)]).double()).pow(2).mean()
            losses.append(loss.item())
            (loss / dp_size).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)))
        opt.step()
        opt.zero_grad()
    params = {k: v.reshape(-1).tolist() for k, v in m.state_dict().items()}
    path = str(tmp_path / "ckpt")
    got = run(w.train_spmd, world, steps, "collsched", layout, path, micro, init="collsched", timeout=300)
    fsdp2 = run(w.train_spmd, world, steps, "fsdp2", layout, "", micro, init="torch", timeout=300)
    for rank in range(world):
        for name, out in (("collsched", got[rank]), ("fsdp2", fsdp2[rank])):
            _close(out["losses"], losses, f"{name} rank {rank} losses", 1e-6)
            _close(out["norms"], norms, f"{name} rank {rank} norms", 1e-6)
            assert sorted(out["params"]) == sorted(params), (name, sorted(out["params"]))
            for k, v in params.items():
                _close(out["params"][k], v, f"{name} rank {rank} {k}", 1e-6)
        assert got[rank]["placements"] == fsdp2[rank]["placements"], (rank, got[rank]["placements"])
        # save_checkpoint, then load_checkpoint into a fresh model (other initial values): exact.
        assert got[rank]["loaded"] == got[rank]["params"], rank
    want = {
        "dp-tp": "(_StridedShard(dim=0, sf=2), Shard(dim=0))",
        "hsdp": "(Replicate(), Shard(dim=0))",
        "flat": "(Shard(dim=0),)",
        "ddp-tp": "(Replicate(), Shard(dim=0))",
    }[layout]
    assert got[0]["placements"]["blocks.0.up.weight"] == want, got[0]["placements"]


@pytest.mark.parametrize("layout", sorted(w.FAKE_LAYOUTS))
def test_dp_mesh_dims_state_dict_placements_are_fsdp2_s_on_16_ranks(layout):
    """Layouts this machine cannot run (16 ranks: HSDP with flattened shard dimensions beside
    tensor parallelism, the replicate dimension before or after them; tp first in the mesh;
    DDP over two names), each on torch's fake process group as three of its ranks: a state
    dict's DTensor as collsched places it has the placements, the mesh and the local values
    of FSDP2's sharded parameter."""
    for as_rank in (0, 5, 11):
        got = run(w.fake_placements, 1, layout, as_rank, timeout=120)[0]
        assert got["ours"] == got["fsdp2"], (layout, as_rank, got)
        assert got["ours"][2], (layout, as_rank, "no local values")
