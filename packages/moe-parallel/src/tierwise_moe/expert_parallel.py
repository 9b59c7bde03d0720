"""The "expert" pattern: experts split over expert-parallel groups, the rest data-parallel."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierwise_moe.experts import ShardedExperts, check_supported, is_fused_experts, shard_experts_
from tierwise_moe.pattern import ModelParallelPattern

if TYPE_CHECKING:
    import torch.distributed as dist
    from tierwise.config import Config


class ExpertParallel(ModelParallelPattern):
    """Expert parallelism for HF MoE models with fused experts (Mixtral, Qwen2-MoE, ...).

    With size P each rank of an expert-parallel group (P consecutive ranks) keeps E/P experts of
    every MoE layer; tokens are sent to their experts' ranks and back (see
    ``tierwise_moe.experts``). Expert parameters are claimed by this pattern and their chunks are
    sharded over :meth:`dp_group`, the world/P ranks holding the same experts. Routers, attention
    and shared experts are left to data parallelism.

    [Note: expert and tensor parallel together]
    With ``parallel={"expert": P, "tensor": T}`` tensor-parallel groups are T consecutive ranks
    (fed the same batch) and an expert-parallel group takes one rank of each of P consecutive
    tensor-parallel groups, the usual tensor-innermost layout (world 4, P=T=2: tensor groups
    {0,1}, {2,3}; expert groups {0,2}, {1,3}; expert chunks sharded over {0,1}, {2,3}, the
    ranks holding the same experts). Experts are not split by tensor parallelism: the T ranks of
    a tensor-parallel group hold the same experts and compute them on the same tokens (T-fold
    redundant expert compute), and their identical expert gradients average to themselves, so
    the gradient scale of [Note: expert gradient scale] stays 1/P. (Expert groups made of
    tensor-parallel peers would compute the same numbers; this layout keeps the all-to-all off
    the tensor-parallel group's links.)
    """

    PLUGIN_NAME = "expert"

    def __init__(
        self,
        *,
        size: int,
        config: Config,
        process_group: dist.ProcessGroup | None,
        capacity_factor: float | None = None,
    ):
        if capacity_factor is None:
            capacity_factor = config.expert_capacity_factor
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"capacity_factor={capacity_factor!r}: give a positive factor (1.25 is common), "
                "or None for exact routing with no token dropped"
            )
        super().__init__(size=size, config=config, process_group=process_group)
        self.capacity_factor = capacity_factor
        """None: exact. Else the per-rank, per-expert row limit is ceil(factor * pairs / E)."""

    def _inner_size(self) -> int:
        # [Note: expert and tensor parallel together]
        return (self.config.parallel or {}).get("tensor", 1)

    def _shard_modules(self, model: torch.nn.Module) -> None:
        found = [
            (name, module)
            for name, module in model.named_modules()
            if isinstance(module, ShardedExperts) or is_fused_experts(module)
        ]
        if not found:
            raise ValueError(
                f"expert parallelism found no MoE experts in {type(model).__name__}: it looks "
                "for modules with fused 3-D gate_up_proj and down_proj parameters (transformers "
                "5.x Mixtral, Qwen2-MoE); drop 'expert' from parallel for a dense model"
            )
        for name, module in found:
            if isinstance(module, ShardedExperts):
                continue
            check_supported(module, name)
            shard_experts_(
                module,
                rank=self.mesh.mp_rank,
                size=self.mesh.mp_size,
                group=self.mesh.mp_group,
                capacity_factor=self.capacity_factor,
            )
