"""collsched.torch.values.cast_batch: the batched casts of the gradient paths, against plain casts."""

from __future__ import annotations

import torch

from collsched.torch.values import cast_batch


def test_cast_batch_matches_a_cast_each_in_value_shape_and_dtype():
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(5, 7, generator=g, dtype=torch.bfloat16),
        torch.randn(7, 5, generator=g).t(),  # not contiguous
        torch.randn((), generator=g, dtype=torch.bfloat16),  # 0-d
        torch.randn(11, generator=g, dtype=torch.float16),
        torch.randn(3, 4, generator=g),  # left alone
        torch.randn(6, generator=g),
    ]
    batch = list(enumerate(tensors))
    which = [(0, torch.float32, None), (1, torch.float32, None), (2, torch.float32, None), (3, torch.bfloat16, None)]
    which.append((5, torch.float16, torch.device("cpu")))
    cast_batch(batch, which)
    assert [i for i, _ in batch] == list(range(len(tensors)))
    for i, dtype, _ in which:
        got, want = batch[i][1], tensors[i].to(dtype)
        assert got.dtype == dtype and got.shape == tensors[i].shape and got.is_contiguous(), (i, got)
        assert torch.equal(got, want), i
    assert batch[4][1] is tensors[4]
    # The float32 casts share one new tensor; the sources are untouched.
    base = batch[0][1].untyped_storage().data_ptr()
    assert all(batch[i][1].untyped_storage().data_ptr() == base for i in (1, 2))
    assert batch[3][1].untyped_storage().data_ptr() != base
    assert tensors[1].dtype == torch.float32 and not tensors[1].is_contiguous()


def test_cast_batch_of_nothing_changes_nothing():
    batch = [(0, torch.ones(2))]
    cast_batch(batch, [])
    assert torch.equal(batch[0][1], torch.ones(2))
