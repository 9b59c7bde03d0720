"""Adam moments stored in low precision (``Config.optimizer_states``): bf16, or int8 codes with
block-wise scales.

[Note: low-bit optimizer states]
With ``optimizer_states="int8"`` both Adam moments of a chunk's shard are stored as one byte per
element plus one fp32 scale per block of QUANT_BLOCK (256) elements of the shard, in the scheme of
torchao's ``AdamW8bit`` (after bitsandbytes): a block is divided by its largest magnitude, then each
value becomes the index of the nearest entry of the dynamic quantization map (signed for
exp_avg, unsigned for exp_avg_sq), rounding exactly as torchao does. ``"bf16"`` stores the
moments in bf16 (round to nearest). The fp32 master copy is never stored in low precision.

A stored moment is one slab (PayloadKind.LOWBIT_STATE): bf16 elements, or for int8 the codes of
every block followed by the blocks' fp32 scales (``MomentFormat.stored_numel``). The update of a
chunk decodes both moments into fp32 buffers (one pair per thread, reused until the step
ends), runs the same fused
Adam(W) as fp32 states on them (so the parameter update uses the unrounded new moments, as
torchao's does), and encodes them back: ``LowBitMoments.around``. Only the blocks holding
elements the update changed are encoded again: decoding and encoding is not the identity for
int8 (a block whose largest magnitude is negative maps to -0.993, not -1), so the moments of
parameters skipped in a step ([Note: unused parameters are skipped]) stay as they were unless
they share a block with an updated parameter.

Differences from torchao's optimizer, by design: blocks are 256 consecutive elements of a
chunk's shard, so one block may hold the ends of two parameters, and small parameters are
quantized too (torchao keeps tensors under 4096 elements, or not a multiple of 256, in fp32);
the arithmetic of the update is torch's fused Adam(W) kernel, which rounds a few steps
differently from torchao's compiled formula. ``tests/core/test_lowbit_states.py`` compares both.
Because blocks follow the layout, int8 states make results depend on the chunk layout (bf16 and
fp32 states are elementwise: Invariant 1 holds for them).

Quantizing by binary search over the map (torchao's eager code, 8 gathers per element) takes
about 75 ns per element on one CPU thread; ``_code_table`` instead looks up the nearest code
from the top 16 bits of each scaled value plus one comparison, bitwise the same codes at a
fraction of the cost ([Note: int8 code lookup]).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierwise.optim import lowbit_kernel
from tierwise.precision import QUANT_BLOCK, check_state_precision, moment_stored_bytes
from tierwise.tiers.base import PayloadKind
from tierwise.tiers.ledger import MemoryPool, memory_of

QUANT_PIECE = 1 << 18
"""Elements quantized in one pass (the size of each thread's reused scratch tensors)."""

_STORED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


@functools.cache
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic quantization map on [-1, 1] (signed) or [0, 1].

    Seven decades 10^-6 .. 10^0; decade i holds the centres of 2^i (signed: each sign) or
    2^(i+1) (unsigned) equal steps of [0.1, 1] times 10^(i-6); plus 0 and 1. The same values,
    bit for bit, as torchao's ``create_dynamic_map`` (checked by the tests)."""
    values = [0.0, 1.0]
    for decade in range(7):
        steps = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1, steps + 1)
        centres = (edges[:-1] + edges[1:]) / 2.0
        level = (10 ** (decade - 6)) * centres
        values += level.tolist()
        if signed:
            values += (-level).tolist()
    assert len(values) == 256
    return torch.tensor(sorted(values), dtype=torch.float32)


# [Note: int8 code lookup]
# torchao rounds a scaled value x to code c + 1 instead of c (where q[c] <= x < q[c+1]) when
# fp32(x - q[c]) >= fp32((q[c+1] - q[c]) * 0.5). fp32 subtraction is monotone in x, so for
# each c there is a least fp32 value t[c] from which x rounds up; the code of x is the number of
# thresholds t[c] <= x (0 below q[0], 255 at 1.0). The thresholds are ~0.7% of 1 apart or
# more, while the fp32 values sharing their top 16 bits (one bf16 value's bucket) span at
# most 0.4% of their magnitude, so a bucket holds at most one threshold: a 65536-entry table
# gives the count at the bucket's lower end and one comparison with the next threshold
# finishes. ``_code_table`` checks that property when it builds the table.
@functools.cache
def _code_table(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(thresholds: 256 fp32, the last NaN; base: int32 count of thresholds below each bucket
    of 65536, indexed by the top 16 bits of an fp32 value plus 32768)."""
    qmap = dynamic_map(signed)
    down, up = qmap[:-1], qmap[1:]
    half = (up - down) * 0.5
    t = down + half
    while True:  # up to the least value that rounds up (or to q[c+1])
        low = (t - down < half) & (t < up)
        if not low.any():
            break
        t = torch.where(low, torch.nextafter(t, up), t)
    while True:  # down while the value below still rounds up
        below = torch.nextafter(t, down)
        lower = (below >= down) & (below - down >= half)
        if not lower.any():
            break
        t = torch.where(lower, below, t)
    thresholds = torch.cat([t, torch.tensor([float("nan")])])
    if sys.byteorder != "little":  # the bucket ends below are built from int16 halves
        raise RuntimeError("tierwise int8 optimizer states need a little-endian machine")
    high = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    ends = []
    for low_half in (0, -1):  # low 16 bits all zero, all one: the two ends of each bucket
        halves = torch.stack([torch.full_like(high, low_half), high], dim=1)
        ends.append(halves.contiguous().view(torch.int32).view(torch.float32).view(-1))
    lo, hi = torch.minimum(*ends), torch.maximum(*ends)
    finite = ~torch.isnan(lo)
    base = torch.searchsorted(t, torch.where(finite, lo, 0.0), right=True).to(torch.int32)
    top = torch.searchsorted(t, torch.where(finite, hi, 0.0), right=True).to(torch.int32)
    if bool(((top - base) > 1).any()):
        raise AssertionError("int8 code lookup: a bucket holds two thresholds")
    return thresholds, base


@functools.cache
def device_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(map, code at each bucket's lower end as uint8, the threshold inside each bucket (NaN:
    none), the 256 thresholds by code (the last NaN)) on ``device``; the middle two indexed by
    the top 16 bits of an fp32 value read as unsigned (``inside == thresholds[base]``)."""
    thresholds, base = _code_table(signed)
    # reorder from int16 order (-32768..32767) to uint16 order (0..65535)
    base = torch.cat([base[32768:], base[:32768]])
    inside = thresholds[base]
    return (
        dynamic_map(signed).to(device),
        base.to(torch.uint8).to(device),
        inside.to(device),
        thresholds.to(device),
    )


@functools.cache
def kernel_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(map, code slots) on the CPU, as the compiled kernels decode and encode: [Note: int8
    code slots] in ``lowbit_kernel.c``."""
    qmap, base, _, thresholds = device_tables(signed, torch.device("cpu"))
    return qmap, lowbit_kernel.code_slots(base, thresholds)


class Workspaces:
    """Scratch tensors reused by each thread (fresh temporaries of a piece's size fault their
    pages in on every call, see [Note: updates in pieces], which cost more than the
    arithmetic), allocated through ledger pools, one per memory ("optimizer_workspaces_host",
    "..._device": [Note: the memory ledger]), and dropped by ``release`` after each optimizer
    step, so they do not hold memory between steps."""

    def __init__(self) -> None:
        self._held: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._lock = threading.Lock()
        self.pools = {
            memory: MemoryPool(f"optimizer_workspaces_{memory}", memory=memory)
            for memory in ("host", "device")
        }

    def get(
        self, what: str, numel: int, dtypes: Sequence[torch.dtype], device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        """This thread's ``what`` tensors of ``dtypes``, at least ``numel`` elements each,
        sliced to ``numel``."""
        key = (threading.get_ident(), what, device)
        with self._lock:
            held = self._held.get(key)
        if held is None or held[0].numel() < numel:
            with self._lock:  # the smaller ones go before the larger come
                self._held.pop(key, None)
            pool = self.pools[memory_of(device)]
            held = tuple(pool.empty(numel, dtype, device=device, what=what) for dtype in dtypes)
            with self._lock:
                self._held[key] = held
        return tuple(t[:numel] for t in held)

    def release(self) -> None:
        """Drop every thread's tensors (a thread still using one keeps it until it is done)."""
        with self._lock:
            self._held.clear()


WORKSPACES = Workspaces()
"""The quantize and decode workspaces of every thread."""
_QUANTIZE_DTYPES = (torch.float32, torch.int32, torch.float32, torch.bool)
"""Scaled values, the bucket of each, the threshold in the bucket, whether it rounds up."""


# index_select rather than indexing with a tensor: the same gather at a fraction of the cost
# on a CPU (no broadcasting or bounds logic per element), as the [Note: int8 code lookup] wants
def quantize_blocks(
    values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, signed: bool
) -> None:
    """int8-encode fp32 ``values`` (a multiple of QUANT_BLOCK elements) into ``codes`` (uint8,
    same size) and ``scales`` (fp32, one per block): [Note: low-bit optimizer states]; on a CPU
    by the compiled loop of [Note: compiled int8 kernels] when it is built. Block
    scale = largest magnitude (at least 1e-12), code = nearest entry of the signed or unsigned
    map to value / scale, rounded as torchao rounds ([Note: int8 code lookup])."""
    kernel = lowbit_kernel.load()
    if kernel is not None and lowbit_kernel.usable(values, codes, scales):
        lowbit_kernel.quantize(kernel, values, codes, scales, kernel_tables(signed)[1])
        return
    _, base, inside, thresholds = device_tables(signed, values.device)
    for lo in range(0, values.numel(), QUANT_PIECE):
        hi = min(lo + QUANT_PIECE, values.numel())
        scaled, bucket, threshold, up = WORKSPACES.get(
            "quantize", hi - lo, _QUANTIZE_DTYPES, values.device
        )
        blocks = values[lo:hi].view(-1, QUANT_BLOCK)
        scale = blocks.abs().amax(-1).clip(1e-12)
        torch.div(blocks, scale.view(-1, 1), out=scaled.view(-1, QUANT_BLOCK))
        torch.bitwise_right_shift(scaled.view(torch.int32), 16, out=bucket)
        bucket.bitwise_and_(0xFFFF)
        out = codes[lo:hi]
        torch.index_select(base, 0, bucket, out=out)
        torch.index_select(inside, 0, bucket, out=threshold)
        torch.ge(scaled, threshold, out=up)
        out.add_(up)
        scales[lo // QUANT_BLOCK : hi // QUANT_BLOCK].copy_(scale)


def dequantize_blocks(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, signed: bool
) -> None:
    """fp32 values of int8 ``codes`` with their blocks' ``scales`` into ``out``."""
    qmap = device_tables(signed, codes.device)[0]
    kernel = lowbit_kernel.load()
    if kernel is not None and lowbit_kernel.usable(codes, scales, out):
        lowbit_kernel.dequantize(kernel, codes, scales, out, qmap)
        return
    for lo in range(0, codes.numel(), QUANT_PIECE):
        hi = min(lo + QUANT_PIECE, codes.numel())
        values = out[lo:hi]
        torch.index_select(qmap, 0, codes[lo:hi].int(), out=values)
        values.view(-1, QUANT_BLOCK).mul_(scales[lo // QUANT_BLOCK : hi // QUANT_BLOCK].view(-1, 1))


@dataclass(frozen=True)
class MomentFormat:
    """How one Adam moment of a shard is stored: ``precision`` ("fp32", "bf16", "int8") and
    whether its values may be negative (exp_avg) or not (exp_avg_sq: the unsigned map)."""

    precision: str
    signed: bool

    @property
    def dtype(self) -> torch.dtype:
        """The stored slab's dtype."""
        return _STORED_DTYPES[self.precision]

    def padded_numel(self, numel: int) -> int:
        """fp32 elements a decoded moment of ``numel`` elements takes (whole int8 blocks)."""
        if self.precision != "int8":
            return numel
        return -(-numel // QUANT_BLOCK) * QUANT_BLOCK

    def stored_numel(self, numel: int) -> int:
        """Elements (of ``dtype``) of the slab storing a moment of ``numel`` elements."""
        return moment_stored_bytes(numel, self.precision) // self.dtype.itemsize

    def split(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """int8: views of a stored tensor's (codes, block scales)."""
        blocks = stored.numel() // (QUANT_BLOCK + 4)
        codes = stored[: blocks * QUANT_BLOCK]
        return codes, stored[blocks * QUANT_BLOCK :].view(torch.float32)

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """Write the fp32 values of ``stored`` into ``out`` (``padded_numel`` elements)."""
        if self.precision != "int8":
            out.copy_(stored)
            return
        codes, scales = self.split(stored)
        dequantize_blocks(codes, scales, out, signed=self.signed)

    def encode(
        self, values: torch.Tensor, stored: torch.Tensor, spans: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Store fp32 ``values`` (``padded_numel`` elements; int8: zero past the moment's end)
        into ``stored``; with ``spans`` ((start, end) element ranges), only the int8 blocks
        they touch ([Note: low-bit optimizer states])."""
        if self.precision != "int8":
            stored.copy_(values)
            return
        codes, scales = self.split(stored)
        for lo, hi in _block_spans(spans) if spans else [(0, values.numel())]:
            blocks = slice(lo // QUANT_BLOCK, hi // QUANT_BLOCK)
            quantize_blocks(values[lo:hi], codes[lo:hi], scales[blocks], signed=self.signed)

    def decode_range(self, stored: torch.Tensor, lo: int, out: torch.Tensor) -> None:
        """Decode ``out.numel()`` elements from element ``lo`` (int8: whole blocks, ``lo`` on a
        block boundary) of ``stored`` into ``out``: [Note: fused low-bit update]."""
        hi = lo + out.numel()
        if self.precision != "int8":
            out.copy_(stored[lo:hi])
            return
        codes, scales = self.split(stored)
        blocks = scales[lo // QUANT_BLOCK : hi // QUANT_BLOCK]
        dequantize_blocks(codes[lo:hi], blocks, out, signed=self.signed)

    def encode_range(
        self, values: torch.Tensor, stored: torch.Tensor, lo: int, spans: Sequence[tuple[int, int]]
    ) -> None:
        """Store the elements ``spans`` (relative to ``lo``) of fp32 ``values``, which hold
        elements ``lo:`` of the moment (int8: whole blocks, zero past the moment's end, and
        every block a span touches is encoded again)."""
        if self.precision != "int8":
            for a, b in spans:
                stored[lo + a : lo + b].copy_(values[a:b])
            return
        codes, scales = self.split(stored)
        for a, b in _block_spans(spans):
            blocks = slice((lo + a) // QUANT_BLOCK, (lo + b) // QUANT_BLOCK)
            quantize_blocks(values[a:b], codes[lo + a : lo + b], scales[blocks], signed=self.signed)

    def encoded(self, values: torch.Tensor) -> torch.Tensor:
        """A new stored tensor holding fp32 ``values`` (checkpoint loads, re-layout)."""
        padded = self.padded_numel(values.numel())
        if padded != values.numel():
            values = torch.cat([values, values.new_zeros(padded - values.numel())])
        stored = torch.zeros(self.stored_numel(values.numel()), dtype=self.dtype)
        self.encode(values.float(), stored)
        return stored

    @property
    def zero_code(self) -> int:
        """int8: the code of 0.0."""
        return int((dynamic_map(self.signed) == 0).nonzero()[0])

    def decoded(self, stored: torch.Tensor, numel: int) -> torch.Tensor:
        """The first ``numel`` fp32 values of a stored tensor (a new tensor)."""
        out = torch.empty(self.padded_numel(numel), dtype=torch.float32, device=stored.device)
        self.decode(stored, out)
        return out[:numel]


def decode_piece(
    codes: torch.Tensor, scales: torch.Tensor, phase: int, *, signed: bool
) -> torch.Tensor:
    """fp32 values of int8 ``codes`` that start ``phase`` elements into their first block (a
    parameter's piece of a shard, as checkpoints store it), bit for bit what decoding the
    whole shard gives."""
    block = (torch.arange(codes.numel()) + phase) // QUANT_BLOCK
    return dynamic_map(signed)[codes.int()] * scales[block]


def _block_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Element ranges widened to whole blocks and merged, in order."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        lo = start // QUANT_BLOCK * QUANT_BLOCK
        hi = -(-end // QUANT_BLOCK) * QUANT_BLOCK
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


@functools.cache
def moment_formats(optimizer_states: str) -> tuple[MomentFormat, MomentFormat]:
    """The formats of (exp_avg, exp_avg_sq) for ``Config.optimizer_states``."""
    precision = check_state_precision(optimizer_states)
    return MomentFormat(precision, signed=True), MomentFormat(precision, signed=False)


def moment_kind(optimizer_states: str) -> PayloadKind:
    """The payload kind of Adam moment slabs stored as ``optimizer_states``."""
    if check_state_precision(optimizer_states) == "fp32":
        return PayloadKind.OPTIM_STATE
    return PayloadKind.LOWBIT_STATE


__all__ = [
    "WORKSPACES",
    "MomentFormat",
    "device_tables",
    "kernel_tables",
    "decode_piece",
    "dequantize_blocks",
    "dynamic_map",
    "moment_formats",
    "moment_kind",
    "quantize_blocks",
]
