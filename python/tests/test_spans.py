"""collsched.torch's compute track (``spans.py``): each unit's forward and backward compute in
the flight record, beside the collectives, with the hooks' own work left out; the workload it
writes for the simulator; both read by ``collsched flight`` and ``collsched sim --against``."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
from collections import defaultdict
from typing import Any

import pytest

import models
import parity
import spans_workers
from ranks import run
from test_api import cli

SPEC = {"model": "gpt", "steps": 3, "bucket_mb": 0.002, "eval_after": True}
UNITS = 3  # the root and the gpt's two blocks


@pytest.fixture(scope="module", params=[None, ("call", False), ("call", True)], ids=["plain", "recompute", "reentrant"])
def traced(request, tmp_path_factory):
    """Every rank's run and the folder of their records; with activation checkpointing around
    the blocks, non-reentrant or reentrant (a block's forward recomputed in its backward counts
    there; a reentrant checkpoint's first forward runs under no_grad, and counts as forward)."""
    out = tmp_path_factory.mktemp("flight")
    spec = dict(SPEC, recompute=request.param)
    runs = run(spans_workers.traced, 2, spec, str(out))
    parity.check(runs, models.reference(spec, 2))
    return out, runs


def by_step(compute: list[dict]) -> dict[int, list[dict]]:
    steps = defaultdict(list)
    for c in compute:
        steps[c["step"]].append(c)
    return steps


def pieces(spans: list[dict]) -> list[str]:
    """The span names in order, a run of one name once (a recomputation inside a unit's
    backward splits its span)."""
    out: list[str] = []
    for c in spans:
        if not out or out[-1] != c["name"]:
            out.append(c["name"])
    return out


# A step of the gpt: the root's embeddings, block 1, the root between the blocks, block 2, the
# root's norm and head; the loss; backward the other way; the update (the optimizer step), when
# a pass came after it to end it.
STEP = ["forward 0", "forward 1", "forward 0", "forward 2", "forward 0", "loss"]
STEP += ["backward 0", "backward 2", "backward 0", "backward 1", "backward 0", "update"]


def test_each_unit_has_its_forward_and_backward_spans_every_step(traced):
    _out, runs = traced
    for rank, r in enumerate(runs):
        compute = r["record"]["compute"]
        steps = by_step(compute)
        # One pass a step; the evaluation pass after them adds none.
        assert sorted(steps) == list(range(SPEC["steps"])), (rank, sorted(steps))
        for step, spans in steps.items():
            for c in spans:
                assert re.fullmatch(r"(forward|backward) [0-9]+|loss|update", c["name"]), c
                assert 0 < c["start_ns"] <= c["end_ns"], c
            assert pieces(spans) == STEP, (rank, step, pieces(spans))
        # One thread's compute, one span at a time, in the order they ran.
        for a, b in zip(compute, compute[1:]):
            assert a["end_ns"] <= b["start_ns"], (rank, a, b)


def test_the_hooks_collectives_are_launched_outside_the_compute_spans(traced):
    """The fetches, releases and gradient hand-overs (where every collective of a pass is
    launched) are not in the compute spans: no collective's launch falls inside one (the
    update's span ends where the loop gathers the whole model)."""
    _out, runs = traced
    for rank, r in enumerate(runs):
        compute = r["record"]["compute"]
        entries = r["record"]["entries"]
        first, last = compute[0]["start_ns"], compute[-1]["end_ns"]
        launched = [e["launched_ns"] for e in entries if first <= e["launched_ns"] <= last]
        kinds = {e["op"] for e in entries if first <= e["launched_ns"] <= last}
        assert len(launched) >= 3 * SPEC["steps"] and {"all_gather", "reduce_scatter"} <= kinds, (rank, kinds)
        for t in launched:
            inside = [c for c in compute if c["start_ns"] < t < c["end_ns"]]
            assert not inside, (rank, t, inside)


def median_passes(compute: list[dict]) -> dict[str, float]:
    """Each span name's FLOPs a step at 1 TFLOP/s (a unit's pieces summed), the median of the
    steps after the first (here two: their mean)."""
    steps = by_step(compute)
    want = defaultdict(list)
    for step in range(1, SPEC["steps"]):
        sums = defaultdict(float)
        for c in steps[step]:
            sums[c["name"]] += (c["end_ns"] - c["start_ns"]) * 1e-9 * 1e12
        for name, flops in sums.items():
            want[name].append(flops)
    assert all(len(v) == 2 for v in want.values()) and len(want) == 2 * UNITS + 2, want
    return {name: sum(v) / 2 for name, v in want.items()}


def test_the_workload_is_the_model_and_its_slowest_rank_measured(traced):
    _out, runs = traced
    # Each span's median step on each rank; the workload holds the slowest rank's.
    medians = [median_passes(r["record"]["compute"]) for r in runs]
    want = {name: max(m[name] for m in medians) for name in medians[0]}
    for rank, r in enumerate(runs):
        w = r["workload"]
        assert w["format"] == "collsched-workload" and w["version"] == 1, w
        # Every parameter once, with its full shape (the shape collsched shards), f32.
        assert {p["name"]: p["shape"] for p in w["params"]} == r["shapes"], rank
        assert all(p["dtype"] == "f32" and p["trainable"] for p in w["params"]), w["params"]
        named = [n for layer in w["layers"] for n in layer["params"]]
        assert sorted(named) == sorted(r["shapes"]), named
        # Each parameter in its unit's layer and module (the root's embeddings, norm and tied
        # head: unit 0; block k's: unit k + 1).
        for p in w["params"]:
            block = re.match(r"blocks\.([0-9]+)\.", p["name"])
            unit = f"unit {int(block.group(1)) + 1}" if block else "unit 0"
            assert p["module"] == unit, p
            assert p["name"] in next(layer["params"] for layer in w["layers"] if layer["name"] == unit), p
        assert [layer["name"] for layer in w["layers"]] == [f"unit {u}" for u in range(UNITS)]
        assert w["forward_order"] == ["unit 0", "unit 1", "unit 2"], w["forward_order"]
        assert w["backward_order"] == ["unit 0", "unit 2", "unit 1"], w["backward_order"]
        for u, layer in enumerate(w["layers"]):
            for kind in ("forward", "backward"):
                got = layer[f"{kind}_flops"]
                assert got > 0 and got == pytest.approx(want[f"{kind} {u}"], rel=1e-12), (rank, u, kind)
            assert layer["recompute_flops"] == 0.0
        # The loss and the update (each step's ended where the loop gathers the whole model).
        for kind in ("loss", "update"):
            got = w[f"{kind}_flops"]
            assert got > 0 and got == pytest.approx(want[kind], rel=1e-12), (rank, kind, got)
        # The engine's host time per unit of the last step, as the slowest rank's counters say:
        # its hooks' and their library calls' less the waits.
        hooks = max(x["stats"]["host_us_per_unit"] + x["stats"]["calls_us_per_unit"] for x in runs) * 1e-6
        assert w["hook_s"] > 0 and w["hook_s"] == pytest.approx(hooks, rel=1e-12), (rank, w["hook_s"], hooks)

    # Each rank's engine time of its last step (its hooks' and their library calls', waits left
    # out) lies in that step outside its spans: from the previous step's update's end to its
    # own update's end.
    last = SPEC["steps"] - 1
    for rank, r in enumerate(runs):
        steps = by_step(r["record"]["compute"])
        (before,) = [c["end_ns"] for c in steps[last - 1] if c["name"] == "update"]
        (end,) = [c["end_ns"] for c in steps[last] if c["name"] == "update"]
        outside = (end - before - sum(c["end_ns"] - c["start_ns"] for c in steps[last])) * 1e-9
        engine = (r["stats"]["host_us_per_unit"] + r["stats"]["calls_us_per_unit"]) * 1e-6 * UNITS
        assert 0 < engine <= outside, (rank, engine, outside)


def test_flight_and_sim_against_read_them(traced):
    exe = cli()
    if exe is None:
        pytest.skip("no collsched binary (cargo build) to read the record with")
    out, runs = traced
    real = out / "real.json"
    subprocess.run([exe, "flight", str(out), "--trace-out", str(real)], check=True, capture_output=True)
    events = json.loads(real.read_text())["traceEvents"]
    for rank, r in enumerate(runs):
        # The compute track also holds the collectives of the compute stream (the plan's
        # agreement): the compute spans are those of category forward or backward.
        mine = [
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("pid") == rank
            and e.get("tid") == 0
            and e["cat"] in ("forward", "backward", "loss", "update")
        ]
        compute = r["record"]["compute"]
        assert [e["name"] for e in mine] == [c["name"] for c in compute], rank
        assert [e["args"]["step"] for e in mine] == [c["step"] + 1 for c in compute], rank

    def against(workload: pathlib.Path) -> tuple[str, list[list[str]], set[tuple[int, int, int]]]:
        """The table of ``sim --against`` the real trace, and the simulated collectives as
        ``(track, bucket, bytes)``."""
        trace = out / "sim.json"
        sim = subprocess.run(
            [exe, "sim", "--workload", str(workload), "--world", "2", "--tflops", "1", "--steps", str(SPEC["steps"]),
             "--policy", "trace", "--topo", "dgx-h100", "--bucket-by", "module", "--bucket-mb", str(SPEC["bucket_mb"]),
             "--against", str(real), "--trace-out", str(trace)],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        table = sim.splitlines()
        start = next(i for i, line in enumerate(table) if line.startswith("against ")) + 2
        rows = [line.split() for line in table[start:] if line.split() and line.split()[0].isdigit()]
        return sim, rows, sized(json.loads(trace.read_text())["traceEvents"], range(2))

    def sized(trace: list[dict], pids: Any) -> set[tuple[int, int, int]]:
        got = set()
        for e in trace:
            if e.get("ph") == "X" and e.get("pid") in pids and e.get("tid") in (1, 2):
                m = re.search(r"bucket (\d+)", e["name"])
                if m and "bytes" in e["args"]:
                    got.add((e["tid"], int(m.group(1)), e["args"]["bytes"]))
        return got

    sim, rows, simulated = against(out / "workload-0.json")
    # The collectives: the simulated buckets are the library's (the workload's parameter order,
    # the model's bucket cap, by unit): every simulated collective's bucket and bytes are a real
    # one's. The real record holds more (the blocks' models built before the root's, the plan's
    # agreement, the evaluation engine's gathers): each rank's training engine's are compared,
    # the others left out, and those pair one to one with the simulated ones, step by step, all
    # of the same size.
    assert simulated and simulated <= sized(events, range(2)), sorted(simulated - sized(events, range(2)))
    colls = [r for r in rows if r[1] in ("all-gather", "reduce-scatter")]
    assert [r[0] for r in colls] == ["0", "0", "1", "1"], sim
    for r in colls:
        sim_n, real_n, pairs, by, resized = int(r[2]), int(r[3]), int(r[4]), r[5], int(r[6])
        assert by == "step" and sim_n > 0 and pairs == sim_n == real_n and resized == 0, (r, sim)
    left = re.search(r"compared: the collectives of engine \d+ \(on each rank the one with the most\); (\d+) real", sim)
    assert left and int(left.group(1)) > 0, sim
    # Cut in forward order instead (the root's final norm before the blocks), buckets of the same
    # ids are other buckets: simulated sizes the run never had.
    forward = json.loads((out / "workload-0.json").read_text())
    assert forward.pop("bucket_order") == "params", forward
    (out / "forward.json").write_text(json.dumps(forward))
    _, _, other = against(out / "forward.json")
    assert other - sized(events, range(2)), sorted(other)
    compute = [r for r in rows if r[1] == "compute"]
    # A compute row per rank: a forward and a backward per unit a step on both sides (the
    # root's pieces around its blocks' joined into one a phase), and the loss and the update,
    # each simulated span paired with the real one of its unit or kind.
    assert [r[0] for r in compute] == ["0", "1"], sim
    for r in compute:
        sim_n, real_n, pairs, by = int(r[2]), int(r[3]), int(r[4]), r[5]
        assert sim_n == (2 * UNITS + 2) * SPEC["steps"] and real_n == sim_n and pairs == sim_n and by == "layer", r


@pytest.mark.parametrize("where", ["backward", "forward"])
def test_a_pass_that_raises_leaves_no_span(where):
    """The step whose backward raised (found at the next forward) is dropped from the compute
    track; a forward that raised leaves its step to the forward run again. The steps around
    them are whole."""
    worker = spans_workers.raised_in_backward if where == "backward" else spans_workers.raised_in_forward
    want = [0, 2] if where == "backward" else [0, 1, 2]
    for rank, compute in enumerate(run(worker, 2)):
        steps = by_step(compute)
        assert sorted(steps) == want, (rank, sorted(steps))
        for step in want:
            # The last step's update goes on past the record.
            assert pieces(steps[step]) == (STEP if step < 2 else STEP[:-1]), (rank, step, pieces(steps[step]))
        for a, b in zip(compute, compute[1:]):
            assert a["end_ns"] <= b["start_ns"], (rank, a, b)


def test_an_update_follows_a_synchronized_backward_alone():
    """Under ``no_sync`` a micro-batch's backward ends no library step that delivers gradients:
    no update follows it; the synchronized micro-batch's update runs until the next pass (the
    last one past the record)."""
    for rank, compute in enumerate(run(spans_workers.accumulated, 2)):
        steps = by_step(compute)
        assert sorted(steps) == [0, 1, 2, 3], (rank, sorted(steps))
        for p, want in enumerate([STEP[:-1], STEP, STEP[:-1], STEP[:-1]]):
            assert pieces(steps[p]) == want, (rank, p, pieces(steps[p]))


def test_workload_record_before_a_pass_says_what_to_do():
    for text in run(spans_workers.refused, 2):
        assert "no training pass recorded yet on rank(s) [0, 1]" in text, text
        assert "run a forward and backward first" in text, text


@pytest.mark.parametrize("value, kept", [("7", 7), ("0", 0), (" 12 ", 12), ("many", 2000), ("-3", 2000)])
def test_the_spans_kept_are_the_native_records_count(monkeypatch, value, kept):
    """``COLLSCHED_FLIGHT_ENTRIES`` read by the library's own rule (a malformed count keeps the
    default, 2000): a model keeps as many compute spans as its record keeps collectives."""
    from collsched.torch.spans import Spans

    monkeypatch.setenv("COLLSCHED_FLIGHT_ENTRIES", value)
    assert Spans(False).spans.maxlen == kept, value
