"""Row gathers used by token dispatch give autograd's values and gradients of plain indexing."""

import torch
from tierwise_moe.rows import gather_rows, inverse_permutation, permute_rows


def _grads(fn, rows, upstream):
    rows = rows.detach().clone().requires_grad_()
    out = fn(rows)
    out.backward(upstream)
    return out.detach(), rows.grad


def test_gather_rows_with_repeats_matches_indexing():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(6, 5, generator=gen)
    index = torch.tensor([3, 0, 3, 5, 1, 3, 0])  # repeats, and rows 2 and 4 unused
    upstream = torch.randn(7, 5, generator=gen)
    expected = _grads(lambda r: r[index], rows, upstream)
    got = _grads(lambda r: gather_rows(r, index), rows, upstream)
    assert torch.equal(got[0], expected[0])
    assert torch.allclose(got[1], expected[1], rtol=1e-6, atol=0)
    assert torch.equal(got[1][2], torch.zeros(5))


def test_permute_rows_matches_indexing_and_inverse_undoes_it():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(9, 4, generator=gen)
    perm = torch.randperm(9, generator=gen)
    inverse = inverse_permutation(perm)
    assert torch.equal(perm[inverse], torch.arange(9))
    upstream = torch.randn(9, 4, generator=gen)
    expected = _grads(lambda r: r[perm], rows, upstream)
    got = _grads(lambda r: permute_rows(r, perm, inverse), rows, upstream)
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
