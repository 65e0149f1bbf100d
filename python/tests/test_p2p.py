"""Point-to-point ops of the ``"collsched"`` backend (``send``, ``recv``, ``isend``, ``irecv``,
any source, ``batch_isend_irecv``) at 2 and 3 ranks, in processes: what each rank receives
against what its peers sent, computed here; tags, order, large, empty, non-contiguous and odd
dtypes; a bad peer, a wrong size and a silent peer give errors that name them; the profiler
events."""

from __future__ import annotations

import p2p_workers as w
import pytest
import torch

from ranks import run, run_all


def _expect(src: int, dst: int, numel: int, dtype: torch.dtype, salt: int = 0) -> tuple[str, list]:
    """What ``src`` sends ``dst``, computed here (not with the workers' payload)."""
    values = [(i * 7 + src * 1000 + dst * 100 + salt * 10) % 97 for i in range(numel)]
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.bool:
        return (name, [v % 2 == 1 for v in values])
    if dtype.is_floating_point or dtype.is_complex:
        return (name, [float(v) for v in values])
    return (name, values)


@pytest.mark.parametrize("world", [2, 3])
def test_crossing_isend_irecv_batched_and_a_ring(world):
    numel = 1000
    out = run(w.crossing, world, numel, init="collsched", timeout=180)
    for rank, got in enumerate(out):
        peers = [p for p in range(world) if p != rank]
        assert sorted(got["isend_irecv"]) == peers, got.keys()
        for p in peers:
            assert got["isend_irecv"][p] == _expect(p, rank, numel, torch.float32), (rank, p)
            assert got["batch"][p] == _expect(p, rank, numel, torch.float32, 1), (rank, p)
        prv = (rank - 1) % world
        assert got["ring"] == _expect(prv, rank, numel, torch.float32, 2), rank


def test_tags_select_messages_and_keep_their_order():
    out = run(w.tags_and_order, 2, init="collsched", timeout=120)
    assert out[1] == {
        "tag7": _expect(0, 1, 6, torch.int64, 1),
        "tag5_first": _expect(0, 1, 6, torch.int64, 0),
        "tag5_second": _expect(0, 1, 6, torch.int64, 2),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_recv_from_any_source_names_the_sender(world):
    got = run(w.any_source, world, init="collsched", timeout=120)[0]["got"]
    assert len(got) == 2 * (world - 1), got
    senders = sorted(src for src, _ in got)
    assert senders == sorted(list(range(1, world)) * 2), senders
    seen: dict[int, int] = {}
    for src, values in got:
        # Each sender's two messages arrive in the order it sent them.
        assert values == _expect(src, 0, 10, torch.float32, seen.get(src, 0)), (src, values)
        seen[src] = seen.get(src, 0) + 1


def test_large_empty_non_contiguous_and_odd_dtypes():
    out = run(w.large_and_odd, 2, init="collsched", timeout=180)[1]
    big = 3 * (1 << 20) // 4 + 5
    assert out["big"] == _expect(0, 1, big, torch.float32)
    dtypes = [torch.float64, torch.bfloat16, torch.int8, torch.bool, torch.complex64, torch.int16]
    for i, dt in enumerate(dtypes):
        name, full = _expect(0, 1, 34, torch.float32 if dt == torch.complex64 else dt, i)
        want = full[::2]
        if dt == torch.complex64:
            name = "float32"  # its real part, as the worker returns it
        assert out[str(dt)] == (name, want), (dt, out[str(dt)])
    assert out["empty"] == 0


def test_bad_peer_wrong_size_and_silent_peer_give_clear_errors(monkeypatch):
    out = run(w.bad_peer, 2, init="collsched", timeout=120)
    for rank in (0, 1):
        msg = out[rank]["outside"]
        # torch refuses a rank outside the job before the backend sees it; either way the
        # message names the rank.
        assert "4" in msg and ("rank" in msg.lower()), msg
        assert out[rank]["backend_outside"] == (
            f"CollschedError: collsched: send to group rank 4 with tag 0 on rank {rank} (group rank {rank} of 2): "
            f"no such peer; give a group rank in 0..1 other than {rank}"
        ), out[rank]
    assert out[1]["size"].startswith("CollschedError: collsched: recv from group rank 0 with tag 0 on rank 1"), out[1]
    assert "16 bytes were sent" in out[1]["size"] and "holds 20" in out[1]["size"], out[1]
    silent = out[1]["silent"]
    assert silent.startswith("collsched.PeerError: collsched: recv from group rank 0 with tag 9 on rank 1"), silent
    assert "nothing came within 3 s" in silent, silent
    assert out[1]["silent_polled"].startswith(silent.split(":")[0]), out[1]
    assert "nothing came within 3 s" in out[1]["silent_polled"], out[1]
    short = out[1]["short_wait"]
    assert short.startswith("collsched.PeerError") and "Timed out waiting 300ms" in short, out[1]
    assert out[1]["after_short_wait"] == "[7.0, 7.0]", out[1]


def test_a_receive_from_a_sender_that_exited_fails_at_once_naming_it():
    """The sender's process is gone (its pidfd says so): the receive fails, naming the sender
    and why (at the group's timeout it would say that nothing came)."""
    outcomes = run_all(w.exited_sender, 2, init="collsched", timeout=120)
    ok, got = outcomes[1]
    assert ok, got
    assert got["recv"].startswith("collsched.PeerError: collsched: recv from group rank 0"), got
    assert "process exited before it sent" in got["recv"], got
    assert got["polled"].startswith("collsched.PeerError") and "process exited before it sent" in got["polled"], got


@pytest.mark.parametrize("world", [2, 3])
def test_works_polled_with_is_completed_complete(world):
    out = run(w.polled, world, init="collsched", timeout=180)
    assert out[1]["early"] is False, out[1]
    assert out[1]["irecv"] == _expect(0, 1, 5, torch.float32), out[1]
    total = float(sum(range(world)))
    for rank, got in enumerate(out):
        assert got["all_reduce"] == ("float32", [total] * 3), (rank, got)
        assert got["after_wait"] is True, (rank, got)
    assert out[0]["any_source"] == (1, _expect(1, 0, 2, torch.float32)), out[0]
    assert "a receive from any source with this tag, posted before, is not read yet" in out[0]["after_any"], out[0]
    for rank, got in enumerate(out):
        assert got["future"] == ("float32", [total] * 2), (rank, got)


def test_profiler_events_per_op_are_async_with_the_input_shapes():
    out = run(w.profiled, 2, init="collsched", timeout=120)
    assert out[0] == [("collsched:all_reduce", True, [[2, 3]]), ("collsched:send", True, [[4, 5]])], out[0]
    assert out[1] == [("collsched:all_reduce", True, [[2, 3]]), ("collsched:recv", True, [[4, 5]])], out[1]
