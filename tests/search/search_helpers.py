"""Synthetic profiles and hardware for the search tests (no model, no profiler).

A module of its own, not conftest: ``from conftest import`` would find another test folder's
conftest when several folders are collected in one run.
"""

from __future__ import annotations

from tierwise import Hardware, ParamInfo, Profile


def make_profile(
    sizes: list[list[int]],
    *,
    layer_bytes: int = 0,
    layer_flops: float = 0.0,
    peak: int | None = None,
    checkpoint: bool = True,
    head: int = 0,
) -> Profile:
    """A stack of blocks: block ``b`` has modules ``blk{b}.m{i}`` each with one parameter of
    ``sizes[b][i]`` elements; an optional tied ``head`` parameter used first and last."""
    params, module_params, forward, blocks = [], {}, [], []
    if head:
        params.append(
            ParamInfo(name="emb.weight", shape=(head,), numel=head, aliases=("out.weight",))
        )
        module_params["emb"] = ["emb.weight"]
        module_params["out"] = ["emb.weight"]
        forward.append("emb.weight")
    for b, block in enumerate(sizes):
        names = []
        for i, numel in enumerate(block):
            name = f"blk{b}.m{i}.weight"
            params.append(ParamInfo(name=name, shape=(numel,), numel=numel))
            module_params[f"blk{b}.m{i}"] = [name]
            names.append(name)
        forward += names
        blocks.append(names)
    if head:
        forward.append("emb.weight")
    backward = list(reversed(forward))
    layers = {f"blk{b}": layer_bytes for b in range(len(sizes))} if layer_bytes else {}
    flops = {f"blk{b}": layer_flops * (1 + b % 3) for b in range(len(sizes))} if layer_bytes else {}
    return Profile(
        params=params,
        forward_order=forward,
        backward_order=backward,
        module_params=module_params,
        checkpoint_blocks=blocks if checkpoint else [],
        layer_activation_bytes=layers,
        layer_flops=flops,
        peak_activation_bytes=peak if peak is not None else layer_bytes * len(sizes),
        batch_size=2,
        seq_len=16,
        source="synthetic",
    )


def gpu_hardware(**overrides) -> Hardware:
    facts = dict(
        device_type="cuda",
        h2d_bandwidth=20e9,
        d2h_bandwidth=16e9,
        device_adam_velocity=40e9,
        host_adam_velocity=2e9,
        device_flops=100e12,
        matmul_efficiency=1.0,  # the tests reason in FLOPs / device_flops
        device_memory_bandwidth=1e12,
        nvme_read_bandwidth=3e9,
        nvme_write_bandwidth=2e9,
        interconnect_bandwidth=100e9,
    )
    facts.update(overrides)
    return Hardware(**facts)
