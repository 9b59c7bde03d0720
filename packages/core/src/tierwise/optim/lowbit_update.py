"""Adam(W) updates of chunks whose moments are stored in low precision ([Note: low-bit optimizer
states]): decoded a piece at a time around torch's fused kernel ([Note: fused low-bit update]), or,
for int8 on a CPU, updated in one compiled pass per block ([Note: int8 Adam in one pass]).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from tierwise.optim import lowbit_kernel
from tierwise.optim.adam import AdamHyper, adam_update_tensors
from tierwise.optim.state_formats import WORKSPACES, kernel_tables, moment_formats
from tierwise.precision import QUANT_BLOCK
from tierwise.tiers.ledger import MemoryPool

Update = Callable[[list[torch.Tensor]], None]


class PieceMoments:
    """The Adam moments of elements ``lo:hi`` of a shard while a piece of it is updated: fp32
    tensors holding just those elements (``exp_avg``/``exp_avg_sq``: decoded, or fp32 states
    themselves), or, for int8 states with the compiled kernel, the stored int8 moments updated
    in one pass per block ([Note: int8 Adam in one pass])."""

    def __init__(
        self,
        lo: int,
        hi: int,
        exp_avg: torch.Tensor | None = None,
        exp_avg_sq: torch.Tensor | None = None,
        int8: tuple[ctypes.CDLL, int, list[torch.Tensor]] | None = None,
    ) -> None:
        self.lo, self.hi = lo, hi
        self.exp_avg, self.exp_avg_sq = exp_avg, exp_avg_sq
        self.int8 = int8
        """(the compiled kernels, torch's vector width, the stored exp_avg and exp_avg_sq) for
        the one-pass update."""

    def adam(
        self,
        *,
        masters: list[torch.Tensor],
        grads: list[torch.Tensor],
        starts: list[int],
        steps: list[int],
        hyper: AdamHyper,
    ) -> None:
        """torch's fused Adam(W) on ``masters`` (views of the fp32 master holding the shard's
        elements ``starts[i]:``, inside ``lo:hi``) with their ``grads``, ``steps[i]`` being
        tensor i's count after this update: ``adam_update_tensors`` on the piece's moments."""
        if self.int8 is None:
            slices = [
                slice(s - self.lo, s - self.lo + t.numel())
                for s, t in zip(starts, masters, strict=True)
            ]
            adam_update_tensors(
                masters=masters,
                grads=grads,
                exp_avgs=[self.exp_avg[i] for i in slices],
                exp_avg_sqs=[self.exp_avg_sq[i] for i in slices],
                steps=steps,
                hyper=hyper,
            )
            return
        lib, width, stored = self.int8
        if not masters:
            return
        fmt = moment_formats("int8")
        moments = (*fmt[0].split(stored[0]), *fmt[1].split(stored[1]))
        tables = [table for signed in (True, False) for table in kernel_tables(signed)]
        tensors = [
            (s, m, g.to(torch.float32).contiguous(), step)
            for s, m, g, step in zip(starts, masters, grads, steps, strict=True)
        ]
        tensors = _cut_at_pieces(tensors)
        if not tensors:
            return
        hyper_values = (
            hyper.lr,
            hyper.beta1,
            hyper.beta2,
            hyper.eps,
            hyper.weight_decay,
            hyper.decoupled,
        )
        first = min(s for s, _, _, _ in tensors)
        last = max(s + m.numel() for s, m, _, _ in tensors)
        blocks = (first // QUANT_BLOCK, -(-last // QUANT_BLOCK))
        threads = torch.get_num_threads()
        lowbit_kernel.adam_int8(lib, moments, tensors, hyper_values, tables, blocks, threads, width)


def _cut_at_pieces(tensors: list[tuple]) -> list[tuple]:
    """(start, master, grad, step) tensors cut where FUSED_PIECE pieces end, as the pieces way
    hands them to torch's kernel (its scalar remainder depends on where a tensor ends: [Note:
    int8 Adam in one pass]); empty ones dropped."""
    out = []
    for start, master, grad, step in tensors:
        end = start + master.numel()
        at = start
        while at < end:
            cut = min(end, (at // FUSED_PIECE + 1) * FUSED_PIECE)
            out.append((at, master[at - start : cut - start], grad[at - start : cut - start], step))
            at = cut
    return out


RangeUpdate = Callable[[torch.Tensor, PieceMoments, int, int], None]
"""``(master, moments, lo, hi)``: the fp32 update of elements ``lo:hi`` of a shard, given its
whole fp32 master and the moments of those elements (``PieceMoments.adam``)."""

FUSED_PIECE = 1 << 18
"""Elements decoded, updated and encoded in one pass of a low-bit update ([Note: fused low-bit
update]): a multiple of QUANT_BLOCK; the piece's fp32 moments, master and gradient (4 x 1 MiB)
stay in the cache between the three steps, and the pieces are few enough that the kernel calls
per piece cost little (at 64K elements they cost bf16 states more than they saved)."""

# [Note: fused low-bit update]
# A chunk with low-bit moments is updated a piece of FUSED_PIECE elements at a time: both
# moments of the piece are decoded into two small per-thread fp32 buffers, the fused Adam(W)
# kernel runs on the piece (``RangeUpdate``), and the piece is encoded back, before the next
# piece is touched. Decoding the whole shard first (as before) streamed every fp32 moment
# through main memory three times (decode, update, encode); in pieces the fp32 values never
# leave the cache, and the buffers are small enough to stay resident. The arithmetic is the
# same elementwise kernel on the same values and the same whole int8 blocks (pieces are
# block-aligned), so the stored bytes are bitwise those of the whole-shard way. Pieces no
# span touches are skipped: nothing in them changes ([Note: low-bit optimizer states]).
# int8 states on a CPU with the compiled kernels go further: [Note: int8 Adam in one pass].

# [Note: int8 Adam in one pass]
# With int8 moments on a CPU and the compiled kernels built, a chunk's update is one C pass
# (``tw_adam_int8`` in ``lowbit_kernel``) over its 256-element blocks: decode both moments of a
# block into two stack arrays, run the Adam(W) update on the elements of the block that the
# update's tensors hold (the loop also keeps each moment's largest magnitude, so the encode
# does not read the block once more for its scale), encode the block back; the fp32 moments never reach memory and no
# kernel call or per-thread buffer is paid per piece. ``torch.get_num_threads()`` threads share
# the blocks, each taking the next 64 from a shared counter ([Note: blocks claimed by threads] in
# ``lowbit_kernel.c``; ctypes lets go of the GIL); on AVX2 machines the loops are intrinsics
# ([Note: int8 kernels in AVX2]). The update is torch's CPU fused Adam(W) (ATen's FusedAdamKernel.cpp, its
# AVX2/AVX512 ``Vectorized`` path, built by GCC, which fuses a multiplication into the
# following addition where it can) operation for operation: the coefficients in double as
# torch computes them (``pow`` of the step count) and then rounded to fp32; AdamW's decay a
# multiplication by fp32(1 - lr * wd), Adam's L2 term fma(param, wd, grad); exp_avg as torch's
# lerp, fma(w, grad - m, m) with w = 1 - beta1 (fma(w - 1, grad - m, grad) when w >= 0.5);
# exp_avg_sq = fma((1 - beta2) * grad, grad, v * beta2); denom = sqrt(v) / sqrt(bc2) + eps;
# param + (-step_size * m) / denom. torch's scalar remainder loop (the last numel % width
# elements of each tensor it is given) may fuse the other product of exp_avg_sq (its AVX2
# build does, its AVX512 build does not: [Note: torch's remainder] in ``lowbit_kernel.c``), so
# the kernel is told torch's vector width and remainder rule and cuts tensors where
# the pieces way cuts them (at FUSED_PIECE boundaries): an element rounds as it did. The C source
# is built without fast-math or contraction flags and calls fmaf only where torch's kernel
# fuses; ``one_pass_width`` checks once per process that the result is torch's kernel's, bit
# for bit, and the pieces way runs where it is not (another vector width, another build). So
# every moment code and scale and every master is bitwise what decoding, torch's kernel and
# encoding give (``tests/core/test_lowbit_kernel.py``: zeros, denormals, huge values, both weight
# decay modes, several steps, ragged tensors with their own step counts), with one exception
# that cannot be matched: where a master becomes NaN, its sign may differ (x86 returns the first
# operand's NaN when both are NaN, and which operand is first in torch's machine code is the
# compiler's choice, not its source's); the codes of NaN moments do not depend on the sign.
# Other devices, bf16 states and
# ``TIERWISE_LOWBIT_KERNEL=0`` keep the pieces of [Note: fused low-bit update].


class LowBitMoments:
    """Runs fp32 updates on moments stored as ``optimizer_states`` ([Note: low-bit optimizer
    states]): decodes them a piece at a time into per-thread fp32 buffers and encodes them back
    ([Note: fused low-bit update]), or updates int8 moments in one compiled pass ([Note: int8
    Adam in one pass])."""

    def __init__(self, optimizer_states: str) -> None:
        self.formats = moment_formats(optimizer_states)
        self.exact = optimizer_states == "fp32"
        """fp32 states: updates run on the stored tensors themselves (Invariant 2)."""
        self.int8 = optimizer_states == "int8"
        self.workspaces = WORKSPACES

    def _buffers(self, numel: int, device: torch.device) -> list[torch.Tensor]:
        """Two fp32 buffers of ``numel`` elements for this thread, reused until ``release``."""
        return list(self.workspaces.get("decode", numel, (torch.float32,) * 2, device))

    def release(self) -> None:
        """The step is over: the decode and quantize workspaces give their memory back."""
        self.workspaces.release()

    def pools(self) -> list[MemoryPool]:
        """The workspaces' ledger pools ([Note: the memory ledger])."""
        return list(self.workspaces.pools.values())

    def _one_pass(self, stored: Sequence[torch.Tensor]) -> tuple[ctypes.CDLL, int] | None:
        """(the compiled kernels, torch's vector width) when int8 ``stored`` moments are
        updated in one pass ([Note: int8 Adam in one pass])."""
        if not self.int8:
            return None
        kernel = lowbit_kernel.load()
        if kernel is None or not lowbit_kernel.usable(*stored):
            return None
        width = lowbit_kernel.one_pass_width(kernel)
        return None if width is None else (kernel, width)

    def around(
        self,
        update: RangeUpdate,
        *,
        numel: int,
        spans: Sequence[tuple[int, int]],
        finish: Callable[[torch.Tensor], None] | None = None,
    ) -> Update:
        """An update that takes the stored (master, exp_avg, exp_avg_sq) of a shard of
        ``numel`` elements: ``update`` runs on pieces with fp32 moments ([Note: fused low-bit
        update]; fp32 states: once, on the stored tensors; int8 with the compiled kernels:
        once, [Note: int8 Adam in one pass]), then ``finish(master)``; ``spans`` are the element
        ranges ``update`` changes."""
        formats = self.formats

        def run(states: list[torch.Tensor]) -> None:
            master, *stored = states
            kernel = self._one_pass(states)
            if self.exact:
                update(master, PieceMoments(0, numel, stored[0], stored[1]), 0, numel)
            elif kernel is not None:
                update(master, PieceMoments(0, numel, int8=(*kernel, stored)), 0, numel)
            else:
                for lo in range(0, numel, FUSED_PIECE):
                    hi = min(lo + FUSED_PIECE, numel)
                    inside = [(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]
                    if not inside:
                        continue
                    padded = formats[0].padded_numel(hi - lo)
                    decoded = self._buffers(padded, master.device)
                    for fmt, moment, out in zip(formats, stored, decoded, strict=True):
                        fmt.decode_range(moment, lo, out)
                    update(master, PieceMoments(lo, hi, decoded[0], decoded[1]), lo, hi)
                    local = [(a - lo, b - lo) for a, b in inside]
                    for fmt, moment, out in zip(formats, stored, decoded, strict=True):
                        fmt.encode_range(out, moment, lo, local)
            if finish is not None:
                finish(master)

        return run


__all__ = ["FUSED_PIECE", "LowBitMoments", "PieceMoments", "RangeUpdate", "Update"]
