"""Hugging Face models sharded with ``collsched.torch.fully_shard``, against the same model
unsharded: a decoder-only model, one with tied input and output embeddings, an
encoder-decoder and an encoder, at 2 and 3 ranks. Each keeps its interface (``generate()``
reads ``forward``'s signature to choose its inputs), trains with no_sync micro-batches and a
frozen layer as the reference does, saves a checkpoint that a model built from other values
loads and trains on from, and generates the reference's tokens (greedy, with and without the
cache, batched with left padding) before and after training."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (ci/python.sh installs it)")

import hf_workers  # noqa: E402

from ranks import run  # noqa: E402


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["llama", "llama-tied", "t5", "bert"])
def test_a_hugging_face_model_trains_and_generates_as_unsharded(kind, world, tmp_path):
    path = os.fspath(tmp_path / "ckpt")
    results = run(hf_workers.run, world, kind, path, timeout=400)
    assert len(results) == world
    steps = hf_workers.STEPS * hf_workers.MICRO
    for rank, r in enumerate(results):
        assert r["interface"] == dict.fromkeys(r["interface"], True) and len(r["interface"]) == 6, (rank, r)
        generates = kind != "bert"
        # Tokens compared with the reference's: three generations (an encoder has none).
        assert (r["tokens_before"] > 0 and r["tokens_after"] > 0) if generates else r["tokens_before"] == 0, (rank, r)
        assert r["params_saved"] == r["params"] > 0, (rank, r)
        assert len(r["losses"]) == steps, (rank, r["losses"])
        for i, (got, want) in enumerate(r["losses"]):
            # Before the first update the forward is the reference's, value for value.
            tol = 0.0 if i < hf_workers.MICRO else hf_workers.RTOL
            assert abs(got - want) <= tol * abs(want), f"rank {rank} micro-batch {i}: loss {got}, reference {want}"
        assert r["live"] == 0, r
