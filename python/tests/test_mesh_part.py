"""Models sharded over part of the job: a slice of a (pp, dp) DeviceMesh given to
``fully_shard(mesh=...)``, each part its own world, against plain PyTorch computed here."""

from __future__ import annotations

import math

import part_workers as w
import pytest
import torch
from torch import nn

from ranks import run


def _reference(stage: int, dp_size: int, steps: int) -> tuple[list[list[float]], dict[str, list[float]], list]:
    """Plain PyTorch: stage ``stage``'s model stepped on the mean of its dp ranks' losses
    (the sharded gradient is their average), SGD with momentum; each rank's loss per step,
    the final values, the final momenta in parameter order."""
    torch.manual_seed(100 + stage)
    model = nn.Sequential(nn.Linear(w.IN, w.HIDDEN), nn.Tanh(), nn.Linear(w.HIDDEN, w.OUT)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    losses: list[list[float]] = [[] for _ in range(dp_size)]
    for step in range(steps):
        total = 0.0
        for r in range(dp_size):
            loss = model(w.batch(stage, r, step).double()).pow(2).mean()
            losses[r].append(loss.item())
            total = total + loss / dp_size
        total.backward()
        opt.step()
        opt.zero_grad()
    momenta = [opt.state[p]["momentum_buffer"].reshape(-1).tolist() for p in model.parameters()]
    return losses, {k: v.reshape(-1).tolist() for k, v in model.state_dict().items()}, momenta


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (what, len(got), len(want))
    for i, (a, b) in enumerate(zip(got, want)):
        assert math.isfinite(a) and abs(a - b) <= 1e-5 * max(1.0, abs(b)), (what, i, a, b)


@pytest.mark.parametrize("world", [4])
def test_each_pp_row_shards_over_its_dp_ranks_alone(world, tmp_path):
    steps, dp_size = 3, world // 2
    path = str(tmp_path / "ckpt")
    out = run(w.dp_parts, world, steps, path, init="collsched", timeout=240)
    # Both parts saved to one path: each into a directory of its own.
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["part-0-1", "part-2-3"]
    for stage in range(2):
        losses, params, momenta = _reference(stage, dp_size, steps)
        for r in range(dp_size):
            got = out[stage * dp_size + r]
            assert (got["stage"], got["dp_rank"]) == (stage, r), got
            assert got["ranks"] == [stage * dp_size + q for q in range(dp_size)], got["ranks"]
            _close(got["losses"], losses[r], f"stage {stage} dp rank {r} losses")
            assert sorted(got["params"]) == sorted(params), (sorted(got["params"]), sorted(params))
            for k in params:
                _close(got["params"][k], params[k], f"stage {stage} dp rank {r} {k}")
                assert got["loaded"][k] == got["params"][k], (stage, r, k)
            assert sorted(got["momenta"]) == list(range(len(momenta))), got["momenta"].keys()
            for i, m in enumerate(momenta):
                _close(got["momenta"][i], m, f"stage {stage} dp rank {r} momentum {i}")
            assert got["mixed"].startswith("CollschedError: fully_shard: parameter 0.weight was sharded over 2"), got
            assert "the same mesh=" in got["mixed"], got["mixed"]
    # The parts saved by stage name load into a job where each rank is a part of its own (dp 1).
    again = run(w.dp_reloaded, world, path + "-named", init="collsched", timeout=240)
    for rank, got in enumerate(again):
        saved = out[got["stage"] * dp_size]["params"]
        assert got["world"] == dp_size and sorted(got["loaded"]) == sorted(saved), (rank, got["world"])
        for k in saved:
            assert got["loaded"][k] == saved[k], (rank, k)
        assert got["unnamed"].startswith("CollschedError: load_checkpoint: no checkpoint of this model's part"), got
        assert "['stage0', 'stage1']" in got["unnamed"] and "part=NAME" in got["unnamed"], got["unnamed"]


def _plain(model: torch.nn.Module, steps: int, dp_size: int, n_micro: int) -> tuple[list, dict]:
    """Plain PyTorch in float64: the whole model, each step on the mean over dp ranks and
    micro-batches of the micro-batches' losses (SGD, lr 0.2). Returns each dp rank's
    micro-batch losses per step, and the final parameters by name."""
    model = model.double()
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    want: list[list[list[float]]] = [[] for _ in range(dp_size)]
    for step in range(steps):
        total = 0.0
        for r in range(dp_size):
            mine = []
            for m in range(n_micro):
                loss = model(w.batch(0, r, step * n_micro + m).double()).pow(2).mean()
                mine.append(loss.item())
                total = total + loss / (dp_size * n_micro)
            want[r].append(mine)
        total.backward()
        opt.step()
        opt.zero_grad()
    return want, {k: v.reshape(-1).tolist() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind,n_micro", [("GPipe", 2), ("1F1B", 4)])
def test_a_pipeline_schedule_over_sharded_stages_gives_plain_pytorchs_losses(kind, n_micro):
    world, steps = 4, 3
    dp_size = world // 2
    out = run(w.pipelined, world, steps, n_micro, kind, init="collsched", timeout=300)
    want, final = _plain(w.stage_model(0), steps, dp_size, n_micro)
    names = {0: {"0.weight": "0.weight", "0.bias": "0.bias"}, 1: {"0.weight": "2.weight", "0.bias": "2.bias"}}
    for rank, got in enumerate(out):
        stage, r = rank // dp_size, rank % dp_size
        assert (got["stage"], got["dp_rank"]) == (stage, r), got
        if stage == 1:
            assert len(got["losses"]) == steps, got["losses"]
            for step in range(steps):
                _close(got["losses"][step], want[r][step], f"rank {rank} step {step} losses")
        else:
            assert got["losses"] == [], got["losses"]
        assert sorted(got["params"]) == sorted(names[stage]), got["params"].keys()
        for k, ref in names[stage].items():
            _close(got["params"][k], final[ref], f"rank {rank} {k}")
        # The schedule defers the stage's reduction to its end, as on an FSDP2 stage: one
        # library step reduces, once a schedule step (not once a micro-batch).
        assert got["reductions"] == [1] * steps, (rank, got["reductions"])


@pytest.mark.parametrize("defer", [False, True], ids=["wait", "defer-wait"])
def test_an_interleaved_schedule_over_two_sharded_stages_a_rank_gives_plain_pytorchs_losses(defer):
    """``ScheduleInterleaved1F1B`` drives each stage by FSDP2's methods (``unshard(async_op=True)``,
    ``reshard``, ``finalize_backward``; with ``defer_reduce_grad_wait`` it also reads the stages'
    communication contexts): four stages, two a rank, each a collsched root over its dp ranks."""
    world, steps, n_micro = 4, 3, 4
    dp_size = world // 2
    out = run(w.interleaved, world, steps, n_micro, defer, init="collsched", timeout=300)
    want, final = _plain(w.deep_model(), steps, dp_size, n_micro)
    for rank, got in enumerate(out):
        p, r = rank // dp_size, rank % dp_size
        assert (got["pp"], got["dp_rank"]) == (p, r), got
        if p == 1:
            assert len(got["losses"]) == steps, got["losses"]
            for step in range(steps):
                _close(got["losses"][step], want[r][step], f"rank {rank} step {step} losses")
        else:
            assert got["losses"] == [], got["losses"]
        mine = {f"{i}.{leaf}" for s in (p, p + 2) for i in w.DEEP_STAGES[s][:1] for leaf in ("weight", "bias")}
        assert sorted(got["params"]) == sorted(mine), got["params"].keys()
        for k in mine:
            _close(got["params"][k], final[k], f"rank {rank} {k}")
