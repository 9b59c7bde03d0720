"""The compiled int8 kernels and the fused low-bit update ([Note: compiled int8 kernels],
[Note: fused low-bit update]) give bitwise what the torch ops and the whole-shard way give."""

from __future__ import annotations

import pytest
import torch
from tierwise.optim import AdamHyper, adam_update_ranges, lowbit_kernel
from tierwise.optim import state_formats as formats
from tierwise.precision import QUANT_BLOCK

needs_kernel = pytest.mark.skipif(lowbit_kernel.load() is None, reason="no C compiler")


def _torch_ops(monkeypatch):
    """Make the state formats fall back to torch ops (as without a compiler)."""
    monkeypatch.setattr(lowbit_kernel, "load", lambda: None)


def _values(n: int, signed: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6
    x[:QUANT_BLOCK] = 0.0  # a zero block: scale clipped to 1e-12
    x[QUANT_BLOCK : 2 * QUANT_BLOCK] = 1e-20  # below the clip
    x[2 * QUANT_BLOCK + 5] = float("inf")
    x[3 * QUANT_BLOCK + 7] = float("nan")
    x[4 * QUANT_BLOCK + 9] = -float("inf")
    x[5 * QUANT_BLOCK] = -0.0
    return x if signed else x.abs()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@needs_kernel
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_kernels_match_torch_ops_bit_for_bit(monkeypatch, signed):
    n = 64 * QUANT_BLOCK
    values = _values(n, signed)
    codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(n // QUANT_BLOCK)
    formats.quantize_blocks(values, codes, scales, signed=signed)
    decoded = torch.empty(n)
    formats.dequantize_blocks(codes, scales, decoded, signed=signed)

    with monkeypatch.context() as m:
        _torch_ops(m)
        ref_codes, ref_scales = torch.empty_like(codes), torch.empty_like(scales)
        formats.quantize_blocks(values, ref_codes, ref_scales, signed=signed)
        ref_decoded = torch.empty(n)
        formats.dequantize_blocks(codes, scales, ref_decoded, signed=signed)

    assert torch.equal(codes, ref_codes)
    assert torch.equal(_bits(scales), _bits(ref_scales))
    assert torch.equal(_bits(decoded), _bits(ref_decoded))


def _whole_shard_update(states, grad, numel, spans, hyper, optimizer_states):
    """The update as it ran before the fused pieces: both moments decoded whole with torch
    ops, one fused Adam(W) call, encoded back over the spans' blocks."""
    master, *stored = states
    fmts = formats.moment_formats(optimizer_states)
    padded = [torch.zeros(fmts[0].padded_numel(numel)) for _ in fmts]
    for full, f, s in zip(padded, fmts, stored, strict=True):
        f.decode(s, full)
    adam_update_ranges(
        master=master,
        grad=grad,
        exp_avg=padded[0][:numel],
        exp_avg_sq=padded[1][:numel],
        ranges=[(a, b, 3) for a, b in spans],
        hyper=hyper,
    )
    for f, s, full in zip(fmts, stored, padded, strict=True):
        f.encode(full, s, spans)


@pytest.mark.parametrize("optimizer_states", ["bf16", "int8"])
@pytest.mark.parametrize("compiled", [True, False])
def test_fused_pieces_match_whole_shard_update(monkeypatch, optimizer_states, compiled):
    if compiled and lowbit_kernel.load() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(formats, "FUSED_PIECE", 4 * QUANT_BLOCK)  # many pieces, a ragged end
    numel = 17 * QUANT_BLOCK + 77
    spans = [(10, 900), (1500, 1600), (3000, numel)]  # gaps: pieces and blocks left alone
    hyper = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True)
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=gen)
    fmts = formats.moment_formats(optimizer_states)
    master = torch.randn(numel, generator=gen)
    stored = [
        fmts[0].encoded(torch.randn(numel, generator=gen) * 1e-2),
        fmts[1].encoded(torch.rand(numel, generator=gen) * 1e-4),
    ]
    ours = [master.clone(), *(s.clone() for s in stored)]
    ref = [master.clone(), *(s.clone() for s in stored)]

    if not compiled:
        _torch_ops(monkeypatch)

    def update(master, m, v, lo, hi):
        inside = [(max(a, lo) - lo, min(b, hi) - lo, 3) for a, b in spans if a < hi and b > lo]
        adam_update_ranges(
            master=master[lo:hi],
            grad=grad[lo:hi],
            exp_avg=m,
            exp_avg_sq=v,
            ranges=inside,
            hyper=hyper,
        )

    finished = []
    run = formats.LowBitMoments(optimizer_states).around(
        update, numel=numel, spans=spans, finish=finished.append
    )
    run(ours)
    with monkeypatch.context() as m:
        _torch_ops(m)
        _whole_shard_update(ref, grad, numel, spans, hyper, optimizer_states)

    assert finished == [ours[0]]
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(_bits(a), _bits(b))
    assert not torch.equal(ours[0], master)  # the update did run
