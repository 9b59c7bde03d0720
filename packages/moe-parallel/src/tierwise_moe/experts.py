"""Expert-parallel experts: this rank's slice of a fused HF experts module.

transformers 5.x stores the experts of a MoE layer (Mixtral, Qwen2-MoE, ...) as two fused 3-D
parameters, ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I], and calls the experts module
as ``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``. With
expert-parallel size P, :func:`shard_experts_` makes the module a :class:`ShardedExperts` that
keeps experts ``[rank*E/P, (rank+1)*E/P)`` of both parameters (dim 0 sliced in place, see
[Note: sharding in place]) and runs one forward as:

1. sort the T*k (token, expert) pairs by expert; optionally drop pairs over capacity;
2. all-to-all the per-expert counts, then the token rows, to the ranks owning the experts;
3. run each local expert on its rows (every local expert runs, even on zero rows);
4. all-to-all the results back, weight them by the router and sum the k results per token.

The router and everything outside the experts stay data-parallel.

[Note: expert gradient scale]
Every rank computes its loss on its own tokens, and data-parallel averaging divides gradients by
the size of a parameter's data-parallel group. An expert on rank r receives gradient from the
tokens of all P ranks of its expert-parallel group, so its gradient would be P times too large
after averaging over only the world/P ranks that hold the same experts. The experts' gradients
are therefore scaled by 1/P in backward: after backward, every parameter's ``.grad`` is "this
rank's share", to be averaged over the parameter's data-parallel group, exactly as for dense
parameters under DistributedDataParallel.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from tierwise_moe.collectives import all_to_all, exchange_counts
from tierwise_moe.rows import gather_rows, inverse_permutation, permute_rows
from tierwise_moe.shards import ShardSpec, shard_param_, swap_class_

FUSED_PARAMS = ("gate_up_proj", "down_proj")


class UnsupportedExperts(TypeError):
    """An experts module whose layout expert parallelism does not handle."""


def is_fused_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds fused 3-D expert weights the HF 5.x way."""
    return all(
        isinstance(getattr(module, name, None), torch.nn.Parameter)
        and getattr(module, name).dim() == 3
        for name in FUSED_PARAMS
    ) and isinstance(getattr(module, "num_experts", None), int)


def check_supported(module: torch.nn.Module, name: str) -> None:
    """Raise UnsupportedExperts naming what differs from the layout ShardedExperts computes."""
    expected = {
        "has_gate": True,
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": True,
        "has_post_expert_norm": False,
    }
    for attr, value in expected.items():
        if getattr(module, attr, value) != value:
            raise UnsupportedExperts(
                f"{name} ({type(module).__name__}) has {attr}={getattr(module, attr)!r}; expert "
                f"parallelism supports fused experts with {attr}={value!r} (Mixtral, Qwen2-MoE "
                "layout): leave this model out of expert parallelism"
            )
    gate = getattr(type(module), "_apply_gate", None)
    if gate is not None and gate.__name__ != "_default_apply_gate":
        raise UnsupportedExperts(
            f"{name} ({type(module).__name__}) overrides _apply_gate; expert parallelism "
            "computes act(gate) * up only"
        )


def capacity(capacity_factor: float, pairs: int, num_experts: int) -> int:
    """Rows one expert accepts from one rank: ceil(factor * pairs / experts)."""
    return math.ceil(capacity_factor * pairs / num_experts)


class ShardedExperts(torch.nn.Module):
    """Mixin for a fused experts module holding this rank's E/P experts; tokens travel to
    their expert's rank. Made with :func:`shard_experts_` (see [Note: sharding in place])."""

    num_experts: int
    """Experts of the whole layer (E); unchanged by sharding."""
    local_experts: int
    """Experts on this rank (E/P): global ids [rank*E/P, (rank+1)*E/P)."""
    capacity_factor: float | None
    """None: exact (no token dropped). Else each rank sends each expert at most
    ceil(factor * its pairs / E) rows; dropped pairs add nothing to the token's output."""
    ep_rank: int
    """This rank's position in its expert-parallel group."""
    ep_size: int
    """Expert-parallel size (P)."""
    ep_group: dist.ProcessGroup | None
    """The P ranks that split this layer's experts (None: P = 1)."""
    last_tokens_per_expert: torch.Tensor | None
    """Rows each local expert computed in the latest forward (for tests and stats)."""

    def extra_repr(self) -> str:
        first = self.ep_rank * self.local_experts
        return (
            f"experts {first}..{first + self.local_experts - 1} of {self.num_experts} "
            f"(rank {self.ep_rank} of {self.ep_size}), capacity_factor={self.capacity_factor}"
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        pair_expert = top_k_index.reshape(-1)
        order = torch.argsort(pair_expert, stable=True)  # pairs grouped by expert, token order
        counts = torch.bincount(pair_expert, minlength=self.num_experts)
        if self.capacity_factor is not None:
            order, counts = self._drop_over_capacity(order, pair_expert[order], counts)
        send_rows = gather_rows(hidden_states, order // top_k)

        # counts[e] for the experts of rank r form block r: after the exchange, block r holds
        # what rank r sends to each of this rank's experts.
        recv_counts = exchange_counts(counts, self.ep_group).view(self.ep_size, self.local_experts)
        send_splits = counts.view(self.ep_size, self.local_experts).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        recv_rows = all_to_all(send_rows, recv_splits, send_splits, self.ep_group)

        # received rows: source-major, expert-minor; regroup expert-major for the matmuls
        local_expert = torch.arange(self.local_experts, device=recv_counts.device)
        row_expert = local_expert.repeat(self.ep_size).repeat_interleave(recv_counts.reshape(-1))
        by_expert = torch.argsort(row_expert, stable=True)
        source_major = inverse_permutation(by_expert)
        rows_per_expert = recv_counts.sum(0)
        self.last_tokens_per_expert = rows_per_expert.detach().cpu()
        out_rows = self._run_local_experts(
            permute_rows(recv_rows, by_expert, source_major), rows_per_expert.tolist()
        )
        out_rows = permute_rows(out_rows, source_major, by_expert)

        back_rows = all_to_all(out_rows, send_splits, recv_splits, self.ep_group)
        back_rows = back_rows.to(hidden_states.dtype)
        if order.numel() == num_tokens * top_k:  # nothing dropped: ``order`` is a permutation
            pair_out = permute_rows(back_rows, inverse_permutation(order), order)
        else:  # dropped pairs add nothing
            pair_out = back_rows.new_zeros((num_tokens * top_k, back_rows.shape[-1]))
            pair_out = pair_out.index_copy(0, order, back_rows)
        weighted = pair_out * top_k_weights.reshape(-1, 1)
        return weighted.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)

    def _drop_over_capacity(self, order, sorted_expert, counts):
        limit = capacity(self.capacity_factor, sorted_expert.numel(), self.num_experts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(sorted_expert.numel(), device=order.device) - starts[sorted_expert]
        keep = position < limit
        return order[keep], counts.clamp(max=limit)

    def _run_local_experts(self, rows: torch.Tensor, rows_per_expert: list[int]) -> torch.Tensor:
        return _LocalExperts.apply(
            rows,
            self.gate_up_proj,
            self.down_proj,
            rows_per_expert,
            self.act_fn,
            1.0 / self.ep_size,  # [Note: expert gradient scale]
        )


class _LocalExperts(torch.autograd.Function):
    """Every local expert's gated MLP on its rows (rows grouped by expert).

    [Note: fused expert gradients]
    Indexing ``gate_up_proj[e]`` per expert under autograd gives each expert's weight gradient
    as a zero-filled tensor the size of the *whole* parameter, which autograd then sums: E/P
    full-size fills and additions per parameter per backward, plus a full-size multiply for the
    1/P scale. Here each expert's weight gradient is written by one matmul straight into its
    slice of a single gradient tensor (an expert with no rows gets zeros from the empty product),
    scaled on the way. Work stays per expert so that an expert's rows stay in cache between its
    matmuls and its activation; backward recomputes the activation from the saved gate rather
    than keeping it. The products are autograd's (up to the order of summation in a matmul).
    """

    @staticmethod
    def forward(ctx, rows, gate_up, down, rows_per_expert, act_fn, grad_scale):
        gate_up_out = rows.new_empty((rows.shape[0], gate_up.shape[1]))
        result = rows.new_empty((rows.shape[0], down.shape[1]))
        for e, (x, gu, out) in enumerate(_per_expert(rows_per_expert, rows, gate_up_out, result)):
            torch.mm(x, gate_up[e].t(), out=gu)
            gate, up = gu.chunk(2, dim=-1)
            torch.mm(act_fn(gate) * up, down[e].t(), out=out)
        ctx.save_for_backward(rows, gate_up_out, gate_up, down)
        ctx.rows_per_expert, ctx.act_fn, ctx.grad_scale = rows_per_expert, act_fn, grad_scale
        return result

    @staticmethod
    def backward(ctx, grad_result):
        rows, gate_up_out, gate_up, down = ctx.saved_tensors
        need_rows, need_gate_up, need_down = ctx.needs_input_grad[:3]
        scale = ctx.grad_scale
        grad_gate_up = torch.empty_like(gate_up) if need_gate_up else None
        grad_down = torch.empty_like(down) if need_down else None
        grad_rows = torch.empty_like(rows)
        grad_gu_all = torch.empty_like(gate_up_out)
        for e, (x, gu, g_out, g_gu, g_x) in enumerate(
            _per_expert(
                ctx.rows_per_expert,
                rows,
                gate_up_out,
                grad_result.contiguous(),
                grad_gu_all,
                grad_rows,
            )
        ):
            gate, up = gu.chunk(2, dim=-1)
            with torch.enable_grad():
                gate = gate.detach().requires_grad_()
                activated = ctx.act_fn(gate)
            if need_down:
                hidden = activated.detach() * up
                torch.addmm(grad_down[e], g_out.t(), hidden, beta=0, alpha=scale, out=grad_down[e])
            grad_hidden = torch.mm(g_out, down[e])
            grad_gate, grad_up = g_gu.chunk(2, dim=-1)
            torch.mul(grad_hidden, activated.detach(), out=grad_up)
            grad_gate.copy_(torch.autograd.grad(activated, gate, grad_hidden.mul_(up))[0])
            if need_gate_up:
                torch.addmm(grad_gate_up[e], g_gu.t(), x, beta=0, alpha=scale, out=grad_gate_up[e])
            torch.mm(g_gu, gate_up[e], out=g_x)
        return grad_rows if need_rows else None, grad_gate_up, grad_down, None, None, None


def _per_expert(rows_per_expert: list[int], *tensors: torch.Tensor):
    """Per expert, its consecutive rows of each tensor."""
    return zip(*(t.split(rows_per_expert) for t in tensors), strict=True)


def shard_experts_(
    experts: torch.nn.Module,
    *,
    rank: int,
    size: int,
    group: dist.ProcessGroup | None,
    capacity_factor: float | None = None,
) -> None:
    """Turn a fused experts module into a :class:`ShardedExperts` holding experts
    [rank*E/P, (rank+1)*E/P) (dim 0 of both fused parameters), in place."""
    num_experts = experts.num_experts
    if num_experts % size:
        raise UnsupportedExperts(
            f"{num_experts} experts do not split over expert-parallel size {size}: "
            f"use a size that divides {num_experts}"
        )
    spec = ShardSpec(pattern="expert", dim=0, rank=rank, size=size, group=group)
    for name in FUSED_PARAMS:
        shard_param_(getattr(experts, name), spec)
    swap_class_(experts, ShardedExperts)
    experts.local_experts = num_experts // size
    experts.ep_rank, experts.ep_size, experts.ep_group = rank, size, group
    experts.capacity_factor = capacity_factor
    experts.last_tokens_per_expert = None
