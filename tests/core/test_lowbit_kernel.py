"""The compiled int8 kernels, the fused low-bit update and the one-pass int8 Adam ([Note:
compiled int8 kernels], [Note: fused low-bit update], [Note: int8 Adam in one pass]) give
bitwise what the torch ops, torch's fused AdamW and the whole-shard way give."""

from __future__ import annotations

import ctypes
import platform
import subprocess

import pytest
import torch
from tierwise.optim import AdamHyper, adam_update_ranges, lowbit_kernel, lowbit_update
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


def _every_bucket(signed: bool) -> torch.Tensor:
    """Scaled values from every bucket of top 16 bits a quotient can have (|q| <= 1): both ends
    of each, the middle and a random low half, plus each threshold and its two neighbours
    ([Note: int8 code slots] clamps, merges and compares on the low 16 bits)."""
    gen = torch.Generator().manual_seed(5)
    top = torch.arange(65536, dtype=torch.int64)
    top = top[(top & 0x7FFF) <= 0x3F80]
    lows = [0, 1, 0x7FFF, 0x8000, 0xFFFE, 0xFFFF]
    lows = torch.tensor(lows).expand(top.numel(), -1)
    lows = torch.cat([lows, torch.randint(0, 65536, (top.numel(), 1), generator=gen)], dim=1)
    bits = ((top[:, None] << 16) | lows).flatten()
    thresholds = formats.device_tables(signed, torch.device("cpu"))[3][:-1]
    near = thresholds.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = torch.cat([bits, near - 1, near, near + 1])
    values = (bits & 0xFFFFFFFF).to(torch.int64).to(torch.int32).view(torch.float32)
    return values[values.abs() <= 1.0]


@needs_kernel
@pytest.mark.parametrize("signed", [True, False])
def test_compiled_encode_matches_torch_ops_in_every_bucket(monkeypatch, signed):
    values = _every_bucket(signed)
    per_block = QUANT_BLOCK - 1
    pad = -values.numel() % per_block
    values = torch.cat([values, torch.zeros(pad)]).view(-1, per_block)
    # each block's largest magnitude is 1 (both signs), so the scaled values are the values
    ones = torch.where(torch.arange(values.shape[0]) % 2 == 0, 1.0, -1.0)[:, None]
    values = torch.cat([ones, values], dim=1).flatten().contiguous()
    codes, scales = (
        torch.empty(values.numel(), dtype=torch.uint8),
        torch.empty(values.numel() // 256),
    )
    formats.quantize_blocks(values, codes, scales, signed=signed)
    with monkeypatch.context() as m:
        _torch_ops(m)
        ref_codes, ref_scales = torch.empty_like(codes), torch.empty_like(scales)
        formats.quantize_blocks(values, ref_codes, ref_scales, signed=signed)
    assert torch.equal(_bits(scales), _bits(ref_scales))
    assert torch.equal(scales, torch.ones_like(scales))
    assert torch.equal(codes, ref_codes)


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
    monkeypatch.setattr(lowbit_update, "FUSED_PIECE", 4 * QUANT_BLOCK)  # many pieces, a ragged end
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

    def update(master, moments, lo, hi):
        inside = [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]
        moments.adam(
            masters=[master[a:b] for a, b in inside],
            grads=[grad[a:b] for a, b in inside],
            starts=[a for a, _ in inside],
            steps=[3] * len(inside),
            hyper=hyper,
        )

    finished = []
    run = lowbit_update.LowBitMoments(optimizer_states).around(
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


def _awkward(n: int, gen: torch.Generator, scale: float) -> torch.Tensor:
    """Random values with zeros, denormals, huge values and a few NaN-free extremes."""
    x = torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 8 * scale
    x[::17] = 0.0
    x[5::19] = 1e-41  # denormal
    x[7::23] = -3e-39
    x[11::29] = 3e33 * scale
    x[13::31] = -0.0
    return x


def _ragged(numel: int, gen: torch.Generator) -> list[tuple[int, int, int]]:
    """(start, end, step): tensors of odd lengths, gaps between some, different step counts."""
    out, at = [], 3
    while at < numel:
        end = min(numel, at + int(torch.randint(1, 700, (1,), generator=gen)))
        if bool(torch.rand(1, generator=gen) < 0.8):
            out.append((at, end, int(torch.randint(1, 5, (1,), generator=gen))))
        at = end + int(torch.randint(0, 3, (1,), generator=gen)) * 37
    return out


@needs_kernel
@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("threads", [1, 3])
def test_one_pass_int8_adam_matches_torch_fused_adamw(
    monkeypatch, decoupled, weight_decay, threads
):
    """[Note: int8 Adam in one pass] against the pieces way (decode with torch ops, torch's
    fused Adam(W), encode with torch ops), three steps, on ragged tensors with their own
    step counts and awkward values; blocks split between threads or not."""
    numel = 23 * QUANT_BLOCK + 101
    gen = torch.Generator().manual_seed(int(decoupled) * 10 + int(weight_decay * 100) + threads)
    fmts = formats.moment_formats("int8")
    master = _awkward(numel, gen, 1.0)
    stored = [
        fmts[0].encoded(_awkward(numel, gen, 1e-2)),
        fmts[1].encoded(_awkward(numel, gen, 1e-4).abs()),
    ]
    ours = [master.clone(), *(s.clone() for s in stored)]
    ref = [master.clone(), *(s.clone() for s in stored)]
    hyper = AdamHyper(
        lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=weight_decay, decoupled=decoupled
    )
    # blocks claimed two at a time, so the 24 blocks are shared by the threads
    monkeypatch.setattr(lowbit_kernel, "CLAIM_BLOCKS", 2)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(3):
            grad = _awkward(numel, gen, 1.0)
            tensors = _ragged(numel, gen)
            spans = [(a, b) for a, b, _ in tensors]

            def update(master, moments, lo, hi, grad=grad, tensors=tensors, step=step):
                inside = [(max(a, lo), min(b, hi), s) for a, b, s in tensors if a < hi and b > lo]
                moments.adam(
                    masters=[master[a:b] for a, b, _ in inside],
                    grads=[grad[a:b] for a, b, _ in inside],
                    starts=[a for a, _, _ in inside],
                    steps=[s + step for _, _, s in inside],
                    hyper=hyper,
                )

            lowbit_update.LowBitMoments("int8").around(update, numel=numel, spans=spans)(ours)
            with monkeypatch.context() as m:
                _torch_ops(m)
                lowbit_update.LowBitMoments("int8").around(update, numel=numel, spans=spans)(ref)
            # a master turned NaN may have another sign ([Note: int8 Adam in one pass])
            assert lowbit_kernel.same_bits(ours[0], ref[0]), f"step {step}"
            for a, b in zip(ours[1:], ref[1:], strict=True):
                assert torch.equal(a, b), f"step {step}"
    finally:
        torch.set_num_threads(saved_threads)
    assert not torch.equal(ours[0], master)


@needs_kernel
@pytest.mark.parametrize(
    ("beta1", "weight_decay", "decoupled"),
    [(0.8, 0.1, True), (0.4, 0.1, False), (0.9, 0.0, True)],
)
def test_one_pass_int8_adam_is_torchs_kernel_on_decoded_moments(beta1, weight_decay, decoupled):
    """The one-pass update equals torch's fused Adam(W) run directly on the decoded moments
    (every element updated, one tensor, an odd length: torch's vector loop and its scalar
    remainder both), then encoded: the arithmetic is torch's, not only the pieces way's. The
    whole blocks take the AVX2 loop of [Note: int8 kernels in AVX2] where it is built: AdamW,
    Adam's L2 term and no weight decay, and a beta1 whose lerp weight 1 - beta1 is >= 0.5."""
    numel = 9 * QUANT_BLOCK - 3
    gen = torch.Generator().manual_seed(7)
    fmts = formats.moment_formats("int8")
    master = _awkward(numel, gen, 1.0)
    grad = _awkward(numel, gen, 1.0)
    stored = [
        fmts[0].encoded(_awkward(numel, gen, 1e-2)),
        fmts[1].encoded(_awkward(numel, gen, 1e-4).abs()),
    ]
    ours = [master.clone(), *(s.clone() for s in stored)]
    hyper = AdamHyper(
        lr=1e-2, beta1=beta1, beta2=0.99, eps=1e-6, weight_decay=weight_decay, decoupled=decoupled
    )

    def update(master, moments, lo, hi):
        moments.adam(masters=[master], grads=[grad], starts=[0], steps=[4], hyper=hyper)

    lowbit_update.LowBitMoments("int8").around(update, numel=numel, spans=[(0, numel)])(ours)

    m, v = (f.decoded(s, numel).clone() for f, s in zip(fmts, stored, strict=True))
    ref_master = master.clone()
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    kernel(
        [ref_master], [grad.clone()], [m], [v], [], [torch.tensor(4.0)],
        lr=1e-2, beta1=beta1, beta2=0.99, weight_decay=weight_decay, eps=1e-6, amsgrad=False,
        maximize=False,
    )  # fmt: skip
    assert torch.equal(_bits(ours[0]), _bits(ref_master))
    for f, s, values in zip(fmts, ours[1:], (m, v), strict=True):
        assert torch.equal(s, f.encoded(values))


def _plain_build(tmp_path) -> ctypes.CDLL:
    """The kernels built for the x86-64 baseline (no AVX2): the plain C loops."""
    compiler = lowbit_kernel._compiler()
    flags = [f for f in lowbit_kernel.FLAGS if not f.startswith("-march=")] + ["-march=x86-64"]
    source, built = tmp_path / "plain.c", tmp_path / "plain.so"
    source.write_text(lowbit_kernel.SOURCE)
    subprocess.run([compiler, *flags, str(source), "-o", str(built), "-lm"], check=True)
    return lowbit_kernel.declare(ctypes.CDLL(str(built)))


@needs_kernel
@pytest.mark.skipif(platform.machine() != "x86_64", reason="builds for the x86-64 baseline")
def test_build_without_avx2_gives_the_same_bytes(tmp_path, monkeypatch):
    """[Note: int8 kernels in AVX2]: a build for a CPU without AVX2 runs the plain C loops; they
    give the bytes the machine's build gives (encode, decode and the one-pass update of ragged
    tensors and of whole blocks, threads claiming blocks), so the kernel still runs there."""
    native, plain = lowbit_kernel.load(), _plain_build(tmp_path)
    width = lowbit_kernel.one_pass_width(native)
    if width is None:
        pytest.skip("the one-pass update is not torch's kernel here")
    numel = 40 * QUANT_BLOCK
    gen = torch.Generator().manual_seed(11)
    for signed in (True, False):
        values = _values(numel, signed)
        qmap, slots = formats.kernel_tables(signed)
        out = []
        for lib in (native, plain):
            codes = torch.empty(numel, dtype=torch.uint8)
            scales, decoded = torch.empty(numel // QUANT_BLOCK), torch.empty(numel)
            lowbit_kernel.quantize(lib, values, codes, scales, slots)
            lowbit_kernel.dequantize(lib, codes, scales, decoded, qmap)
            out.append((codes, _bits(scales), _bits(decoded)))
        assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))
    fmts = formats.moment_formats("int8")
    master, grad = _awkward(numel, gen, 1.0), _awkward(numel, gen, 1.0)
    stored = [
        fmts[0].encoded(_awkward(numel, gen, 1e-2)),
        fmts[1].encoded(_awkward(numel, gen, 1e-4).abs()),
    ]
    tables = [t for signed in (True, False) for t in formats.kernel_tables(signed)]
    hyper = (3e-3, 0.9, 0.999, 1e-8, 0.05, True)
    ragged = [(a, b, s) for a, b, s in _ragged(numel // 2, gen)]
    whole = [(numel // 2 + 3, numel - 5, 2)]  # many whole blocks, then a remainder
    monkeypatch.setattr(lowbit_kernel, "CLAIM_BLOCKS", 4)  # two threads share the 40 blocks
    results = []
    for lib in (native, plain):
        m, moments = master.clone(), [s.clone() for s in stored]
        split = (*fmts[0].split(moments[0]), *fmts[1].split(moments[1]))
        tensors = [(a, m[a:b], grad[a:b], s) for a, b, s in ragged + whole]
        blocks = (0, numel // QUANT_BLOCK)
        lowbit_kernel.adam_int8(lib, split, tensors, hyper, tables, blocks, 2, width)
        results.append((m, *moments))
    assert lowbit_kernel.same_bits(results[0][0], results[1][0])
    for a, b in zip(results[0][1:], results[1][1:], strict=True):
        assert torch.equal(a, b)


@needs_kernel
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="torch runs neither its AVX2 nor its AVX512 kernels here",
)
def test_the_one_pass_update_is_torchs_kernel_on_avx2_and_avx512_builds():
    """[Note: torch's remainder]: where torch runs its AVX2 or its AVX512 kernels, the compiled
    one-pass update is bitwise torch's fused Adam(W) (``one_pass_width`` checks it against
    ``torch._fused_adamw_``/``_fused_adam_`` on awkward values, remainders included), so the
    engine uses it; with AVX512 torch's scalar remainder rounds exp_avg_sq as its vector lanes
    do, and before the kernel knew that the one pass was refused on such machines."""
    width = {"AVX2": 8, "AVX512": 16}[torch.backends.cpu.get_cpu_capability()]
    assert lowbit_kernel.one_pass_width(lowbit_kernel.load()) == width
